//! Each piece of work exactly once.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use super::{grid_at, Index};
use crate::grid::Mark;
use crate::ir::{Event, Phase};
use crate::{Schedule, ScheduleError};

/// Indexes every action and the event each compute produces, refusing repeats.
pub(super) fn index(schedule: &Schedule) -> Result<Index, ScheduleError> {
    let total = schedule.ranks().iter().map(Vec::len).sum();
    let mut positions = HashMap::with_capacity(total);
    let mut producers = HashMap::with_capacity(total);
    for (rank, list) in schedule.ranks().iter().enumerate() {
        for (step, &action) in list.iter().enumerate() {
            let duplicate = |first, first_rank, first_step| ScheduleError::Duplicate {
                rank,
                step,
                stage: action.stage(),
                micro_batch: action.micro_batch(),
                action,
                first,
                first_rank,
                first_step,
                grid: grid_at(schedule, rank, step),
            };
            // A B after an I (or a W after a B) repeats work without repeating the action,
            // so repeats are found on events, not only on actions.
            for event in action.produced_events() {
                match producers.entry(event) {
                    Entry::Occupied(e) => {
                        let &(r, s, first) = e.get();
                        return Err(duplicate(first, r, s));
                    }
                    Entry::Vacant(e) => {
                        e.insert((rank, step, action));
                    }
                }
            }
            match positions.entry(action) {
                Entry::Occupied(e) => {
                    let &(r, s) = e.get();
                    return Err(duplicate(action, r, s));
                }
                Entry::Vacant(e) => {
                    e.insert((rank, step));
                }
            }
        }
    }
    Ok(Index {
        positions,
        producers,
    })
}

/// Refuses the first (stage, micro-batch, phase) that nothing produces.
pub(super) fn check_complete(schedule: &Schedule, index: &Index) -> Result<(), ScheduleError> {
    for stage in 0..schedule.stages() {
        for micro_batch in 0..schedule.micro_batches() {
            for phase in [Phase::Forward, Phase::InputGrad, Phase::WeightGrad] {
                let event = Event {
                    phase,
                    stage,
                    micro_batch,
                };
                if !index.producers.contains_key(&event) {
                    let rank = schedule.placement()[stage];
                    return Err(ScheduleError::Missing {
                        rank,
                        stage,
                        micro_batch,
                        phase,
                        grid: schedule.format_grid(&[Mark { rank, step: None }]).into(),
                    });
                }
            }
        }
    }
    Ok(())
}
