//! The coordinator's decisions, as pure functions of state and observations: whether a
//! step's update is applied, how its gradients are clipped and unscaled, how the loss
//! scale moves, and when to evaluate or save. The coordinator actor only gathers what
//! they need and carries out what they return, so they are tested without a runtime.

use serde::{Deserialize, Serialize};

pub use crate::grad_stats::GradStats;

/// ONNX Runtime's `DynamicLossScaler` (`onnxruntime.training.amp`): the scale doubles
/// after `window` consecutive finite steps and halves on a step with a non-finite
/// gradient (whose update is skipped), clamped to `[min, max]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicScaling {
    /// The first scale; ORT's default 2^16.
    pub initial: f64,
    /// Finite steps before the scale doubles; ORT's default 2000.
    pub window: u64,
    /// Smallest scale; ORT's default 1.
    pub min: f64,
    /// Largest scale; ORT's default 2^24.
    pub max: f64,
}

impl Default for DynamicScaling {
    fn default() -> Self {
        DynamicScaling {
            initial: 65536.0,
            window: 2000,
            min: 1.0,
            max: 16_777_216.0,
        }
    }
}

/// How the loss is scaled before backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScaling {
    /// A fixed factor (1 is no scaling). A non-finite gradient stops the run.
    Static(f64),
    /// ONNX Runtime's dynamic scaling: a non-finite gradient skips the step.
    Dynamic(DynamicScaling),
}

/// The loss scaler's state: what a checkpoint keeps so that a resumed run scales on
/// exactly as the uninterrupted one would.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The scale of the next step.
    pub scale: f64,
    /// Consecutive finite steps since the scale last changed.
    pub stable_steps: u64,
}

impl LossScaling {
    /// The state a run starts from.
    pub fn initial_state(&self) -> ScalerState {
        let scale = match *self {
            LossScaling::Static(s) => s,
            LossScaling::Dynamic(d) => d.initial,
        };
        ScalerState {
            scale,
            stable_steps: 0,
        }
    }

    /// The state after a step whose gradients were (`all_finite`) or were not finite.
    pub fn next(&self, state: ScalerState, all_finite: bool) -> ScalerState {
        let LossScaling::Dynamic(d) = *self else {
            return state;
        };
        if !all_finite {
            return ScalerState {
                scale: (state.scale / 2.0).max(d.min),
                stable_steps: 0,
            };
        }
        let stable = state.stable_steps + 1;
        if stable >= d.window {
            ScalerState {
                scale: (state.scale * 2.0).min(d.max),
                stable_steps: 0,
            }
        } else {
            ScalerState {
                scale: state.scale,
                stable_steps: stable,
            }
        }
    }
}

/// What the coordinator decides for a step's update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradPolicy {
    /// Clip the global gradient norm to this (`max_grad_norm`).
    pub max_norm: Option<f64>,
    /// Loss scaling.
    pub scaling: LossScaling,
}

impl Default for GradPolicy {
    fn default() -> Self {
        GradPolicy {
            max_norm: None,
            scaling: LossScaling::Static(1.0),
        }
    }
}

impl GradPolicy {
    /// Whether a stage must wait for every stage's statistics before its update: the
    /// global norm (clipping) and the skip decision (dynamic scaling) need all of them.
    /// Otherwise each stage applies [`GradPolicy::decide`] to its own statistics alone.
    pub fn needs_barrier(&self) -> bool {
        self.max_norm.is_some() || matches!(self.scaling, LossScaling::Dynamic(_))
    }

    /// Whether the update needs no statistics first: without clipping and with the loss
    /// unscaled (static scale 1), every step applies its gradients as they are. (A
    /// non-finite gradient then stops the run at the step's end, whatever the update
    /// did with it.) A stage may then take its statistics during the update's own pass
    /// over the gradients ([`StageCompute::update_counting`](crate::StageCompute)).
    pub fn update_is_fixed(&self) -> bool {
        self.max_norm.is_none() && self.scaling == LossScaling::Static(1.0)
    }
}

