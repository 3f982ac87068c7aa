//! LAMB, as ONNX Runtime's `LambOptimizer`.

use std::ops::Range;

use super::groups::Hyper;
use super::{check_lengths, load_buffers, Optimizer, ParamLayout};
use crate::Result;

/// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2) in the
/// form of ONNX Runtime's `LambOptimizer` (`orttraining/.../optimizer/lamb_impl.cu`) and
/// NVIDIA apex's `FusedLAMB` (`adam_w_mode=True`, `bias_correction=True`), `t` from 1:
///
/// ```text
/// per value:   m = beta1 * m + (1 - beta1) * g
///              v = beta2 * v + (1 - beta2) * g * g
///              d = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * p
/// per tensor:  r = ||p|| / ||d||, or 1 when either norm is 0
/// per value:   p = p - lr * r * d
/// ```
///
/// Where it differs from those references:
/// - No gradient clipping inside the optimizer (ORT divides `g` by the global gradient
///   norm when it exceeds `max_norm`, default 1; apex has `max_grad_norm=1.0`): clipping,
///   where wanted, is a step of its own before the optimizer's, the same for every optimizer.
/// - No loss-scale division and no skipping of non-finite updates (ORT keeps the old value
///   where the update is not finite): gradients arrive unscaled, and whether a step with
///   non-finite gradients runs at all is decided before the optimizer is called.
/// - The trust ratio is applied to every tensor, as ORT does, and as apex does only with
///   `use_nvlamb=True` (by default apex leaves it out for tensors without weight decay);
///   ORT's `ratio_min` / `ratio_max` clamps are not offered (their defaults clamp nothing).
/// - The norms are summed in `f64` over eight lanes (ORT sums in `f32` on the GPU).
pub(crate) struct Lamb {
    /// Each parameter tensor's values in the flat buffers, and its betas, eps, weight
    /// decay and learning-rate scale.
    tensors: Vec<(Range<usize>, Hyper)>,
    /// First moment (`exp_avg`).
    m: Vec<f32>,
    /// Second moment (`exp_avg_sq`).
    v: Vec<f32>,
    /// The update direction `d` of one tensor, which both norms need before `p` changes;
    /// as long as the largest tensor, allocated once.
    scratch: Vec<f32>,
    step: u64,
}

impl Lamb {
    /// LAMB over the tensors of `layout`, each updated with its entry of `hypers`,
    /// moments zero.
    pub(crate) fn new(layout: &ParamLayout, hypers: Vec<Hyper>) -> Lamb {
        let tensors: Vec<(Range<usize>, Hyper)> = layout.ranges().zip(hypers).collect();
        let largest = tensors.iter().map(|(r, _)| r.len()).max().unwrap_or(0);
        Lamb {
            tensors,
            m: vec![0.0; layout.len()],
            v: vec![0.0; layout.len()],
            scratch: vec![0.0; largest],
            step: 0,
        }
    }
}

/// `sum(x^2)` in `f64`, over eight independent lanes so that the loop vectorizes (one
/// running sum would have to be added in order, which the compiler may not reorder).
fn sum_squares(x: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (acc, &a) in lanes.iter_mut().zip(chunk) {
            *acc += f64::from(a) * f64::from(a);
        }
    }
    let tail: f64 = rest.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
    lanes.iter().sum::<f64>() + tail
}

impl Optimizer for Lamb {
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<()> {
        check_lengths(self.m.len(), params, grads)?;
        self.step += 1;
        let t = self.step as f64;
        for (r, h) in &self.tensors {
            let bias1 = (1.0 - h.beta1.powf(t)) as f32;
            let bias2 = (1.0 - h.beta2.powf(t)) as f32;
            let (b1, w1) = (h.beta1 as f32, (1.0 - h.beta1) as f32);
            let (b2, w2) = (h.beta2 as f32, (1.0 - h.beta2) as f32);
            let (eps, wd) = (h.eps as f32, h.weight_decay as f32);
            let p = &mut params[r.clone()];
            let g = &grads[r.clone()];
            let m = &mut self.m[r.clone()];
            let v = &mut self.v[r.clone()];
            let d = &mut self.scratch[..r.len()];
            let moments = m.iter_mut().zip(v.iter_mut());
            let values = p.iter().zip(g).zip(d.iter_mut());
            for (((&p, &g), d), (m, v)) in values.zip(moments) {
                *m = b1 * *m + w1 * g;
                *v = b2 * *v + w2 * g * g;
                *d = (*m / bias1) / ((*v / bias2).sqrt() + eps) + wd * p;
            }
            let (p_norm2, d_norm2) = (sum_squares(p), sum_squares(d));
            let ratio = if p_norm2 > 0.0 && d_norm2 > 0.0 {
                (p_norm2 / d_norm2).sqrt()
            } else {
                1.0
            };
            let step = (lr * h.lr_scale * ratio) as f32;
            for (p, &d) in p.iter_mut().zip(d.iter()) {
                *p -= step * d;
            }
        }
        Ok(())
    }

    fn step_count(&self) -> u64 {
        self.step
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

#[cfg(test)]
mod tests {
    use super::sum_squares;

    #[test]
    fn sum_squares_covers_lanes_and_tail() {
        for n in [0usize, 1, 7, 8, 9, 17, 100] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 - 3.5).collect();
            let want: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
            assert_eq!(sum_squares(&x), want, "n = {n}");
        }
    }
}
