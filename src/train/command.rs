//! `pipetrain train`: a run from a configuration file, with its progress on stderr, a
//! metrics file and traces when asked, and the stop signals handled (see `signals.rs`).

use std::io::IsTerminal;
use std::path::Path;

use pipetrain_actors::RunControl;

use super::{signal_name, Reporter, StopOnSignal, TrainSummary};
use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::Result;

/// What a run does with an earlier run's complete checkpoints in its `checkpoints_dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlierRun {
    /// Refuse to start (it would write over them): the default.
    Refuse,
    /// Go on from the newest (`--resume`).
    Resume,
    /// Move them aside and start from step 0 (`--fresh`).
    MoveAside,
}

/// Runs `pipetrain train CONFIG`: resumes from the newest complete checkpoint, refuses,
/// or moves the checkpoints aside as `earlier` says, writes one JSON object per step to
/// `metrics`, and the run's trace (and its Chrome trace) when asked. `Some(signal)` when
/// a SIGINT or SIGTERM stopped the run (after a checkpoint, when it saves any).
///
/// # Errors
/// The run's errors, naming the file, field and rule.
pub fn train_command(
    config: &Path,
    metrics: Option<&Path>,
    (trace, chrome): (Option<&Path>, Option<&Path>),
    earlier: EarlierRun,
) -> Result<Option<i32>> {
    let mut cfg = TrainConfig::load(config)?;
    let resume = earlier == EarlierRun::Resume;
    if !resume {
        let again = format!("pipetrain train {} --resume", config.display());
        let fresh = earlier == EarlierRun::MoveAside;
        if let Some(aside) = super::claim_checkpoints_dir(&cfg, config, fresh, &again)? {
            eprintln!(
                "pipetrain: --fresh: the earlier run's checkpoints moved to {}",
                aside.display()
            );
        }
    }
    if resume && cfg.checkpoint_to_load_path.is_none() {
        match super::latest_checkpoint(&cfg, config)? {
            Some(path) => cfg.checkpoint_to_load_path = Some(path),
            None => eprintln!(
                "pipetrain: no complete checkpoint in {}; starting from step 0",
                cfg.checkpoints_dir
                    .as_deref()
                    .unwrap_or(Path::new("?"))
                    .display()
            ),
        }
    }
    let rt = Runtime::from_env()?;
    let shards = match cfg.horizontal_parallel_size {
        1 => String::new(),
        n => format!(" x {n} tensor shards"),
    };
    eprintln!(
        "pipetrain: {} | {} stage(s) x {} replica(s){shards}, {} micro-batches of {} | ONNX Runtime {}",
        cfg.model_name(),
        cfg.stages(),
        cfg.data_parallel_size,
        cfg.gradient_accumulation_steps,
        cfg.batch_size,
        rt.info().version
    );
    if let Some(path) = &cfg.checkpoint_to_load_path {
        eprintln!("pipetrain: resuming from {}", path.display());
    }
    let resuming = cfg.checkpoint_to_load_path.is_some();
    let stderr = std::io::stderr();
    let is_terminal = stderr.is_terminal();
    let mut reporter = Reporter::new(&cfg, stderr, is_terminal, metrics, resuming)?;
    let record = trace.is_some() || chrome.is_some();
    let (control, requests) = flume::unbounded();
    let signals = StopOnSignal::install("pipetrain", move |_| {
        let _ = control.send(RunControl::Stop);
    })?;
    let summary = super::train_controlled(&rt, &cfg, config, record, Some(requests), |r| {
        reporter.step(r)
    })?;
    reporter.finish(&summary)?;
    let stopped = signals.received();
    if let Some(sig) = stopped {
        stopped_note(&cfg, config, &summary, sig)?;
    }
    if let (Some(path), Some(t)) = (trace, &summary.trace) {
        super::save_trace(t, path)?;
        eprintln!("trace: {}", path.display());
    }
    if let (Some(path), Some(t)) = (chrome, &summary.trace) {
        let json = crate::telemetry::chrome_trace(t);
        crate::onnx::save_bytes(path, json.to_string().as_bytes())?;
        eprintln!("chrome trace (Perfetto): {}", path.display());
    }
    if let Some(out) = &cfg.output_path {
        let done = summary.first_step + summary.steps as u64;
        let total = cfg.optimizer_steps() as u64;
        match done < total {
            true => eprintln!(
                "partly trained model: {} (stopped after step {done} of {total}; its metadata \
                 says so: {} = false)",
                out.display(),
                crate::graph::COMPLETE_KEY
            ),
            false => eprintln!("trained model: {}", out.display()),
        }
    }
    Ok(stopped)
}

/// What a run stopped by a signal left: where it stopped, and how to go on.
fn stopped_note(cfg: &TrainConfig, config: &Path, summary: &TrainSummary, sig: i32) -> Result<()> {
    let at = summary.first_step + summary.steps as u64;
    let saved = match super::latest_checkpoint(cfg, config)? {
        Some(path) => format!("newest checkpoint {}", path.display()),
        None => "no checkpoint (no checkpoints_dir)".into(),
    };
    eprintln!(
        "pipetrain: stopped by {} after step {at}; {saved}; `pipetrain train {} --resume` goes on",
        signal_name(sig),
        config.display()
    );
    Ok(())
}
