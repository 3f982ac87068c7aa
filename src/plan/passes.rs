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
/// other stage, where its own stage was idle when the value was made.
pub(super) fn hand_off_in(trace: &RunTrace, warmup: usize) -> std::result::Result<f64, String> {
    let mut waits: Vec<f64> = trace
        .steps
        .iter()
        .skip(warmup)
        .filter_map(|replicas| replicas.first())
        .flat_map(hand_off_waits)
        .collect();
    waits.sort_by(f64::total_cmp);
    waits
        .get(waits.len() / 2)
        .copied()
        .ok_or_else(|| "the two-stage run shows no hand-off".to_string())
}

/// In one step of a two-stage run: for each forward of stage 1 and backward of stage 0
/// that started after its rank's previous action, the time from the value's making on
/// the other rank to its start.
fn hand_off_waits(t: &pipetrain_schedules::Trace) -> Vec<f64> {
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
                out.push(e.start_ns.saturating_sub(made) as f64 * 1e-9);
            }
        }
    }
    out
}
