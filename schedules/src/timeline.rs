//! When each action ran, and what that says about the schedule: makespan, idle time,
//! bubble fraction, peak in-flight activations. Produced by [`crate::simulate()`] from a
//! cost model, or by [`crate::Trace::to_timeline`] from a real run.

use serde::{Deserialize, Serialize};

use crate::ir::{Action, ActionKind};

/// One action's run, in seconds from the start of the step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// What ran.
    pub action: Action,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// Per-rank spans, each rank's in the order it ran them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeline {
    /// Stages of the schedule (the length of [`Timeline::peak_in_flight`]).
    pub stages: usize,
    /// Spans of each rank.
    pub ranks: Vec<Vec<Span>>,
}

impl Timeline {
    /// End of the last span: the step's duration (spans start at 0 or later).
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }

    /// Time each rank spends working. Transfers do not count: a blocked receive is waiting,
    /// and an asynchronous send overlaps compute.
    pub fn busy(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|spans| {
                spans
                    .iter()
                    .filter(|s| !s.action.kind().is_transfer())
                    .map(|s| s.end - s.start)
                    .sum()
            })
            .collect()
    }

    /// Time each rank is not working between 0 and the makespan.
    pub fn idle(&self) -> Vec<f64> {
        let makespan = self.makespan();
        self.busy().into_iter().map(|b| makespan - b).collect()
    }

    /// Sum of [`Timeline::idle`] over the ranks.
    pub fn total_idle(&self) -> f64 {
        self.idle().into_iter().sum()
    }

    /// Idle share of all rank time: `total_idle / (ranks * makespan)`, 0 for an empty step.
    /// For 1F1B and GPipe with equal F and B costs and free transfers this is
    /// `(p - 1) / (m + p - 1)`.
    pub fn bubble_fraction(&self) -> f64 {
        let capacity = self.ranks.len() as f64 * self.makespan();
        if capacity > 0.0 {
            self.total_idle() / capacity
        } else {
            0.0
        }
    }

    /// For each stage, the most micro-batches whose activations it held at once. A
    /// micro-batch's activations are held from the start of its `F` until its `B` or its `W`
    /// completes: the weight gradient needs the stage's inputs, so `I` alone frees only part
    /// of them, and this counts the whole stash. Stages on one rank run in that rank's order,
    /// so the count follows each rank's spans.
    pub fn peak_in_flight(&self) -> Vec<usize> {
        let mut now = vec![0usize; self.stages];
        let mut peak = vec![0usize; self.stages];
        for span in self.ranks.iter().flatten() {
            let s = span.action.stage();
            if s >= self.stages {
                continue;
            }
            match span.action.kind() {
                ActionKind::Forward => {
                    now[s] += 1;
                    peak[s] = peak[s].max(now[s]);
                }
                ActionKind::Backward | ActionKind::BackwardWeight => {
                    now[s] = now[s].saturating_sub(1)
                }
                _ => {}
            }
        }
        peak
    }

    /// For each stage, the most bytes it kept at once for its micro-batches, when a
    /// micro-batch's forward keeps `kept[s]` bytes until its `B` or `W`, and its `I`
    /// adds `handoff[s]` more (what the weight half reads) until its `W`. Stages missing
    /// from the slices keep nothing. Follows each rank's order, as
    /// [`Timeline::peak_in_flight`] does.
    pub fn peak_stash_bytes(&self, kept: &[u64], handoff: &[u64]) -> Vec<u64> {
        self.stash_peaks(kept, handoff).0
    }

    /// [`Timeline::peak_stash_bytes`] per rank: the most bytes all of a rank's stages
    /// kept at once (a rank holding two stages, as in ZB-V, peaks once for both).
    pub fn peak_stash_bytes_per_rank(&self, kept: &[u64], handoff: &[u64]) -> Vec<u64> {
        self.stash_peaks(kept, handoff).1
    }

    /// Peak stash bytes by stage and by rank.
    fn stash_peaks(&self, kept: &[u64], handoff: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let at = |v: &[u64], s: usize| v.get(s).copied().unwrap_or(0);
        let mut now = vec![0u64; self.stages];
        let mut peak = vec![0u64; self.stages];
        let mut rank_peak = vec![0u64; self.ranks.len()];
        for (rank, spans) in self.ranks.iter().enumerate() {
            let mut held = 0u64;
            for span in spans {
                let s = span.action.stage();
                if s >= self.stages {
                    continue;
                }
                let (add, free) = match span.action.kind() {
                    ActionKind::Forward => (at(kept, s), 0),
                    ActionKind::BackwardInput => (at(handoff, s), 0),
                    ActionKind::Backward => (0, at(kept, s)),
                    ActionKind::BackwardWeight => (0, at(kept, s) + at(handoff, s)),
                    _ => (0, 0),
                };
                now[s] = now[s] + add - free.min(now[s] + add);
                held = held + add - free.min(held + add);
                peak[s] = peak[s].max(now[s]);
                rank_peak[rank] = rank_peak[rank].max(held);
            }
        }
        (peak, rank_peak)
    }
}
