//! How much two pipeline stages' actions slow each other where they run at once, read
//! off a two-rank run's trace.
//!
//! The machine's "two actions at once" is measured on two replicas running the whole
//! model's one graph at once (`machine`). Two stages of a pipeline overlap differently:
//! one stage's forward or backward beside the other's, not two copies of the same graph.
//! On the ViT fixture (2 cores, GPipe and 1F1B, 2 micro-batches) two replicas came out
//! 120% slower each, while in a pipeline the first stage's actions ran at 0.72-0.86 of
//! their speed alone and the last stage's at 0.47-0.58: together 1.3 times one action's
//! work, where the replicas' figure allows 0.9. Charging the replicas' figure to a
//! pipeline's overlap, the simulator predicted the fixtures' 1F1B layouts of two
//! micro-batches slow in 22 of 24 bench runs, by 6.9% on average.
//!
//! Each action that overlaps the other rank's is set against the same stage's action of
//! the same kind that ran alone (their median): what it lost is its time beyond that, and
//! what it did while overlapped is the rest. Each rank's speed while overlapped is its
//! work done then over its time overlapped; the two speeds together give the contention
//! the simulator's symmetric model needs (`2 / (1 + c)` = their sum).

use std::collections::BTreeMap;

use pipetrain_actors::RunTrace;
use pipetrain_schedules::{ActionKind, Trace, TraceEvent};

/// Less than this share of an action's time overlapped: it ran alone.
const ALONE: f64 = 0.05;

/// Less than this share of a rank's busy time overlapped: too little to read a speed.
const ENOUGH: f64 = 0.05;

/// The contention between the two ranks of `trace` (its first `warmup` steps left out),
/// `None` where its ranks overlapped too little, or an overlapped action had no action
/// of its stage and kind alone to set it against.
pub(super) fn stage_contention(trace: &RunTrace, warmup: usize) -> Option<f64> {
    let seen = seen_in(trace, warmup);
    let alone = alone_times(&seen);
    let speed = |rank: usize| -> Option<f64> {
        let mine = seen.iter().filter(|s| s.rank == rank);
        let busy: f64 = mine.clone().map(|s| s.time).sum();
        let overlapped: Vec<&Seen> = mine.filter(|s| s.overlap >= ALONE * s.time).collect();
        let time: f64 = overlapped.iter().map(|s| s.overlap).sum();
        if busy <= 0.0 || time < ENOUGH * busy {
            return None;
        }
        let mut done = 0.0;
        for s in overlapped {
            let own = alone.get(&s.key)?;
            // Its work less what it did on its own: what it did while overlapped.
            done += (own - (s.time - s.overlap)).clamp(0.0, s.overlap);
        }
        Some(done / time)
    };
    let together = speed(0)? + speed(1)?;
    (together > 0.0).then(|| (2.0 / together - 1.0).max(0.0))
}

/// Each compute action of `trace`'s two-rank steps (the first `warmup` left out), with
/// its overlap.
fn seen_in(trace: &RunTrace, warmup: usize) -> Vec<Seen> {
    trace
        .steps
        .iter()
        .skip(warmup)
        .filter_map(|replicas| replicas.first())
        .filter(|t| t.ranks.len() == 2)
        .flat_map(overlaps)
        .collect()
}

/// One compute action of a step: its rank, what it was (stage and kind), its time, and
/// how much of it the other rank's compute overlapped.
struct Seen {
    rank: usize,
    key: (usize, ActionKind),
    time: f64,
    overlap: f64,
}

/// Each compute action of `t`'s two ranks with its overlap.
fn overlaps(t: &Trace) -> Vec<Seen> {
    let computes = |r: usize| -> Vec<&TraceEvent> {
        t.ranks[r]
            .iter()
            .filter(|e| e.action.kind().is_compute() && e.end_ns > e.start_ns)
            .collect()
    };
    let ranks = [computes(0), computes(1)];
    let mut out = Vec::new();
    for (rank, mine) in ranks.iter().enumerate() {
        for e in mine {
            let overlap: u64 = ranks[1 - rank]
                .iter()
                .map(|o| {
                    e.end_ns
                        .min(o.end_ns)
                        .saturating_sub(e.start_ns.max(o.start_ns))
                })
                .sum();
            out.push(Seen {
                rank,
                key: (e.action.stage(), e.action.kind()),
                time: (e.end_ns - e.start_ns) as f64,
                overlap: overlap as f64,
            });
        }
    }
    out
}

/// Per stage and kind, the median time of its actions that ran alone.
fn alone_times(seen: &[Seen]) -> BTreeMap<(usize, ActionKind), f64> {
    let mut times: BTreeMap<(usize, ActionKind), Vec<f64>> = BTreeMap::new();
    for s in seen.iter().filter(|s| s.overlap < ALONE * s.time) {
        times.entry(s.key).or_default().push(s.time);
    }
    times
        .into_iter()
        .filter_map(|(k, v)| Some((k, super::rounds::median(&v)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipetrain_schedules::{gpipe, Action};

    /// A step of two ranks, each event an action and its start and end.
    fn step(ranks: [&[(Action, u64, u64)]; 2]) -> Trace {
        let events = |r: &[(Action, u64, u64)]| {
            r.iter()
                .map(|&(a, s, e)| TraceEvent::new(a, s, e))
                .collect()
        };
        Trace {
            ranks: ranks.iter().map(|r| events(r)).collect(),
        }
    }

    fn run(steps: Vec<Trace>) -> RunTrace {
        RunTrace {
            schedule: gpipe(2, 2).unwrap(),
            replicas: 1,
            steps: steps.into_iter().map(|t| vec![t]).collect(),
        }
    }

    #[test]
    fn the_contention_is_what_the_ranks_lost_where_they_overlapped() {
        // Alone, stage 0's forward takes 100 and stage 1's 200. The second forward of
        // stage 0 (100 of work) and the first of stage 1 (200) overlap for 100: stage 0's
        // took 125, stage 1's 250. While overlapped stage 0 did 75 of its work and stage
        // 1 50: together 1.25 of one action's speed, each 1 / 1.6.
        let (f, b) = (Action::forward, Action::backward);
        let one = step([
            &[(f(0, 0), 0, 100), (f(0, 1), 150, 275), (b(0, 0), 700, 800)],
            &[(f(1, 0), 175, 425), (f(1, 1), 450, 650)],
        ]);
        let c = stage_contention(&run(vec![one.clone(), one]), 0).unwrap();
        assert!((c - 0.6).abs() < 1e-9, "{c}");
    }

    #[test]
    fn ranks_that_never_overlap_tell_nothing() {
        let apart = step([
            &[(Action::forward(0, 0), 0, 100)],
            &[(Action::forward(1, 0), 120, 300)],
        ]);
        assert_eq!(stage_contention(&run(vec![apart]), 0), None);
    }
}
