//! V-Half and V-Min: pipeline schedules with controllable activation memory (Qi et al.
//! 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).
//!
//! Both run on ZB-V's V placement (rank `r` holds stages `r` and `2 * ranks - 1 - r`) and
//! are built the paper's way, from a *building block*: each rank's offsets, within a
//! period of six slots per micro-batch, for its first-stage forward (`F0`), second-stage
//! forward (`F1`), second-stage input gradient (`I1`) and first-stage input gradient
//! (`I0`). Repeating the block gives the steady state; its lifespan (how long a
//! micro-batch's activations stay on a rank) sets the memory: V-Half holds about half of
//! 1F1B's activations, V-Min about a third. The warm-up and cool-down are then *squeezed*:
//! in slot order, each action moves to the earliest free slot its dependencies allow, as
//! long as the rank's peak does not rise above the block's. Weight gradients fill the
//! slots left free, oldest first. Slot times only fix the order; the runtime and
//! [`crate::simulate()`] time it with real costs.
//!
//! Written here rather than taken from a crate: no Rust crate generates these schedules.

use crate::ir::Action;
use crate::schedule::v_placement;
use crate::{Schedule, ScheduleError};

/// Which building block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Half,
    Min,
}

// Action types of a rank's slot lists, in the order the squeeze breaks ties.
const F0: usize = 0;
const F1: usize = 1;
const I1: usize = 2;
const I0: usize = 3;
/// Weight gradients, one list while squeezing (in input-gradient order) and then two:
/// `W1` for the second stage's and `W0` for the first's.
const W1: usize = 4;
const W0: usize = 5;

/// Slots of one rank: `slots[type][micro_batch]`.
type Slots = Vec<Vec<usize>>;

/// Slots a building block spans per micro-batch.
const PERIOD: usize = 6;

/// V-Half: about half of 1F1B's activation memory at ZB-V's placement.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] for a zero parameter.
pub fn v_half(ranks: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    generate("v_half", Block::Half, ranks, micro_batches)
}

/// V-Min: about a third of 1F1B's activation memory, for a longer bubble.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] for a zero parameter.
pub fn v_min(ranks: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    generate("v_min", Block::Min, ranks, micro_batches)
}

fn generate(
    context: &'static str,
    block: Block,
    ranks: usize,
    micro_batches: usize,
) -> Result<Schedule, ScheduleError> {
    super::require_positive(
        context,
        &[("ranks", ranks), ("micro_batches", micro_batches)],
    )?;
    let lists = slots(block, ranks, micro_batches)
        .iter()
        .enumerate()
        .map(|(r, s)| actions(ranks, r, s))
        .collect();
    Schedule::new(v_placement(ranks), micro_batches, lists)
}

/// The building block: each rank's `[F0, F1, I1, I0]` offsets.
fn block(kind: Block, p: usize) -> Vec<[usize; 4]> {
    (0..p)
        .map(|r| match kind {
            Block::Half => {
                let gap = if p % 2 == 0 { 3 } else { 0 };
                [
                    2 * r,
                    3 * p - r - 2,
                    3 * p + gap + 2 * r - 1,
                    6 * p + gap - r - 2,
                ]
            }
            Block::Min => {
                let gap = if p % 3 == 0 { 2 } else { 0 };
                [r, 2 * p - r - 1, 2 * p + gap + r, 4 * p + gap - r - 1]
            }
        })
        .collect()
}

/// The final slots of every rank: the repeated block, squeezed with the weight gradients
/// placed, squeezed again without them, and the weight gradients placed per stage.
fn slots(kind: Block, p: usize, m: usize) -> Vec<Slots> {
    let repeated = block(kind, p)
        .iter()
        .map(|offsets| {
            let times = |o: usize| (0..m).map(|k| o + PERIOD * k).collect();
            offsets.iter().map(|&o| times(o)).collect()
        })
        .collect();
    let without_w = |stages: Vec<Slots>| -> Vec<Slots> {
        stages.into_iter().map(|s| s[..W1].to_vec()).collect()
    };
    let first = without_w(squeeze(repeated, true));
    let second = without_w(squeeze(first, false));
    second.iter().map(|s| place_weights(s, true)).collect()
}

