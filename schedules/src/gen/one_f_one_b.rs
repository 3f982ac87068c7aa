//! 1F1B: warm up with forwards, then alternate one forward and one backward.

use crate::ir::Action;
use crate::schedule::looped_placement;
use crate::{Schedule, ScheduleError};

/// One-forward-one-backward (PipeDream-Flush; Narayanan et al. 2021), as Megatron's
/// `forward_backward_pipelining_without_interleaving`: rank `s` runs
/// `w = min(stages - 1 - s, micro_batches)` warm-up forwards, then pairs of (forward,
/// backward), then the remaining backwards. Stage `s` lives on rank `s`. At most
/// `min(stages - s, micro_batches)` micro-batches are in flight on stage `s`.
///
/// Unlike PyTorch's `Schedule1F1B`, fewer micro-batches than stages are accepted (as
/// Megatron does): the warm-up is then cut short and the schedule degenerates to GPipe.
/// The training config may still insist on `stages <= micro_batches`, since such a step
/// is mostly bubble.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] when `stages` or `micro_batches` is zero.
pub fn one_f_one_b(stages: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    super::require_positive(
        "one_f_one_b",
        &[("stages", stages), ("micro_batches", micro_batches)],
    )?;
    let m = micro_batches;
    let ranks = (0..stages)
        .map(|s| {
            let warmup = (stages - 1 - s).min(m);
            let mut list = Vec::with_capacity(2 * m);
            list.extend((0..warmup).map(|mb| Action::forward(s, mb)));
            for mb in 0..m - warmup {
                list.push(Action::forward(s, warmup + mb));
                list.push(Action::backward(s, mb));
            }
            list.extend((m - warmup..m).map(|mb| Action::backward(s, mb)));
            list
        })
        .collect();
    Schedule::new(looped_placement(stages, 1), m, ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_stages_eight_micro_batches() {
        let s = one_f_one_b(4, 8).unwrap();
        let text = |r: usize| {
            s.ranks()[r]
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            text(0),
            "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
        );
        assert_eq!(
            text(3),
            "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
        );
    }
}