/// The coordinator's decision for one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDecision {
    /// Apply the update (false: a dynamic-scaling overflow; gradients are dropped).
    pub apply: bool,
    /// Multiply the gradients by this before the optimizer: unscale and clip in one.
    pub grad_scale: f64,
    /// The loss scale of the next step.
    pub next_loss_scale: f64,
    /// Global L2 norm of the unscaled gradients (not finite on overflow).
    pub grad_norm: f64,
    /// The clip coefficient applied, when clipping is on.
    pub clip_coef: Option<f64>,
}

impl GradPolicy {
    /// Decides a step from the statistics of every stage (each counted once) and the
    /// scaler's state; returns the decision and the scaler's next state.
    ///
    /// The norm is that of the unscaled gradients, and clipping follows
    /// `torch.nn.utils.clip_grad_norm_`: `g *= min(1, max_norm / (norm + 1e-6))`.
    pub fn decide(&self, state: ScalerState, stats: &[GradStats]) -> (StepDecision, ScalerState) {
        let sum_sq: f64 = stats.iter().map(|s| s.sum_sq).sum();
        let finite = sum_sq.is_finite();
        let scale = state.scale;
        let grad_norm = sum_sq.sqrt() / scale;
        let clip_coef = self.max_norm.map(|max| (max / (grad_norm + 1e-6)).min(1.0));
        let next = self.scaling.next(state, finite);
        let apply = finite || matches!(self.scaling, LossScaling::Static(_));
        let decision = StepDecision {
            apply,
            grad_scale: if finite {
                clip_coef.unwrap_or(1.0) / scale
            } else {
                0.0
            },
            next_loss_scale: next.scale,
            grad_norm,
            clip_coef: clip_coef.filter(|_| finite),
        };
        (decision, next)
    }
}

/// Whether to evaluate after optimizer step `step` (from 0).
pub fn evaluation_due(step: u64, every: Option<u64>) -> bool {
    every.is_some_and(|e| (step + 1) % e.max(1) == 0)
}

