//! ZB-V: two stages per rank folded into a V, split backward.

use crate::ir::Action;
use crate::schedule::v_placement;
use crate::{Schedule, ScheduleError};

/// ZB-V (Qi et al. 2023, section 6), as PyTorch's `ScheduleZBVZeroBubble`: `2 * ranks`
/// stages, rank `r` holding stages `r` and `2 * ranks - 1 - r` (so the last rank holds the
/// two middle stages and hands the activation from one to the other locally). The warm-up
/// runs `2 * (ranks - r) - 1` forwards of the first chunk, `r` alternating pairs, then
/// `ranks - r` second-chunk (`F`, `I`, `W`) triples; the steady state alternates the chunks
/// with `F I W` each; the cool-down drains the `I`s and then the `W`s.
///
/// PyTorch quietly raises the micro-batch count to `2 * ranks - 1` when given fewer (its
/// lists then name micro-batches that do not exist); this generator refuses instead.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] for a zero parameter;
/// [`ScheduleError::TooFewMicroBatches`] when `micro_batches < 2 * ranks - 1`.
pub fn zb_v(ranks: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    const CONTEXT: &str = "zb_v";
    super::require_positive(
        CONTEXT,
        &[("ranks", ranks), ("micro_batches", micro_batches)],
    )?;
    let required = 2 * ranks - 1;
    if micro_batches < required {
        return Err(ScheduleError::TooFewMicroBatches {
            context: CONTEXT,
            micro_batches,
            required,
            rule: "the warm-up of the first rank fills 2 * ranks - 1 micro-batches",
        });
    }
    let lists = (0..ranks)
        .map(|r| rank_ops(ranks, micro_batches, r))
        .collect();
    Schedule::new(v_placement(ranks), micro_batches, lists)
}

fn rank_ops(p: usize, n: usize, r: usize) -> Vec<Action> {
    let (c0, c1) = (r, 2 * p - 1 - r);
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    let mut list = Vec::with_capacity(6 * n);
    let next = |counter: &mut usize| {
        *counter += 1;
        *counter - 1
    };
    for _ in 0..2 * (p - r) - 1 {
        list.push(Action::forward(c0, next(&mut f0)));
    }
    for _ in 0..r {
        list.push(Action::forward(c1, next(&mut f1)));
        list.push(Action::forward(c0, next(&mut f0)));
    }
    for _ in 0..p - r {
        list.push(Action::forward(c1, next(&mut f1)));
        list.push(Action::backward_input(c1, b1));
        list.push(Action::backward_weight(c1, next(&mut b1)));
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            list.push(Action::forward(c0, next(&mut f0)));
        }
        list.push(Action::backward_input(c0, b0));
        list.push(Action::backward_weight(c0, next(&mut b0)));
        list.push(Action::forward(c1, next(&mut f1)));
        list.push(Action::backward_input(c1, b1));
        list.push(Action::backward_weight(c1, next(&mut b1)));
    }
    let (mut w0, mut w1) = (b0, b1);
    for _ in 0..r {
        list.push(Action::backward_input(c0, next(&mut b0)));
        list.push(Action::backward_input(c1, next(&mut b1)));
    }
    for _ in 0..p - r {
        list.push(Action::backward_input(c0, next(&mut b0)));
        list.push(Action::backward_weight(c0, next(&mut w0)));
    }
    while w1 < b1 {
        list.push(Action::backward_weight(c1, next(&mut w1)));
    }
    while w0 < b0 {
        list.push(Action::backward_weight(c0, next(&mut w0)));
    }
    list
}