/// A rank's actions in slot order.
fn actions(p: usize, r: usize, slots: &Slots) -> Vec<Action> {
    let (first, second) = (r, 2 * p - 1 - r);
    let mut timed: Vec<(usize, Action)> = Vec::new();
    for (kind, times) in slots.iter().enumerate() {
        for (k, &t) in times.iter().enumerate() {
            let action = match kind {
                F0 => Action::forward(first, k),
                F1 => Action::forward(second, k),
                I1 => Action::backward_input(second, k),
                I0 => Action::backward_input(first, k),
                W1 => Action::backward_weight(second, k),
                _ => Action::backward_weight(first, k),
            };
            timed.push((t, action));
        }
    }
    timed.sort_by_key(|&(t, _)| t);
    timed.into_iter().map(|(_, a)| a).collect()
}

/// What sits in each slot of a rank, up to its last.
fn occupancy(slots: &Slots) -> Vec<Option<usize>> {
    let end = slots.iter().flatten().max().map_or(0, |&t| t + 1);
    let mut busy = vec![None; end];
    for (kind, times) in slots.iter().enumerate() {
        for &t in times {
            busy[t] = Some(kind);
        }
    }
    busy
}

/// Adds the weight gradients to a rank's `[F0, F1, I1, I0]` slots: each free slot takes
/// the oldest one pending (the second stage's first when `split`), the rest follow the
/// last slot. One list in input-gradient order, or (`split`) one per stage.
fn place_weights(slots: &Slots, split: bool) -> Slots {
    let mut out = slots[..W1].to_vec();
    let lists = if split { 2 } else { 1 };
    out.extend(std::iter::repeat_n(Vec::new(), lists));
    let busy = occupancy(&out);
    let mut pending = [0usize; 2];
    for (t, kind) in busy.iter().enumerate() {
        match *kind {
            Some(kind @ (I1 | I0)) => pending[if split { kind - I1 } else { 0 }] += 1,
            Some(_) => {}
            None => {
                if let Some(w) = (0..lists).find(|&w| pending[w] > 0) {
                    out[[W1, W0][w]].push(t);
                    pending[w] -= 1;
                }
            }
        }
    }
    let mut t = busy.len().saturating_sub(1);
    for w in 0..lists {
        for _ in 0..pending[w] {
            t += 1;
            out[[W1, W0][w]].push(t);
        }
    }
    out
}

/// A rank's peak of stashed activations, in stage-micro-batches: a forward adds one, a
/// weight gradient frees one. Without weight-gradient lists, each free slot frees one
/// pending (as [`place_weights`] would place them).
fn peak(slots: &Slots) -> usize {
    let has_w = slots.len() > W1;
    let (mut held, mut pending, mut peak) = (0usize, 0usize, 0usize);
    for kind in occupancy(slots) {
        match kind {
            Some(F0 | F1) => held += 1,
            Some(I1 | I0) => pending += 1,
            Some(_) => held -= 1,
            None if !has_w && pending > 0 => {
                pending -= 1;
                held -= 1;
            }
            None => {}
        }
        peak = peak.max(held);
    }
    peak
}

/// Every action of every rank as `(slot, rank, type, micro-batch)`, in that order.
fn in_slot_order(stages: &[Slots]) -> Vec<(usize, usize, usize, usize)> {
    let mut all = Vec::new();
    for (s, slots) in stages.iter().enumerate() {
        for (kind, times) in slots.iter().enumerate() {
            all.extend(times.iter().enumerate().map(|(k, &t)| (t, s, kind, k)));
        }
    }
    all.sort_unstable();
    all
}

/// The slot after the last one `stages[s][kind][k]` depends on (not counting its rank's
/// previous action): the neighbour's same pass, the rank's previous pass of the
/// micro-batch, the input gradient a weight gradient follows, the previous micro-batch.
fn earliest(stages: &[Slots], s: usize, kind: usize, k: usize) -> usize {
    let mut after: Option<usize> = None;
    let mut need = |t: usize| after = Some(after.map_or(t, |a| a.max(t)));
    match kind {
        F0 | I1 if s > 0 => need(stages[s - 1][kind][k]),
        F1 | I0 if s + 1 < stages.len() => need(stages[s + 1][kind][k]),
        _ => {}
    }
    if (F1..=I0).contains(&kind) {
        need(stages[s][kind - 1][k]);
    }
    if kind == W1 {
        let mut inputs: Vec<usize> = stages[s][I1]
            .iter()
            .chain(&stages[s][I0])
            .copied()
            .collect();
        inputs.sort_unstable();
        need(inputs[k]);
    }
    if k > 0 {
        need(stages[s][kind][k - 1]);
    }
    after.map_or(0, |t| t + 1)
}

