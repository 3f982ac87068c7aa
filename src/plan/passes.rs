//! A run's trace read: each pass's mean time, the update's and the step's (`Passes`),
//! and what a hand-off between two stage actors takes. Every run the planner makes
//! (profile, machine, control, measured candidates) is read through these.

use std::path::Path;

use pipetrain_actors::RunTrace;
use pipetrain_schedules::ActionKind as K;

/// A one-stage run's mean seconds per micro-batch for its forward and its backward
/// (`B`, or `I` and `W` together), and per step for its update.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Passes {
    pub forward: f64,
    pub backward: f64,
    pub step: f64,
    /// Seconds per step that no action accounts for.
    pub idle: f64,
    /// Mean seconds from one step's start to the next's.
    pub period: f64,
}

/// [`Passes`] from a run's trace file, the first `warmup` steps left out.
pub(super) fn pass_seconds(trace: &Path, warmup: usize) -> std::result::Result<Passes, String> {
    passes_in(&read_trace(trace)?, warmup).map_err(|e| format!("{}: {e}", trace.display()))
}

/// [`Passes`] from a run's trace, the first `warmup` steps left out.
pub(super) fn passes_in(run: &RunTrace, warmup: usize) -> std::result::Result<Passes, String> {
    let counted = run.steps.len().saturating_sub(warmup);
    if counted == 0 {
        return Err("no step recorded after warm-up".into());
    }
    let mut p = Passes::default();
    let mut micro_batches = 0usize;
    let events = run.steps[warmup..]
        .iter()
        .filter_map(|replicas| replicas.first())
        .flat_map(|t| t.ranks.iter().flatten());
    for e in events {
        let secs = (e.end_ns - e.start_ns) as f64 * 1e-9;
        match e.action.kind() {
            K::Forward => {
                p.forward += secs;
                micro_batches += 1;
            }
            K::Backward | K::BackwardInput | K::BackwardWeight => p.backward += secs,
            K::OptimizerStep => p.step += secs,
            _ => {}
        }
    }
    let mbs = micro_batches.max(1) as f64;
    let starts: Vec<u64> = run.steps[warmup..]
        .iter()
        .filter_map(|replicas| replicas.first())
        .filter_map(|t| t.ranks.iter().flatten().map(|e| e.start_ns).min())
        .collect();
    let period = match starts.len() {
        0 | 1 => 0.0,
        n => (starts[n - 1] - starts[0]) as f64 * 1e-9 / (n - 1) as f64,
    };
    let busy = (p.forward + p.backward + p.step) / counted as f64;
    let idle = (period - busy).max(0.0);
    Ok(Passes {
        forward: p.forward / mbs,
        backward: p.backward / mbs,
        step: p.step / counted as f64,
        idle,
        period,
    })
}

/// A run's trace file (`train --trace`), read; an error names the file.
pub(super) fn read_trace(trace: &Path) -> std::result::Result<RunTrace, String> {
    let text = std::fs::read(trace).map_err(|e| format!("{}: {e}", trace.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", trace.display()))
}

/// What a hand-off between two stage actors takes, from a two-stage run's trace (the
/// first `warmup` steps left out): the median wait of an action for a value from the
/// other stage, where its own stage was idle when the value was made; activations and
/// gradients apart (`.0`, `.1`), a direction that shows none taking the other's.
///
/// Apart, because they differ: on the GPipe runs of the Llama fixture an activation
/// took 20-26 us and a gradient 2, and their median together (4-5 us) was neither.
pub(super) fn hand_off_in(
    trace: &RunTrace,
    warmup: usize,
) -> std::result::Result<(f64, f64), String> {
    let waits: Vec<(bool, f64)> = trace
        .steps
        .iter()
        .skip(warmup)
        .filter_map(|replicas| replicas.first())
        .flat_map(hand_off_waits)
        .collect();
    let median = |forward: bool| {
        let of: Vec<f64> = waits
            .iter()
            .filter(|w| w.0 == forward)
            .map(|w| w.1)
            .collect();
        super::rounds::median(&of)
    };
    match (median(true), median(false)) {
        (Some(f), Some(b)) => Ok((f, b)),
        (Some(one), None) | (None, Some(one)) => Ok((one, one)),
        (None, None) => Err("the two-stage run shows no hand-off".to_string()),
    }
}

/// In one step of a two-stage run: for each forward of stage 1 and backward of stage 0
/// that started after its rank's previous action, whether it waited for activations,
/// and the time from the value's making on the other rank to its start.
fn hand_off_waits(t: &pipetrain_schedules::Trace) -> Vec<(bool, f64)> {
    let end_of = |kinds: &[K], stage: usize, mb: usize| {
        t.ranks
            .iter()
            .flatten()
            .find(|e| {
                kinds.contains(&e.action.kind())
                    && e.action.stage() == stage
                    && e.action.micro_batch() == Some(mb)
            })
            .map(|e| e.end_ns)
    };
    let mut out = Vec::new();
    for rank in &t.ranks {
        let computes: Vec<_> = rank
            .iter()
            .filter(|e| !e.action.kind().is_transfer())
            .collect();
        for (k, e) in computes.iter().enumerate() {
            let Some(mb) = e.action.micro_batch() else {
                continue;
            };
            let made = match (e.action.kind(), e.action.stage()) {
                (K::Forward, 1) => end_of(&[K::Forward], 0, mb),
                (K::Backward, 0) => end_of(&[K::Backward, K::BackwardInput], 1, mb),
                _ => None,
            };
            let idle_since = k.checked_sub(1).map_or(0, |p| computes[p].end_ns);
            // Each actor stamps its own clock readings: a receiver may record its start a
            // hair before the sender recorded its end.
            if let Some(made) = made.filter(|&m| m >= idle_since) {
                let forward = e.action.kind() == K::Forward;
                out.push((forward, e.start_ns.saturating_sub(made) as f64 * 1e-9));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipetrain_schedules::{gpipe, Action, Trace, TraceEvent};

    #[test]
    fn activations_and_gradients_are_handed_off_apart() {
        // GPipe, two stages, one micro-batch, microseconds: stage 1's forward waits 20
        // for the activations; stage 0's backward 2 for the gradient.
        let ev = |a, from: u64, to: u64| TraceEvent::new(a, from * 1000, to * 1000);
        let (f, b) = (Action::forward, Action::backward);
        let step = |fw: u64, bw: u64| Trace {
            ranks: vec![
                vec![ev(f(0, 0), 0, 10), ev(b(0, 0), 60 + fw + bw, 80 + fw)],
                vec![ev(f(1, 0), 10 + fw, 40 + fw), ev(b(1, 0), 40 + fw, 60 + fw)],
            ],
        };
        let trace = |steps: Vec<Trace>| RunTrace {
            schedule: gpipe(2, 1).unwrap(),
            replicas: 1,
            steps: steps.into_iter().map(|s| vec![s]).collect(),
        };
        let us = |(a, b): (f64, f64)| ((a * 1e6).round(), (b * 1e6).round());
        let run = trace(vec![step(99, 99), step(20, 2), step(21, 2), step(19, 3)]);
        assert_eq!(hand_off_in(&run, 1).map(us), Ok((20.0, 2.0)));
        // A run that shows no gradient handed off: the activations' stands in.
        let forward_only = Trace {
            ranks: vec![vec![ev(f(0, 0), 0, 10)], vec![ev(f(1, 0), 30, 40)]],
        };
        assert_eq!(
            hand_off_in(&trace(vec![forward_only]), 0).map(us),
            Ok((20.0, 20.0))
        );
        assert!(hand_off_in(&trace(Vec::new()), 0).is_err());
    }
}