/// Whether to save a checkpoint after optimizer step `step` (from 0) of a run whose last
/// step is `last`: every `every` steps, and after the last step (as ONNX Runtime's runner
/// saves once more when training ends), so that a finished run can be exported from its
/// checkpoint and a restarted job sees that nothing is left to do.
pub fn checkpoint_due(step: u64, every: Option<u64>, last: u64) -> bool {
    every.is_some_and(|e| (step + 1) % e.max(1) == 0 || step == last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(v: &[f64]) -> Vec<GradStats> {
        v.iter().map(|&sum_sq| GradStats { sum_sq }).collect()
    }

    #[test]
    fn dynamic_scale_doubles_after_window_and_halves_on_overflow() {
        let d = LossScaling::Dynamic(DynamicScaling {
            window: 3,
            ..DynamicScaling::default()
        });
        let mut s = d.initial_state();
        assert_eq!(s.scale, 65536.0);
        for _ in 0..2 {
            s = d.next(s, true);
        }
        assert_eq!((s.scale, s.stable_steps), (65536.0, 2));
        s = d.next(s, true);
        assert_eq!((s.scale, s.stable_steps), (131072.0, 0));
        s = d.next(s, true);
        s = d.next(s, false);
        assert_eq!(
            (s.scale, s.stable_steps),
            (65536.0, 0),
            "halved, counter reset"
        );
    }

    #[test]
    fn dynamic_scale_is_clamped() {
        let d = DynamicScaling {
            initial: 2.0,
            window: 1,
            min: 1.0,
            max: 4.0,
        };
        let scaling = LossScaling::Dynamic(d);
        let mut s = scaling.initial_state();
        for _ in 0..5 {
            s = scaling.next(s, true);
        }
        assert_eq!(s.scale, 4.0);
        for _ in 0..5 {
            s = scaling.next(s, false);
        }
        assert_eq!(s.scale, 1.0);
    }

    #[test]
    fn static_scale_never_moves() {
        let s = LossScaling::Static(8.0);
        let st = s.initial_state();
        assert_eq!(s.next(st, false), st);
        assert_eq!(s.next(st, true), st);
    }

    #[test]
    fn clipping_follows_torch_clip_grad_norm() {
        let p = GradPolicy {
            max_norm: Some(1.0),
            scaling: LossScaling::Static(1.0),
        };
        let state = p.scaling.initial_state();
        // Two stages: norms 3 and 4 make a global norm of 5.
        let (d, _) = p.decide(state, &stats(&[9.0, 16.0]));
        assert!(d.apply);
        assert_eq!(d.grad_norm, 5.0);
        let coef = 1.0 / (5.0 + 1e-6);
        assert_eq!(d.clip_coef, Some(coef));
        assert_eq!(d.grad_scale, coef);
        // Below the limit: a coefficient of 1, nothing changes.
        let (d, _) = p.decide(state, &stats(&[0.01, 0.0]));
        assert_eq!((d.clip_coef, d.grad_scale), (Some(1.0), 1.0));
    }

    #[test]
    fn scaled_gradients_are_unscaled_before_the_norm() {
        let p = GradPolicy {
            max_norm: Some(100.0),
            scaling: LossScaling::Static(4.0),
        };
        let (d, _) = p.decide(p.scaling.initial_state(), &stats(&[16.0 * 4.0]));
        assert_eq!(d.grad_norm, 2.0, "sqrt(64) / 4");
        assert_eq!(d.grad_scale, 0.25);
    }

    #[test]
    fn overflow_skips_under_dynamic_scaling_only() {
        let dynamic = GradPolicy {
            max_norm: None,
            scaling: LossScaling::Dynamic(DynamicScaling::default()),
        };
        let st = dynamic.scaling.initial_state();
        let (d, next) = dynamic.decide(st, &stats(&[1.0, f64::INFINITY]));
        assert!(!d.apply);
        assert_eq!(d.grad_scale, 0.0);
        assert_eq!(next.scale, 32768.0);
        assert_eq!(d.next_loss_scale, 32768.0);
        assert!(dynamic.needs_barrier());
        let fixed = GradPolicy::default();
        assert!(!fixed.needs_barrier());
        let (d, _) = fixed.decide(fixed.scaling.initial_state(), &stats(&[f64::NAN]));
        assert!(d.apply, "static scaling leaves the stop to the coordinator");
        assert!(!d.grad_norm.is_finite());
    }

    /// The update needs no statistics first exactly when every finite step's decision
    /// is "apply the gradients as they are".
    #[test]
    fn the_update_is_fixed_without_clipping_and_scaling_only() {
        // Norm 3: clipping to 1 scales the gradients.
        let finite = stats(&[2.0, 7.0]);
        let policies = [
            (GradPolicy::default(), true),
            (
                GradPolicy {
                    max_norm: Some(1.0),
                    ..GradPolicy::default()
                },
                false,
            ),
            (
                GradPolicy {
                    scaling: LossScaling::Static(1024.0),
                    ..GradPolicy::default()
                },
                false,
            ),
            (
                GradPolicy {
                    scaling: LossScaling::Dynamic(DynamicScaling::default()),
                    ..GradPolicy::default()
                },
                false,
            ),
        ];
        for (p, fixed) in policies {
            assert_eq!(p.update_is_fixed(), fixed, "{p:?}");
            let (d, _) = p.decide(p.scaling.initial_state(), &finite);
            let as_they_are = d.apply && d.grad_scale == 1.0 && d.next_loss_scale == 1.0;
            assert_eq!(as_they_are, fixed, "{p:?}: {d:?}");
        }
    }

    #[test]
    fn evaluation_and_checkpoints_fall_on_their_period() {
        let evals: Vec<u64> = (0..10).filter(|&s| evaluation_due(s, Some(4))).collect();
        assert_eq!(evals, vec![3, 7]);
        assert!(!evaluation_due(3, None));
        let saves: Vec<u64> = (0..10).filter(|&s| checkpoint_due(s, Some(4), 9)).collect();
        assert_eq!(saves, vec![3, 7, 9], "and after the last step");
        assert!(!checkpoint_due(9, None, 9));
    }
}