/// The paper's squeeze: in slot order, every action of the warm-up (only when
/// `with_weights`, the weight gradients then placed first) and of the cool-down moves to
/// the earliest free slot after its dependencies that keeps the rank's peak within the
/// block's; the steady state stays. Returns the slots as run back to back.
fn squeeze(stages: Vec<Slots>, with_weights: bool) -> Vec<Slots> {
    let mut stages: Vec<Slots> = match with_weights {
        true => stages.iter().map(|s| place_weights(s, false)).collect(),
        false => stages,
    };
    let limit = stages.iter().map(peak).max().unwrap_or(0);
    let last = stages[0][F0].len() - 1;
    let order = in_slot_order(&stages);
    let end = order.last().map_or(0, |a| a.0 + 1);
    let mut taken = vec![vec![false; end]; stages.len()];
    let mut phase = Phase::WarmUp;
    for (slot, s, kind, k) in order {
        if phase == Phase::WarmUp && kind == I0 && s == 0 {
            phase = Phase::Steady;
        }
        let keep = phase == Phase::Steady || (phase == Phase::WarmUp && !with_weights);
        if phase == Phase::Steady && kind == F0 && k == last {
            phase = Phase::CoolDown;
        }
        if !keep {
            let from = earliest(&stages, s, kind, k);
            debug_assert!(from <= slot, "the block breaks a dependency");
            let fits = (from..slot).find(|&t| {
                !taken[s][t] && {
                    stages[s][kind][k] = t;
                    peak(&stages[s]) <= limit
                }
            });
            stages[s][kind][k] = fits.unwrap_or(slot);
        }
        taken[s][stages[s][kind][k]] = true;
    }
    if !with_weights {
        stages = stages.iter().map(|s| place_weights(s, false)).collect();
    }
    back_to_back(&stages)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    WarmUp,
    Steady,
    CoolDown,
}

/// Each action's slot when every action takes one slot and starts as soon as its
/// dependencies and its rank's previous action are done, in the given order.
fn back_to_back(stages: &[Slots]) -> Vec<Slots> {
    let mut start: Vec<Slots> = stages
        .iter()
        .map(|s| s.iter().map(|t| vec![0; t.len()]).collect())
        .collect();
    let mut free = vec![0usize; stages.len()];
    let p = stages.len();
    for (_, s, kind, k) in in_slot_order(stages) {
        let mut ready = free[s];
        let done = |st: &Vec<Slots>, s: usize, kind: usize, k: usize| st[s][kind][k] + 1;
        match kind {
            F0 | I1 if s > 0 => ready = ready.max(done(&start, s - 1, kind, k)),
            F1 | I0 if s + 1 < p => ready = ready.max(done(&start, s + 1, kind, k)),
            _ => {}
        }
        if (F1..=I0).contains(&kind) {
            ready = ready.max(done(&start, s, kind - 1, k));
        }
        if k > 0 {
            ready = ready.max(done(&start, s, kind, k - 1));
        }
        start[s][kind][k] = ready;
        free[s] = ready + 1;
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ActionKind;

    #[test]
    fn every_micro_batch_runs_once_in_each_pass_of_each_stage() {
        for (name, make) in [("v_half", v_half as fn(_, _) -> _), ("v_min", v_min)] {
            for p in 1..=4 {
                for m in 1..=2 * p + 5 {
                    let s: Schedule = make(p, m).unwrap_or_else(|e| panic!("{name} {p} {m}: {e}"));
                    for kind in [
                        ActionKind::Forward,
                        ActionKind::BackwardInput,
                        ActionKind::BackwardWeight,
                    ] {
                        let n = s.ranks().iter().flatten().filter(|a| a.kind() == kind);
                        assert_eq!(n.count(), 2 * p * m, "{name} p={p} m={m} {kind:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_blocks_hold_half_and_a_third_of_one_f_one_b() {
        // 1F1B keeps `p` micro-batches of a whole rank (two V stages) on its first rank.
        for p in 2..=8 {
            let repeated = |kind| -> Vec<Slots> {
                block(kind, p)
                    .iter()
                    .map(|o| {
                        o.iter()
                            .map(|&o| (0..4 * p).map(|k| o + PERIOD * k).collect())
                            .collect()
                    })
                    .collect()
            };
            let most = |kind| repeated(kind).iter().map(peak).max().unwrap();
            assert!(most(Block::Half) <= p + 2, "p={p}: {}", most(Block::Half));
            assert!(
                most(Block::Min) <= (2 * p).div_ceil(3) + 2,
                "p={p}: {}",
                most(Block::Min)
            );
        }
    }
}
