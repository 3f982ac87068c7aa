//! Adam and AdamW, as `torch.optim.Adam` and `torch.optim.AdamW`.

use pipetrain_actors::GradStats;

use super::groups::Segment;
use super::pieces::{piece_len, run_pieces};
use super::{check_lengths, counted, load_buffers, Optimizer};
use crate::Result;

/// How weight decay enters the update: the one difference between Adam and AdamW.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decay {
    /// Adam: `g = g + weight_decay * p`, so the decay is rescaled by the second moment.
    L2,
    /// AdamW (Loshchilov & Hutter): `p = p * (1 - lr * weight_decay)` before the update.
    Decoupled,
}

/// `torch.optim.Adam` (`amsgrad=False`) and `torch.optim.AdamW`, default single-tensor
/// path, per value, with `t` counting steps from 1:
///
/// ```text
/// g = g + weight_decay * p                     (Adam only)
/// p = p * (1 - lr * weight_decay)              (AdamW only)
/// m = lerp(m, g, 1 - beta1)                    (= beta1 * m + (1 - beta1) * g)
/// v = beta2 * v + (1 - beta2) * g * g
/// p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// `lerp` is PyTorch's CPU formula (`m + w * (g - m)` for `|w| < 0.5`), so the first moment
/// rounds as PyTorch's does. The last line is the one in the peers' README once the bias
/// corrections are moved onto the scalars, which is how PyTorch computes it.
pub(crate) struct Adam {
    decay: Decay,
    /// Stretches of the buffer and their betas, eps, weight decay and learning-rate scale
    /// (one without parameter groups).
    segments: Vec<Segment>,
    /// First moment (`exp_avg`).
    m: Vec<f32>,
    /// Second moment (`exp_avg_sq`).
    v: Vec<f32>,
    step: u64,
}

impl Adam {
    /// Adam or AdamW over `len` values laid out as `segments`, moments zero.
    pub(crate) fn new(len: usize, decay: Decay, segments: Vec<Segment>) -> Adam {
        Adam {
            decay,
            segments,
            m: vec![0.0; len],
            v: vec![0.0; len],
            step: 0,
        }
    }
}

/// PyTorch's CPU `lerp` for one value; `w` is the same for the whole loop, so the branch
/// becomes a select and the loop still vectorizes.
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

impl Optimizer for Adam {
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<()> {
        check_lengths(self.m.len(), params, grads)?;
        self.step += 1;
        let ks = self.coefficients(lr);
        for ((r, _), k) in self.segments.iter().zip(&ks) {
            let (m, v) = (&mut self.m[r.clone()], &mut self.v[r.clone()]);
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            let n = piece_len(p.len());
            let parts =
                (p.chunks_mut(n).zip(g.chunks(n))).zip(m.chunks_mut(n).zip(v.chunks_mut(n)));
            run_pieces(parts, |((p, g), (m, v))| adam_update(p, g, m, v, k));
        }
        Ok(())
    }

