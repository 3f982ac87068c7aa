//! Adasum (`enable_adasum`): the data-parallel replicas' gradients combined by adaptive
//! summation instead of summed, as ONNX Runtime's and Horovod's Adasum define it (Maleki
//! et al., 2020). Per parameter tensor, two gradients `a` and `b` combine as
//!
//! ```text
//! (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
//! ```
//!
//! (a coefficient is 1 where its squared norm is below `sqrt(f64::MIN_POSITIVE)`, as in
//! ONNX Runtime), so orthogonal gradients add and identical ones give one of them; over
//! the replicas the pairs form a binary tree: replicas (0, 1), (2, 3), ... first, then
//! those results pairwise, so the replica count must be a power of two (as both
//! references require). Each replica's gradient enters as the mean over its own
//! micro-batches (Horovod's convention: Adasum replaces averaging, so the learning rate
//! is not scaled with the replicas).
//!
//! The replicas' gradients travel by the run's one collective, the all-reduce sum: each
//! replica puts its gradient in its own slot of a buffer `replicas` times as long,
//! zeros elsewhere, so the sum is every gradient exactly (`x + 0 = x`), and every
//! replica then runs the same tree in the same order, so all get identical bits. That
//! moves about twice what an all-gather would (a ring all-reduce of `replicas x n`
//! values); fine at the replica counts one trains on CPUs, and it needs nothing of the
//! transports.

use std::ops::Range;

/// This replica's place in the combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdasumSlot {
    /// This replica.
    pub replica: usize,
    /// The replicas (a power of two).
    pub replicas: usize,
}

impl AdasumSlot {
    /// The buffer this replica all-reduces: `grads` (the step's gradient, weighted as a
    /// share of the global batch) as its own mean, in its slot.
    pub fn spread(&self, grads: &[f32]) -> Vec<f32> {
        let n = grads.len();
        let mut out = vec![0.0f32; n * self.replicas];
        // A power of two: scaling by it is exact.
        let to_own_mean = self.replicas as f32;
        for (o, g) in out[self.replica * n..][..n].iter_mut().zip(grads) {
            *o = g * to_own_mean;
        }
        out
    }

    /// The Adasum of the replicas' gradients in `gathered` (the all-reduced
    /// [`AdasumSlot::spread`] buffers), per tensor of `tensors` (ranges of one gradient).
    pub fn combine(&self, gathered: &[f32], tensors: &[Range<usize>]) -> Vec<f32> {
        let n = gathered.len() / self.replicas;
        if n == 0 || self.replicas == 1 {
            return gathered[..n].to_vec();
        }
        // The first level reads the gathered buffer in place; `replicas` is a power of
        // two (the configuration refuses others), so every level pairs up evenly.
        let slots: Vec<&[f32]> = gathered.chunks_exact(n).collect();
        let mut level: Vec<Vec<f32>> = slots
            .chunks_exact(2)
            .map(|p| adasum_pair(p[0], p[1], tensors))
            .collect();
        while level.len() > 1 {
            level = level
                .chunks_exact(2)
                .map(|p| adasum_pair(&p[0], &p[1], tensors))
                .collect();
        }
        level.pop().unwrap_or_default()
    }
}

/// Adasum of two gradients, tensor by tensor (`tensors` cover both).
pub fn adasum_pair(a: &[f32], b: &[f32], tensors: &[Range<usize>]) -> Vec<f32> {
    let mut out = vec![0.0f32; a.len()];
    let floor = f64::MIN_POSITIVE.sqrt();
    for r in tensors {
        let (a, b) = (&a[r.clone()], &b[r.clone()]);
        let (mut dot, mut a2, mut b2) = (0.0f64, 0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            let (x, y) = (f64::from(x), f64::from(y));
            dot += x * y;
            a2 += x * x;
            b2 += y * y;
        }
        let coefficient = |norm2: f64| match norm2 >= floor {
            true => 1.0 - dot / norm2 * 0.5,
            false => 1.0,
        };
        let (ka, kb) = (coefficient(a2), coefficient(b2));
        for ((o, &x), &y) in out[r.clone()].iter_mut().zip(a).zip(b) {
            *o = (ka * f64::from(x) + kb * f64::from(y)) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Float64 Adasum of two vectors, straight from the formula.
    fn reference(a: &[f64], b: &[f64]) -> Vec<f64> {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let (a2, b2): (f64, f64) = (a.iter().map(|x| x * x).sum(), b.iter().map(|x| x * x).sum());
        a.iter()
            .zip(b)
            .map(|(x, y)| (1.0 - dot / (2.0 * a2)) * x + (1.0 - dot / (2.0 * b2)) * y)
            .collect()
    }

    fn grads(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + 1.0) * (seed as f32 * 0.37 + 0.11)).sin())
            .collect()
    }

    #[test]
    fn orthogonal_gradients_add_and_identical_ones_give_one_of_them() {
        let t = std::slice::from_ref(&(0..2));
        assert_eq!(adasum_pair(&[3.0, 0.0], &[0.0, -2.0], t), vec![3.0, -2.0]);
        assert_eq!(adasum_pair(&[0.5, -1.5], &[0.5, -1.5], t), vec![0.5, -1.5]);
    }

    #[test]
    fn the_tree_over_four_replicas_matches_the_float64_formula_per_tensor() {
        let tensors = [0..5, 5..12];
        let g: Vec<Vec<f32>> = (0..4).map(|r| grads(r, 12)).collect();
        let slots = |r| AdasumSlot {
            replica: r,
            replicas: 4,
        };
        // What the all-reduce sum of the four spread buffers gives.
        let mut summed = vec![0.0f32; 48];
        for (r, gr) in g.iter().enumerate() {
            for (s, x) in summed.iter_mut().zip(slots(r).spread(gr)) {
                *s += x;
            }
        }
        let ours: Vec<Vec<f32>> = (0..4)
            .map(|r| slots(r).combine(&summed, &tensors))
            .collect();
        assert!(
            ours.iter().all(|o| o == &ours[0]),
            "identical bits on every replica"
        );
        for t in &tensors {
            let part = |r: usize| -> Vec<f64> {
                g[r][t.clone()].iter().map(|&x| 4.0 * x as f64).collect()
            };
            let want = reference(
                &reference(&part(0), &part(1)),
                &reference(&part(2), &part(3)),
            );
            for (o, w) in ours[0][t.clone()].iter().zip(&want) {
                assert!(
                    (*o as f64 - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{o} vs {w}"
                );
            }
        }
    }
}
