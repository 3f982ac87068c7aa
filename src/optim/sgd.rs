//! Stochastic gradient descent, as `torch.optim.SGD`.

use pipetrain_actors::GradStats;

use super::groups::{Hyper, Segment};
use super::pieces::{piece_len, run_pieces};
use super::{check_lengths, counted, load_buffers, Optimizer};
use crate::Result;

/// `torch.optim.SGD` (default single-tensor path, `maximize=False`), per value:
///
/// ```text
/// g = g + weight_decay * p                       (L2, added to the gradient)
/// b = g                                          (first step: the buffer starts as g)
/// b = momentum * b + (1 - dampening) * g         (later steps)
/// d = g + momentum * b   (Nesterov)   or   d = b
/// p = p - lr * d
/// ```
///
/// With `momentum == 0` there is no buffer and `d = g`.
pub(crate) struct Sgd {
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    /// Stretches of the buffer and their weight decay and learning-rate scale (one
    /// without parameter groups).
    segments: Vec<Segment>,
    len: usize,
    /// The momentum buffer; empty when `momentum == 0`.
    buf: Vec<f32>,
    step: u64,
}

impl Sgd {
    /// Plain SGD or SGD with momentum over `len` values laid out as `segments`.
    pub(crate) fn new(
        len: usize,
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        segments: Vec<Segment>,
    ) -> Sgd {
        Sgd {
            momentum,
            dampening,
            nesterov,
            segments,
            len,
            buf: if momentum == 0.0 {
                Vec::new()
            } else {
                vec![0.0; len]
            },
            step: 0,
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<()> {
        check_lengths(self.len, params, grads)?;
        let k = self.coefficients();
        let rates = self.rates(lr);
        for ((r, _), &(lr, wd)) in self.segments.iter().zip(&rates) {
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            let n = piece_len(p.len());
            match self.momentum == 0.0 {
                true => run_pieces(p.chunks_mut(n).zip(g.chunks(n)), |(p, g)| {
                    plain_step(p, g, lr, wd);
                }),
                false => {
                    let b = &mut self.buf[r.clone()];
                    let parts = p.chunks_mut(n).zip(g.chunks(n)).zip(b.chunks_mut(n));
                    run_pieces(parts, |((p, g), b)| momentum_step(p, g, b, k, lr, wd));
                }
            }
        }
        self.step += 1;
        Ok(())
    }

    fn step_counting(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<GradStats> {
        check_lengths(self.len, params, grads)?;
        if !counted::on_one_core(self.len) {
            let stats = GradStats::of(grads);
            self.step(params, grads, lr)?;
            return Ok(stats);
        }
        let (k, rates, plain) = (self.coefficients(), self.rates(lr), self.momentum == 0.0);
        let buf = &mut self.buf;
        let stats = counted::windows(grads, &self.segments, |i, r| {
            let (lr, wd) = rates[i];
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            match plain {
                true => plain_step(p, g, lr, wd),
                false => momentum_step(p, g, &mut buf[r], k, lr, wd),
            }
        });
        self.step += 1;
        Ok(stats)
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn elementwise_step(&mut self, lr: f64) -> Option<super::ElementwiseStep> {
        let (keep, take, gc, bc) = self.coefficients();
        let rule = match self.momentum == 0.0 {
            true => super::Rule::Sgd,
            false => super::Rule::SgdMomentum,
        };
        let segments = self
            .segments
            .iter()
            .zip(self.rates(lr))
            .map(|((r, _), (lr, wd))| (r.clone(), [lr, wd, keep, take, gc, bc, 0.0, 0.0]))
            .collect();
        self.step += 1;
        Some(super::ElementwiseStep { rule, segments })
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        if self.momentum == 0.0 {
            Vec::new()
        } else {
            vec![("momentum_buffer", &self.buf)]
        }
    }

    fn load_state(&mut self, step: u64, state: &[(&str, &[f32])]) -> Result<()> {
        if self.momentum == 0.0 {
            load_buffers(&mut [], state)?;
        } else {
            load_buffers(&mut [("momentum_buffer", &mut self.buf)], state)?;
        }
        self.step = step;
        Ok(())
    }
}

impl Sgd {
    /// Each segment's `(learning rate, weight decay)` at learning rate `lr`.
    fn rates(&self, lr: f64) -> Vec<(f32, f32)> {
        let rate = |h: &Hyper| ((lr * h.lr_scale) as f32, h.weight_decay as f32);
        self.segments.iter().map(|(_, h)| rate(h)).collect()
    }

    /// `(keep, take, gc, bc)` of [`momentum_step`] at this step.
    fn coefficients(&self) -> (f32, f32, f32, f32) {
        let m = self.momentum as f32;
        // PyTorch's first step sets the buffer to the gradient. The buffer is still zero
        // then, so `0 * b + 1 * g` is that value exactly, and the loop stays one
        // branch-free loop that vectorizes.
        let (keep, take) = if self.step == 0 {
            (0.0, 1.0)
        } else {
            (m, (1.0 - self.dampening) as f32)
        };
        // Likewise `gc * g + bc * b` is exactly `g + m * b` (Nesterov) or `b`.
        let (gc, bc) = if self.nesterov { (1.0, m) } else { (0.0, 1.0) };
        (keep, take, gc, bc)
    }
}

/// SGD without momentum over one stretch.
fn plain_step(params: &mut [f32], grads: &[f32], lr: f32, wd: f32) {
    for (p, &g) in params.iter_mut().zip(grads) {
        let g = g + wd * *p;
        *p -= lr * g;
    }
}

/// SGD with momentum over one stretch.
fn momentum_step(
    params: &mut [f32],
    grads: &[f32],
    buf: &mut [f32],
    (keep, take, gc, bc): (f32, f32, f32, f32),
    lr: f32,
    wd: f32,
) {
    for ((p, &g), b) in params.iter_mut().zip(grads).zip(buf) {
        let g = g + wd * *p;
        *b = keep * *b + take * g;
        *p -= lr * (gc * g + bc * *b);
    }
}

#[cfg(test)]
mod tests {
    use super::super::groups::Hyper;
    use super::super::pieces::{assert_bitwise_and_moved, MIN_PIECE};
    use super::*;

    #[test]
    fn momentum_steps_over_a_big_buffer_in_pieces_are_bitwise_one_pass() {
        let len = 3 * MIN_PIECE + 5;
        let p0: Vec<f32> = (0..len).map(|i| (i % 1000) as f32 / 1000.0 - 0.5).collect();
        let g: Vec<f32> = (0..len).map(|i| (i % 777) as f32 / 777.0 - 0.4).collect();
        let hyper = Hyper {
            lr_scale: 1.0,
            weight_decay: 1e-3,
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
        };
        let mut sgd = Sgd::new(len, 0.9, 0.1, true, vec![(0..len, hyper)]);
        let mut pieces = p0.clone();
        let (mut one, mut b) = (p0.clone(), vec![0.0; len]);
        for _ in 0..2 {
            let k = sgd.coefficients();
            sgd.step(&mut pieces, &g, 0.1).unwrap();
            momentum_step(&mut one, &g, &mut b, k, 0.1, 1e-3);
        }
        assert_bitwise_and_moved(&pieces, &one, &p0);
    }
}
