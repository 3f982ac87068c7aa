//! Is a schedule runnable? Checks, in this order, stopping at the first error:
//!
//! 1. **work** ([`work`]): every (stage, micro-batch) gets its forward, input gradient and
//!    weight gradient exactly once (`F` and `B`, or `F`, `I` and `W`); no action repeats.
//! 2. **pairing** (lowered schedules only): every transfer goes to an existing stage on
//!    another rank and has exactly one matching half there.
//! 3. **order** (on each rank's own list): `B`/`I` after this stage's `F`, `W` after `I`,
//!    `ALLREDUCE` and `STEP` after every weight gradient of their stage, `STEP` after
//!    `ALLREDUCE`, a send after the compute it sends; a compute whose input comes from
//!    another rank after the receive that brings it (lowered), or after the compute on the
//!    same rank that produces it.
//! 4. **deadlock** ([`deadlock`]): every rank's list is run in order, a compute waiting
//!    for its inputs (`F` on `s` after `F` on `s - 1`, `B`/`I` on `s` after `B`/`I` on
//!    `s + 1`) and every send and receive blocking until its peer reaches the matching half
//!    (rendezvous). If no rank can move, that is a deadlock.
//!
//! Rendezvous is the strictest channel: an order that passes here cannot deadlock with any
//! channel capacity, provided each pair of ranks delivers in order. Schedules without
//! transfers (compute-only) leave cross-rank hand-offs implicit, so step 4 checks only
//! the compute dependencies for them.
//!
//! Every error names rank, step (index in the rank's list), stage and micro-batch, and its
//! message ends with the schedule grid, the offending cell marked `<-- ERROR HERE`.

mod deadlock;
mod order;
mod work;

use std::collections::HashMap;

use crate::grid::Mark;
use crate::ir::{Action, Event};
use crate::{Schedule, ScheduleError};

/// Checks that `schedule` does all its work exactly once, in an order that respects every
/// dependency and cannot deadlock; see the module docs for the rules.
///
/// # Errors
/// [`ScheduleError::Duplicate`], [`ScheduleError::Missing`], [`ScheduleError::BadTransfer`],
/// [`ScheduleError::Unpaired`], [`ScheduleError::Dependency`] or
/// [`ScheduleError::Deadlock`], for the first problem found.
pub fn validate(schedule: &Schedule) -> Result<(), ScheduleError> {
    let index = work::index(schedule)?;
    work::check_complete(schedule, &index)?;
    if schedule.is_lowered() {
        order::check_pairing(schedule, &index)?;
    }
    order::check_order(schedule, &index)?;
    deadlock::run(schedule, &index)
}

/// Where things are: built once, shared by the checks.
pub(crate) struct Index {
    /// Rank and step of every action.
    positions: HashMap<Action, (usize, usize)>,
    /// Rank, step and action that produce each event.
    producers: HashMap<Event, (usize, usize, Action)>,
}

/// The grid with one cell marked.
fn grid_at(schedule: &Schedule, rank: usize, step: usize) -> Box<str> {
    schedule
        .format_grid(&[Mark {
            rank,
            step: Some(step),
        }])
        .into()
}

/// The deadlock error for a run stopped with rank `r` at step `at[r]` (for the simulator,
/// which only stops early on schedules that validation would refuse).
pub(crate) fn stalled(schedule: &Schedule, at: &[usize]) -> ScheduleError {
    match work::index(schedule) {
        Ok(index) => deadlock::deadlock(schedule, &index, at, &Default::default()),
        Err(e) => e,
    }
}
