//! GPipe: every forward, then every backward.

use crate::ir::Action;
use crate::schedule::looped_placement;
use crate::{Schedule, ScheduleError};

/// GPipe (Huang et al. 2019) as PyTorch's `ScheduleGPipe`: each rank runs the forward of
/// every micro-batch, then the backward of every micro-batch in the same order. Stage `s`
/// lives on rank `s`. Simple and valid for any `micro_batches >= 1`, but every stage holds
/// the activations of all micro-batches at once.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] when `stages` or `micro_batches` is zero.
pub fn gpipe(stages: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    super::require_positive(
        "gpipe",
        &[("stages", stages), ("micro_batches", micro_batches)],
    )?;
    let ranks = (0..stages)
        .map(|s| {
            let forwards = (0..micro_batches).map(|mb| Action::forward(s, mb));
            let backwards = (0..micro_batches).map(|mb| Action::backward(s, mb));
            forwards.chain(backwards).collect()
        })
        .collect();
    Schedule::new(looped_placement(stages, 1), micro_batches, ranks)
}
