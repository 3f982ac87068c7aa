//! Pairing of transfers, and the order of each rank's own list.

use super::{grid_at, Index};
use crate::ir::{receive_for, Action, ActionKind, Event, Phase};
use crate::{Schedule, ScheduleError};

/// Every transfer goes to an existing stage on another rank, and its other half is there.
pub(super) fn check_pairing(schedule: &Schedule, index: &Index) -> Result<(), ScheduleError> {
    for (rank, step, action) in actions(schedule) {
        if !action.kind().is_transfer() {
            continue;
        }
        let stage = action.stage();
        let micro_batch = action.micro_batch().unwrap_or(0);
        let bad = |reason| ScheduleError::BadTransfer {
            rank,
            step,
            stage,
            micro_batch,
            action,
            reason,
            grid: grid_at(schedule, rank, step),
        };
        let peer_rank = match action.peer_stage().and_then(|p| schedule.rank_of(p)) {
            Some(peer_rank) => peer_rank,
            None => {
                return Err(bad(match action.kind() {
                    ActionKind::SendAct => "the last stage has no next stage to send to",
                    ActionKind::RecvGrad => "the last stage has no next stage to receive from",
                    ActionKind::SendGrad => "stage 0 has no previous stage to send to",
                    _ => "stage 0 has no previous stage to receive from",
                }))
            }
        };
        if peer_rank == rank {
            return Err(bad(
                "both stages are on this rank, so the hand-off is local and needs no transfer",
            ));
        }
        let Some(expected) = action.matching() else {
            continue;
        };
        if !index.positions.contains_key(&expected) {
            return Err(ScheduleError::Unpaired {
                rank,
                step,
                stage,
                micro_batch,
                action,
                expected,
                peer_rank,
                grid: grid_at(schedule, rank, step),
            });
        }
    }
    Ok(())
}

/// Everything an action needs from its own rank comes earlier in that rank's list.
pub(super) fn check_order(schedule: &Schedule, index: &Index) -> Result<(), ScheduleError> {
    let lowered = schedule.is_lowered();
    for (rank, step, action) in actions(schedule) {
        let dependency = |needs: Action, found_at: Option<usize>| ScheduleError::Dependency {
            rank,
            step,
            stage: action.stage(),
            micro_batch: action.micro_batch(),
            action,
            needs,
            found_at,
            grid: grid_at(schedule, rank, step),
        };
        // Needs an event: on this rank, its producer must come first; from another rank,
        // the receive that brings it must (when transfers are explicit).
        let before = |event: Event| -> Result<(), ScheduleError> {
            let Some(&(p_rank, p_step, producer)) = index.producers.get(&event) else {
                return Ok(()); // reported by check_complete
            };
            if p_rank == rank {
                return match p_step > step {
                    true => Err(dependency(producer, Some(p_step))),
                    false => Ok(()),
                };
            }
            if !lowered {
                return Ok(()); // implicit hand-off: the deadlock check covers it
            }
            let Some(recv) = receive_for(event) else {
                return Ok(());
            };
            match index.positions.get(&recv) {
                Some(&(r, s)) if r == rank && s < step => Ok(()),
                Some(&(r, s)) if r == rank => Err(dependency(recv, Some(s))),
                _ => Err(dependency(recv, None)),
            }
        };
        match action.kind() {
            ActionKind::Forward
            | ActionKind::Backward
            | ActionKind::BackwardInput
            | ActionKind::BackwardWeight => {
                for event in action.needs(schedule.stages()) {
                    before(event)?;
                }
            }
            ActionKind::SendAct | ActionKind::SendGrad => {
                if let Some(event) = action.carries() {
                    before(event)?;
                }
            }
            ActionKind::RecvAct | ActionKind::RecvGrad => {}
            ActionKind::AllReduce | ActionKind::OptimizerStep => {
                for micro_batch in 0..schedule.micro_batches() {
                    before(Event {
                        phase: Phase::WeightGrad,
                        stage: action.stage(),
                        micro_batch,
                    })?;
                }
                let reduce = Action::all_reduce(action.stage());
                if action.kind() == ActionKind::OptimizerStep {
                    if let Some(&(_, s)) = index.positions.get(&reduce) {
                        if s > step {
                            return Err(dependency(reduce, Some(s)));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every (rank, step, action), rank by rank.
fn actions(schedule: &Schedule) -> impl Iterator<Item = (usize, usize, Action)> + '_ {
    schedule
        .ranks()
        .iter()
        .enumerate()
        .flat_map(|(rank, list)| {
            list.iter()
                .enumerate()
                .map(move |(step, &action)| (rank, step, action))
        })
}