    fn step_counting(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<GradStats> {
        check_lengths(self.m.len(), params, grads)?;
        if !counted::on_one_core(params.len()) {
            let stats = GradStats::of(grads);
            self.step(params, grads, lr)?;
            return Ok(stats);
        }
        self.step += 1;
        let ks = self.coefficients(lr);
        let (m, v) = (&mut self.m, &mut self.v);
        Ok(counted::windows(grads, &self.segments, |i, r| {
            let (m, v) = (&mut m[r.clone()], &mut v[r.clone()]);
            adam_update(&mut params[r.clone()], &grads[r], m, v, &ks[i]);
        }))
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn elementwise_step(&mut self, lr: f64) -> Option<super::ElementwiseStep> {
        self.step += 1;
        let segments = self
            .segments
            .iter()
            .zip(self.coefficients(lr))
            .map(|((r, _), k)| {
                let c = [
                    k.l2,
                    k.shrink,
                    k.w1,
                    k.b2,
                    k.w2,
                    k.eps,
                    k.bias2_sqrt,
                    k.step_size,
                ];
                (r.clone(), c)
            })
            .collect();
        Some(super::ElementwiseStep {
            rule: super::Rule::Adam,
            segments,
        })
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        vec![("exp_avg", &self.m), ("exp_avg_sq", &self.v)]
    }

    fn load_state(&mut self, step: u64, state: &[(&str, &[f32])]) -> Result<()> {
        load_buffers(
            &mut [("exp_avg", &mut self.m), ("exp_avg_sq", &mut self.v)],
            state,
        )?;
        self.step = step;
        Ok(())
    }
}

impl Adam {
    /// Each segment's constants of the step counted now, at learning rate `lr`.
    fn coefficients(&self, lr: f64) -> Vec<AdamCoefficients> {
        let k = |h| AdamCoefficients::new(self.decay, h, lr * h.lr_scale, self.step);
        self.segments.iter().map(|(_, h)| k(h)).collect()
    }
}

/// One step's constants of [`adam_update`].
struct AdamCoefficients {
    l2: f32,
    shrink: f32,
    w1: f32,
    b2: f32,
    w2: f32,
    eps: f32,
    bias2_sqrt: f32,
    step_size: f32,
}

impl AdamCoefficients {
    /// Step `step`'s (from 1) constants for values updated with `h` at learning rate `lr`.
    fn new(decay: Decay, h: &super::groups::Hyper, lr: f64, step: u64) -> AdamCoefficients {
        let t = step as f64;
        let bias1 = 1.0 - h.beta1.powf(t);
        let bias2 = 1.0 - h.beta2.powf(t);
        // One loop for both kinds: the unused decay is a multiply by exactly 1 or an add
        // of exactly 0 * p, which leaves every finite value unchanged.
        let (l2, shrink) = match decay {
            Decay::L2 => (h.weight_decay as f32, 1.0f32),
            Decay::Decoupled => (0.0, (1.0 - lr * h.weight_decay) as f32),
        };
        AdamCoefficients {
            l2,
            shrink,
            w1: (1.0 - h.beta1) as f32,
            b2: h.beta2 as f32,
            w2: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            bias2_sqrt: bias2.sqrt() as f32,
            step_size: (lr / bias1) as f32,
        }
    }
}

/// The update of every value. Compiled also for AVX2 and AVX-512 and picked at run time
/// (`multiversion`): the loop is bound by `sqrt` and two divisions, whose wider forms
/// give bitwise the same values (IEEE operations, never contracted into FMAs by Rust).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
fn adam_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &AdamCoefficients,
) {
    let moments = m.iter_mut().zip(v.iter_mut());
    for ((p, &g), (m, v)) in params.iter_mut().zip(grads).zip(moments) {
        let g = g + k.l2 * *p;
        *m = lerp(*m, g, k.w1);
        *v = *v * k.b2 + k.w2 * g * g;
        let denom = v.sqrt() / k.bias2_sqrt + k.eps;
        *p = *p * k.shrink - k.step_size * (*m / denom);
    }
}

#[cfg(test)]
mod tests {
    use super::super::groups::Hyper;
    use super::super::pieces::{assert_bitwise_and_moved, wave, MIN_PIECE};
    use super::*;

    #[test]
    fn a_step_over_a_big_buffer_in_pieces_is_bitwise_one_pass() {
        let len = 3 * MIN_PIECE + 5;
        let (p0, g) = (wave(len, 2_654_435_761), wave(len, 40_503));
        let hyper = Hyper {
            lr_scale: 1.0,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let mut adam = Adam::new(len, Decay::Decoupled, vec![(0..len, hyper)]);
        let mut pieces = p0.clone();
        for _ in 0..2 {
            adam.step(&mut pieces, &g, 1e-3).unwrap();
        }
        let (mut one, mut m, mut v) = (p0.clone(), vec![0.0; len], vec![0.0; len]);
        for step in 1..=2 {
            let k = AdamCoefficients::new(Decay::Decoupled, &hyper, 1e-3, step);
            adam_update(&mut one, &g, &mut m, &mut v, &k);
        }
        assert_bitwise_and_moved(&pieces, &one, &p0);
    }
}
