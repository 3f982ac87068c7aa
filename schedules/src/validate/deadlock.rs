//! Run every rank's list in order with blocking transfers; report who waits on whom if
//! nothing can move.

use std::collections::HashSet;

use super::Index;
use crate::grid::Mark;
use crate::ir::{Action, Event};
use crate::{Schedule, ScheduleError};

/// Runs the schedule to the end or to a deadlock.
///
/// Whether such a system of sequential processes on point-to-point channels finishes does
/// not depend on the order in which ready ranks are run, so one greedy pass order is
/// enough.
pub(super) fn run(schedule: &Schedule, index: &Index) -> Result<(), ScheduleError> {
    let lists = schedule.ranks();
    let mut at = vec![0usize; lists.len()];
    let mut done: HashSet<Event> = HashSet::with_capacity(index.producers.len());
    loop {
        let mut moved = false;
        for rank in 0..lists.len() {
            while let Some(&action) = lists[rank].get(at[rank]) {
                if action.kind().is_transfer() {
                    // Pairing has been checked, so the peer stage exists on another rank.
                    let (Some(peer), Some(other)) =
                        (peer_rank(schedule, action), action.matching())
                    else {
                        break;
                    };
                    if lists[peer].get(at[peer]) != Some(&other) {
                        break;
                    }
                    at[peer] += 1;
                } else if !action
                    .needs(schedule.stages())
                    .iter()
                    .all(|e| done.contains(e))
                {
                    break;
                } else {
                    done.extend(action.produced_events());
                }
                at[rank] += 1;
                moved = true;
            }
        }
        if at.iter().zip(lists).all(|(&a, l)| a == l.len()) {
            return Ok(());
        }
        if !moved {
            return Err(deadlock(schedule, index, &at, &done));
        }
    }
}

fn peer_rank(schedule: &Schedule, action: Action) -> Option<usize> {
    schedule.rank_of(action.peer_stage()?)
}

/// Describes every blocked rank, and names the lowest rank on a cycle of ranks waiting
/// for each other: the ranks outside the cycle only wait for it to move.
pub(crate) fn deadlock(
    schedule: &Schedule,
    index: &Index,
    at: &[usize],
    done: &HashSet<Event>,
) -> ScheduleError {
    let lists = schedule.ranks();
    let mut waits = Vec::new();
    let mut marks = Vec::new();
    // The rank each blocked rank waits for.
    let mut waits_on: Vec<Option<usize>> = vec![None; lists.len()];
    for (rank, list) in lists.iter().enumerate() {
        let step = at[rank];
        let Some(&action) = list.get(step) else {
            continue;
        };
        marks.push(Mark {
            rank,
            step: Some(step),
        });
        let what = if action.kind().is_transfer() {
            match (peer_rank(schedule, action), action.matching()) {
                (Some(peer), Some(other)) => {
                    waits_on[rank] = Some(peer);
                    let peer_at = match lists[peer].get(at[peer]) {
                        Some(head) => format!("it is at step {} ({head})", at[peer]),
                        None => "it has finished".to_owned(),
                    };
                    let other_at = match index.positions.get(&other) {
                        Some(&(_, s)) => format!(" at step {s}"),
                        None => String::new(),
                    };
                    format!("rank {peer} to reach {other}{other_at}; {peer_at}")
                }
                _ => "a peer that does not exist".to_owned(),
            }
        } else {
            let missing: Vec<String> = action
                .needs(schedule.stages())
                .into_iter()
                .filter(|e| !done.contains(e))
                .map(|e| match index.producers.get(&e) {
                    Some(&(r, s, p)) => {
                        waits_on[rank].get_or_insert(r);
                        format!("{p} (rank {r} step {s})")
                    }
                    None => format!(
                        "the {} of micro-batch {} on stage {}",
                        e.phase, e.micro_batch, e.stage
                    ),
                })
                .collect();
            missing.join(" and ")
        };
        waits.push(format!(
            "rank {rank} step {step} ({action}) waits for {what}"
        ));
    }
    let rank = culprit(&waits_on);
    let cycle = cycle_text(&waits_on, rank);
    let step = at.get(rank).copied().unwrap_or(0);
    // Callers stop only with some rank unfinished, and `culprit` picks a blocked rank, so
    // the action exists; the fallback keeps this total without a panic.
    let action = lists
        .get(rank)
        .and_then(|l| l.get(step))
        .copied()
        .unwrap_or(Action::all_reduce(0));
    ScheduleError::Deadlock {
        rank,
        step,
        stage: action.stage(),
        micro_batch: action.micro_batch(),
        action,
        waits: format!("{cycle}\n  {}", waits.join("\n  ")),
        grid: schedule.format_grid(&marks).into(),
    }
}

/// The lowest rank on the wait cycle reached from the lowest blocked rank. Every blocked
/// rank waits for an unfinished, hence blocked, rank, so following the waits must cycle.
fn culprit(waits_on: &[Option<usize>]) -> usize {
    let Some(mut rank) = waits_on.iter().position(Option::is_some) else {
        return 0;
    };
    let mut seen = vec![false; waits_on.len()];
    while !seen[rank] {
        seen[rank] = true;
        match waits_on[rank] {
            Some(next) => rank = next,
            None => return rank,
        }
    }
    // `rank` is on the cycle; walk it once to find its lowest member.
    let (start, mut lowest, mut r) = (rank, rank, rank);
    while let Some(next) = waits_on[r] {
        if next == start {
            break;
        }
        lowest = lowest.min(next);
        r = next;
    }
    lowest
}

/// `"cycle rank 2 -> rank 3 -> rank 2"` for the cycle through `rank` (empty if none).
fn cycle_text(waits_on: &[Option<usize>], rank: usize) -> String {
    let mut members = vec![rank];
    let mut r = rank;
    while let Some(next) = waits_on.get(r).copied().flatten() {
        if next == rank || members.len() > waits_on.len() {
            break;
        }
        members.push(next);
        r = next;
    }
    if members.len() < 2 {
        return String::new();
    }
    members.push(rank);
    let chain: Vec<String> = members.iter().map(|r| format!("rank {r}")).collect();
    format!("cycle {}", chain.join(" -> "))
}
