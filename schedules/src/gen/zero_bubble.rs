//! ZB-H1: 1F1B with the backward split, weight gradients moved into the cool-down bubble.

use super::looped::{rank_ops, Backward, Looped};
use crate::schedule::looped_placement;
use crate::{Schedule, ScheduleError};

/// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the backward
/// is split into `I` (input gradient, on the critical path) and `W` (weight gradient, free
/// to move). Rank `r` runs `min(stages - 1 - r, micro_batches)` warm-up forwards, then
/// (`F`, `I`) pairs where the first `r` pairs defer their `W` and every later pair adds the
/// oldest deferred one, and ends with the deferred `W`s. The order is PyTorch's
/// `ScheduleInterleavedZeroBubble` with one stage per rank.
///
/// With `F = I = W` and no communication cost the bubble is `(stages - 1) * (F + I - W)`
/// per rank, a third of 1F1B's `(stages - 1) * (F + I + W)`, for `micro_batches >= stages`.
/// At most `min(stages, micro_batches)` micro-batches are in flight on any stage, the
/// same peak as 1F1B's first stage.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] when `stages` or `micro_batches` is zero.
pub fn zb_h1(stages: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    super::require_positive(
        "zb_h1",
        &[("stages", stages), ("micro_batches", micro_batches)],
    )?;
    let shape = Looped {
        ranks: stages,
        virtual_stages: 1,
        micro_batches,
        per_round: micro_batches,
    };
    let lists = (0..stages)
        .map(|r| rank_ops(&shape, r, stages - 1 - r, Backward::Split { delay: r }))
        .collect();
    Schedule::new(looped_placement(stages, 1), micro_batches, lists)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_stage_defers_its_weight_gradients() {
        let s = zb_h1(3, 4).unwrap();
        let text = |r: usize| {
            s.ranks()[r]
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(text(0), "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3");
        assert_eq!(text(2), "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3");
    }
}
