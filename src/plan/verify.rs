//! Real runs of the planner's candidates: the step a `pipetrain train` process takes
//! with a candidate's configuration, from its trace.

use std::path::Path;
use std::process::Command;

use crate::{Error, Result};

use super::{plan_error, PlanRow};

/// A candidate's real run.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Mean seconds from one step's start to the next's, after the warm-up steps.
    pub step: f64,
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
    let body = super::candidate_text(&text, (config, &path), row, Some(steps))?;
    std::fs::write(&path, body).map_err(Error::io(&path))?;
    let dir = std::env::temp_dir().join(format!("pipetrain-plan-{}-measure", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    let out = std::path::absolute(&path)
        .map_err(Error::io(&path))
        .and_then(|p| {
            Command::new(worker)
                .arg("train")
                .arg(p)
                .arg("--trace")
                .arg("trace.json")
                .current_dir(&dir)
                .output()
                .map_err(Error::io(worker))
        });
    let _ = std::fs::remove_file(&path);
    let out = out?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(plan_error(
            "measuring a candidate",
            format!(
                "the run failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    let step = step_period(&dir.join("trace.json"), warmup);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Measured { step: step? })
}

/// Mean seconds between consecutive steps' starts after `warmup` steps, from a trace.
fn step_period(trace: &Path, warmup: usize) -> Result<f64> {
    let text = std::fs::read(trace).map_err(Error::io(trace))?;
    let run: pipetrain_actors::RunTrace = serde_json::from_slice(&text)
        .map_err(|e| plan_error("reading a measured run's trace", e.to_string()))?;
    let bounds: Vec<(u64, u64)> = run
        .steps
        .iter()
        .map(|replicas| {
            let events = replicas.iter().flat_map(|t| t.ranks.iter().flatten());
            let start = events.clone().map(|e| e.start_ns).min().unwrap_or(0);
            let end = events.map(|e| e.end_ns).max().unwrap_or(0);
            (start, end)
        })
        .collect();
    let counted = bounds.get(warmup..).unwrap_or(&[]);
    if counted.len() < 2 {
        return Err(plan_error(
            "measuring a candidate",
            format!(
                "{} step(s) after warm-up; 2 or more are needed",
                counted.len()
            ),
        ));
    }
    let first = counted[0].0;
    let last = counted[counted.len() - 1].0;
    Ok((last - first) as f64 * 1e-9 / (counted.len() - 1) as f64)
}
