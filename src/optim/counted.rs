//! An update that takes the gradients' statistics on its way
//! ([`Optimizer::step_counting`](super::Optimizer::step_counting)).
//!
//! Where the update needs no statistics first (no clipping, no loss scaling), reading
//! every gradient once for the statistics and once more for the update is one pass over
//! memory too many: on the peers' MLP (670 k parameters, 2.6 MB of gradients, more than
//! a core's second-level cache) the statistics' own pass was a third of the optimizer
//! step. Here the update walks the buffer in windows of a few KiB, sums each window's
//! squares, then updates it while it is still in the first-level cache. The sums fall
//! in the blocks of [`GradStats::of`] (`SumSq`), so the statistics have its bits, and
//! each value's update is the one the optimizer's `step` computes, so the parameters
//! and state have `step`'s bits. Measured on the MLP (Chrome trace, median optimizer
//! step, alternating runs): SGD 355-370 -> 285-310 us, AdamW 585-605 -> 545-595 us;
//! without any statistics it would be 235-245 and 435-455 us (the sum of squares in the
//! cache is what is left; windows of 16 blocks instead of 4 changed nothing).
//!
//! One core only: buffers that `step` cuts into pieces for several cores
//! ([`super::pieces`]) have their statistics taken first, on several cores too.

use std::ops::Range;

use pipetrain_actors::{GradStats, SumSq};

use super::groups::Segment;
use super::pieces::MIN_PIECE;

/// Values per window: whole blocks of the sum, 8 KiB of gradients.
const WINDOW: usize = 4 * SumSq::ALIGN;

/// Whether an update over `len` values runs on one core, and so takes its statistics on
/// its way.
pub(crate) fn on_one_core(len: usize) -> bool {
    len < 2 * MIN_PIECE
}

/// Calls `update(i, range)` over every value that `segments` (in order, from 0) cover,
/// `i` the segment's index and `range` within it, window by window, each window after
/// its gradients' squares are summed; returns the statistics of all of `grads`.
pub(crate) fn windows(
    grads: &[f32],
    segments: &[Segment],
    mut update: impl FnMut(usize, Range<usize>),
) -> GradStats {
    let mut sum = SumSq::default();
    let mut first = 0;
    for start in (0..grads.len()).step_by(WINDOW) {
        let end = (start + WINDOW).min(grads.len());
        sum.add(&grads[start..end]);
        while segments.get(first).is_some_and(|(r, _)| r.end <= start) {
            first += 1;
        }
        for (i, (r, _)) in segments.iter().enumerate().skip(first) {
            if r.start >= end {
                break;
            }
            let part = r.start.max(start)..r.end.min(end);
            if !part.is_empty() {
                update(i, part);
            }
        }
    }
    sum.stats()
}

#[cfg(test)]
mod tests {
    use super::super::adam::{Adam, Decay};
    use super::super::groups::Hyper;
    use super::super::pieces::{assert_bitwise_and_moved, wave};
    use super::super::sgd::Sgd;
    use super::super::Optimizer;
    use super::*;

    /// Two stretches with different settings, cut inside a window and inside a block.
    fn two_segments(len: usize) -> Vec<Segment> {
        let h = |lr_scale, weight_decay| Hyper {
            lr_scale,
            weight_decay,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let cut = WINDOW + 300;
        vec![(0..cut, h(1.0, 0.01)), (cut..len, h(0.5, 0.0))]
    }

    /// Every optimizer's counting step is bitwise its plain step (parameters and state),
    /// and its statistics are bitwise `GradStats::of`'s, step after step.
    #[test]
    fn counting_steps_are_the_bits_of_plain_steps_and_of_the_statistics() {
        let len = 3 * WINDOW + 77;
        let (p0, g) = (wave(len, 2_654_435_761), wave(len, 40_503));
        let make = |kind| -> Box<dyn Optimizer> {
            let segments = two_segments(len);
            match kind {
                0 => Box::new(Sgd::new(len, 0.0, 0.0, false, segments)),
                1 => Box::new(Sgd::new(len, 0.9, 0.1, true, segments)),
                2 => Box::new(Adam::new(len, Decay::L2, segments)),
                _ => Box::new(Adam::new(len, Decay::Decoupled, segments)),
            }
        };
        for kind in 0..4 {
            let (mut plain, mut counting) = (make(kind), make(kind));
            let (mut p1, mut p2) = (p0.clone(), p0.clone());
            for _ in 0..3 {
                plain.step(&mut p1, &g, 0.01).unwrap();
                let stats = counting.step_counting(&mut p2, &g, 0.01).unwrap();
                assert_eq!(stats.sum_sq.to_bits(), GradStats::of(&g).sum_sq.to_bits());
            }
            assert_bitwise_and_moved(&p2, &p1, &p0);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for ((n, a), (_, b)) in plain.state().iter().zip(counting.state()) {
                assert!(bits(a) == bits(b), "optimizer {kind}: {n} differs");
            }
            assert_eq!(plain.step_count(), counting.step_count());
        }
    }

    #[test]
    fn windows_visit_every_value_once_in_its_own_segment() {
        let hyper = Hyper {
            lr_scale: 1.0,
            weight_decay: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
        };
        let cuts = [
            0,
            5,
            5 + WINDOW,
            3 * WINDOW + 7,
            3 * WINDOW + 8,
            5 * WINDOW + 3,
        ];
        let segments: Vec<Segment> = cuts.windows(2).map(|c| (c[0]..c[1], hyper)).collect();
        let len = *cuts.last().unwrap();
        let grads: Vec<f32> = (0..len).map(|i| (i % 97) as f32 * 0.01).collect();
        let mut seen = vec![usize::MAX; len];
        let stats = windows(&grads, &segments, |i, r| {
            assert!(r.start >= segments[i].0.start && r.end <= segments[i].0.end);
            assert!(r.len() <= WINDOW);
            for v in &mut seen[r] {
                assert_eq!(*v, usize::MAX, "a value visited twice");
                *v = i;
            }
        });
        assert!(seen.iter().all(|&v| v != usize::MAX));
        assert_eq!(
            stats.sum_sq.to_bits(),
            GradStats::of(&grads).sum_sq.to_bits()
        );
    }
}
