//! Real runs of the planner's candidates: the step a `pipetrain train` process takes
//! with a candidate's configuration, from its trace.

use std::path::Path;

use crate::{Error, Result};

use super::passes::{passes_in, read_trace};
use super::runs::run_and_read;
use super::{plan_error, PlanRow};

/// A candidate's real run.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Mean seconds from one step's start to the next's, after the warm-up steps.
    pub step: f64,
    /// The process's peak resident bytes, node 0's in a launched job (`None`: not said).
    pub peak: Option<u64>,
}

/// Runs `row`'s configuration (the user's at `config`, with `row`'s layout) for `steps`
/// steps in a `pipetrain train` process and measures its step.
///
/// # Errors
/// `Plan` when the run fails or its trace has too few steps.
pub fn measure_step(
    worker: &Path,
    config: &Path,
    row: &PlanRow,
    (steps, warmup): (usize, usize),
) -> Result<Measured> {
    let text = std::fs::read_to_string(config).map_err(Error::io(config))?;
    let name = format!(".pipetrain-plan-{}-measure.toml", std::process::id());
    let path = config.parent().unwrap_or(Path::new(".")).join(name);
    let body = super::candidate_text(&text, (config, &path), row, (Some(steps), None))?;
    std::fs::write(&path, body).map_err(Error::io(&path))?;
    let period = run_and_read(worker, &path, "measure", |dir| {
        let path = dir.join("trace.json");
        let trace = read_trace(&path)?;
        tracing::debug!(
            "measured {:?}: per stage F/B/I/W ms {}",
            row.candidate,
            super::shares::stage_actions_text(&trace, warmup)
        );
        let period = passes_in(&trace, warmup)
            .map(|p| p.period)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok((period, last_peak(&dir.join("metrics.jsonl"))))
    })
    .map_err(|reason| plan_error("measuring a candidate", reason))?;
    let (period, peak) = period;
    match period > 0.0 {
        true => Ok(Measured { step: period, peak }),
        false => Err(plan_error(
            "measuring a candidate",
            format!("{steps} steps, {warmup} not counted: 2 or more must be counted"),
        )),
    }
}

/// The peak memory the last step of a metrics file reports, bytes.
pub(super) fn last_peak(metrics: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let last = text.lines().rev().find(|l| !l.trim().is_empty())?;
    let m: crate::telemetry::StepMetrics = serde_json::from_str(last).ok()?;
    m.peak_memory_gb.map(|gb| (gb * 1e9) as u64)
}
