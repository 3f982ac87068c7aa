//! One optimizer step as an element-wise program: a rule and, per stretch of the flat
//! buffer, the step's constants. A device applies it with its own kernels
//! (`compute/kernels/update.cu`) over buffers it keeps, while the optimizer here stays
//! the one source of the formulas' constants and of the step count.
//!
//! Each rule is the loop of its CPU optimizer (`sgd.rs`, `adam.rs`), value by value, with
//! the gradient first multiplied by the step's gradient scale (unscaling and clipping):
//!
//! ```text
//! Sgd          [lr, wd]                         g = g*s + wd*p;  p -= lr*g
//! SgdMomentum  [lr, wd, keep, take, gc, bc]     g = g*s + wd*p;  b = keep*b + take*g;
//!                                               p -= lr*(gc*g + bc*b)
//! Adam         [l2, shrink, w1, b2, w2, eps,    g = g*s + l2*p;  m = lerp(m, g, w1);
//!               bias2_sqrt, step_size]          v = v*b2 + w2*g*g;
//!                                               p = p*shrink - step_size*(m/(sqrt(v)/bias2_sqrt + eps))
//! ```
//!
//! Compiled without contracting into FMAs, with IEEE division and square root, a device
//! gives bitwise the CPU loop's values.

use std::ops::Range;

/// Which element-wise update, and which state buffers it keeps (in [`Optimizer::state`]'s
/// order).
///
/// [`Optimizer::state`]: super::Optimizer::state
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// SGD without momentum: no state.
    Sgd,
    /// SGD with momentum (and dampening, Nesterov): `momentum_buffer`.
    SgdMomentum,
    /// Adam and AdamW: `exp_avg`, `exp_avg_sq`.
    Adam,
}

/// One step: the rule and each stretch's constants (see the module's table).
#[derive(Debug, Clone, PartialEq)]
pub struct ElementwiseStep {
    /// The update.
    pub rule: Rule,
    /// Each stretch of the flat buffer (whole tensors) and its constants.
    pub segments: Vec<(Range<usize>, [f32; 8])>,
}

impl ElementwiseStep {
    /// Applies the step on the host, value by value as the device kernels do: the
    /// reference they are checked against. `state` holds the rule's buffers in order;
    /// gradients are multiplied by `scale` first.
    pub fn apply_on_host(
        &self,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [Vec<f32>],
        scale: f32,
    ) {
        for (r, k) in &self.segments {
            for i in r.clone() {
                let g = grads[i] * scale;
                let p = &mut params[i];
                match self.rule {
                    Rule::Sgd => {
                        let g = g + k[1] * *p;
                        *p -= k[0] * g;
                    }
                    Rule::SgdMomentum => {
                        let g = g + k[1] * *p;
                        let b = &mut state[0][i];
                        *b = k[2] * *b + k[3] * g;
                        *p -= k[0] * (k[4] * g + k[5] * *b);
                    }
                    Rule::Adam => {
                        let g = g + k[0] * *p;
                        let m = lerp(state[0][i], g, k[2]);
                        state[0][i] = m;
                        let v = state[1][i] * k[3] + k[4] * g * g;
                        state[1][i] = v;
                        let denom = v.sqrt() / k[6] + k[5];
                        *p = *p * k[1] - k[7] * (m / denom);
                    }
                }
            }
        }
    }
}

/// PyTorch's `lerp`, as `adam.rs` computes it.
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{build_grouped, OptimizerConfig, ParamGroup, ParamLayout};

    fn wave(n: usize, k: u64) -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i.wrapping_mul(k) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    /// Two steps of each optimizer (with a parameter group, so two stretches), once by
    /// its own loop and once as the element-wise program applied on the host: bitwise
    /// the same parameters and state.
    #[test]
    fn the_elementwise_program_is_bitwise_the_optimizers_own_step() {
        let layout = ParamLayout::new([("a.weight", vec![37, 5]), ("a.bias", vec![37])]);
        let group = |adam: bool| ParamGroup {
            params: vec!["*.bias".into()],
            weight_decay: Some(0.0),
            lr_scale: Some(0.5),
            beta1: adam.then_some(0.8),
            beta2: None,
            eps: None,
        };
        let configs = [
            "kind = \"sgd\"\nweight_decay = 0.01",
            "kind = \"sgd\"\nmomentum = 0.9\ndampening = 0.1\nnesterov = false\nweight_decay = 0.01",
            "kind = \"sgd\"\nmomentum = 0.9\nnesterov = true",
            "kind = \"adam\"\nweight_decay = 0.01",
            "kind = \"adamw\"\nweight_decay = 0.1",
        ];
        for text in configs {
            let cfg: OptimizerConfig = toml::from_str(text).unwrap();
            let groups = [group(text.contains("adam"))];
            let mut own = build_grouped(&cfg, &groups, &layout).unwrap();
            let mut prog = build_grouped(&cfg, &groups, &layout).unwrap();
            let p0 = wave(layout.len(), 2_654_435_761);
            let (mut p_own, mut p_prog) = (p0.clone(), p0.clone());
            let mut state: Vec<Vec<f32>> = own
                .state()
                .iter()
                .map(|(_, s)| vec![0.0; s.len()])
                .collect();
            for (step, scale) in [(1u64, 1.0f32), (2, 0.5)] {
                let g = wave(layout.len(), 40_503 + step);
                let scaled: Vec<f32> = g.iter().map(|x| x * scale).collect();
                own.step(&mut p_own, &scaled, 1e-2).unwrap();
                let program = prog.elementwise_step(1e-2).expect("element-wise");
                program.apply_on_host(&mut p_prog, &g, &mut state, scale);
            }
            assert_ne!(p_own, p0, "{text}: nothing moved");
            assert_eq!(p_own, p_prog, "{text}: parameters");
            assert_eq!(own.step_count(), prog.step_count(), "{text}: step count");
            for ((name, a), b) in own.state().iter().zip(&state) {
                assert_eq!(a, &b.as_slice(), "{text}: {name}");
            }
        }
        let lamb: OptimizerConfig = toml::from_str("kind = \"lamb\"").unwrap();
        let mut lamb = build_grouped(&lamb, &[], &layout).unwrap();
        assert!(lamb.elementwise_step(1e-2).is_none());
        assert_eq!(lamb.step_count(), 0, "LAMB counts no step it did not take");
    }
}
