//! Lowering: a compute-only order becomes one with every transfer explicit and paired.
//!
//! Follows PyTorch pipelining's `_add_send_recv`: walk the ranks round-robin, one compute
//! per rank per round (a unit-time run of the schedule), taking a rank's next compute only
//! once its inputs are on that rank. A compute whose result another rank needs is followed
//! by its send, and the matching receive is appended to the peer's list in the same move.
//!
//! Why receives go where the sender is, not just before the compute that needs them: in the
//! resulting lists the sends and receives can be run one pair at a time in the order they
//! were appended, so the order cannot deadlock even when every transfer blocks until its
//! peer arrives. Placing each receive just before its consumer deadlocks plain 1F1B under
//! that rule (the last rank sends a gradient while the one before it sends the next
//! activation), which Megatron avoids only by fusing the two into one batched call.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::ir::{receive_for, Action, Event, Phase};
use crate::{validate, Schedule, ScheduleError};

/// What [`lower`] appends to each rank's list after the transfers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LowerOptions {
    /// Append `ALLREDUCE` for each of the rank's stages (data-parallel gradient sync).
    pub all_reduce: bool,
    /// Append `STEP` for each of the rank's stages, after every `ALLREDUCE` of the rank.
    pub optimizer_step: bool,
}

/// Adds the sends and receives that `schedule`'s cross-rank hand-offs need (none between
/// stages on the same rank), then the optional `ALLREDUCE`s and `STEP`s at the end of each
/// rank's list, stages ascending. All `ALLREDUCE`s come before any `STEP` on a rank because
/// the loss scaler looks at every stage's reduced gradients before any stage steps.
///
/// # Errors
/// [`ScheduleError::AlreadyLowered`] when `schedule` has anything but F, B, I and W; any
/// error of [`validate()`] for the input.
pub fn lower(schedule: &Schedule, options: LowerOptions) -> Result<Schedule, ScheduleError> {
    for (rank, list) in schedule.ranks().iter().enumerate() {
        if let Some((step, &action)) = list
            .iter()
            .enumerate()
            .find(|(_, a)| !a.kind().is_compute())
        {
            return Err(ScheduleError::AlreadyLowered { rank, step, action });
        }
    }
    validate(schedule)?;

    let lists = schedule.ranks();
    let stages = schedule.stages();
    let mut out: Vec<Vec<Action>> = lists
        .iter()
        .map(|l| Vec::with_capacity(2 * l.len()))
        .collect();
    // Events each rank has, computed there or received.
    let mut have: Vec<HashSet<Event>> = vec![HashSet::new(); lists.len()];
    let mut at = vec![0usize; lists.len()];
    loop {
        let mut moved = false;
        for rank in 0..lists.len() {
            let Some(&action) = lists[rank].get(at[rank]) else {
                continue;
            };
            if !action.needs(stages).iter().all(|e| have[rank].contains(e)) {
                continue;
            }
            at[rank] += 1;
            moved = true;
            out[rank].push(action);
            for event in action.produced_events() {
                have[rank].insert(event);
                if let Some((send, recv, peer)) = transfer(schedule, event) {
                    out[rank].push(send);
                    out[peer].push(recv);
                    have[peer].insert(event);
                }
            }
        }
        if at.iter().zip(lists).all(|(&a, l)| a == l.len()) {
            break;
        }
        if !moved {
            // validate() has run the same dependencies to the end, so this is unreachable;
            // an error keeps it from being a panic.
            return Err(crate::validate::stalled(schedule, &at));
        }
    }
    for (rank, list) in out.iter_mut().enumerate() {
        let own: Vec<usize> = schedule.stages_of(rank).collect();
        if options.all_reduce {
            list.extend(own.iter().map(|&s| Action::all_reduce(s)));
        }
        if options.optimizer_step {
            list.extend(own.iter().map(|&s| Action::optimizer_step(s)));
        }
    }
    Schedule::new(schedule.placement().to_vec(), schedule.micro_batches(), out)
}

/// The send, receive and receiving rank that carry `event` to the stage that consumes it,
/// when that stage is on another rank.
fn transfer(schedule: &Schedule, event: Event) -> Option<(Action, Action, usize)> {
    let recv = receive_for(event)?;
    let (rank, peer) = (
        schedule.rank_of(event.stage)?,
        schedule.rank_of(recv.stage())?,
    );
    if rank == peer {
        return None;
    }
    let send = match event.phase {
        Phase::Forward => Action::send_act(event.stage, event.micro_batch),
        _ => Action::send_grad(event.stage, event.micro_batch),
    };
    Some((send, recv, peer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::one_f_one_b;

    fn text(list: &[Action]) -> String {
        list.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn two_stage_1f1b() {
        let lowered = lower(&one_f_one_b(2, 2).unwrap(), LowerOptions::default()).unwrap();
        assert_eq!(
            text(&lowered.ranks()[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
        );
        assert_eq!(
            text(&lowered.ranks()[1]),
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"
        );
    }

    #[test]
    fn appends_all_reduce_then_step() {
        let options = LowerOptions {
            all_reduce: true,
            optimizer_step: true,
        };
        let lowered = lower(&crate::gen::interleaved_1f1b(2, 2, 2).unwrap(), options).unwrap();
        let tail = &lowered.ranks()[1][lowered.ranks()[1].len() - 4..];
        assert_eq!(text(tail), "1ALLREDUCE 3ALLREDUCE 1STEP 3STEP");
        assert!(validate(&lowered).is_ok());
    }

    #[test]
    fn refuses_lowered_input() {
        let lowered = lower(&one_f_one_b(2, 2).unwrap(), LowerOptions::default()).unwrap();
        assert!(matches!(
            lower(&lowered, LowerOptions::default()),
            Err(ScheduleError::AlreadyLowered {
                rank: 0,
                step: 1,
                ..
            })
        ));
    }
}
