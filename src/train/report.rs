//! How the binary reports a run as it goes, to a writer (stderr) and a metrics file: the
//! progress bar, evaluations, skipped updates, checkpoints, and the closing line.
//! `pipetrain train` and the reporting process of `pipetrain launch` share it.

use std::io::Write;
use std::path::Path;

use super::{StepReport, TrainSummary};
use crate::config::TrainConfig;
use crate::telemetry::{MetricsWriter, Progress, StepMetrics};
use crate::Result;

/// Reports the steps of one run.
pub struct Reporter<W: Write> {
    progress: Progress<W>,
    metrics: Option<MetricsWriter>,
    global: f64,
    scaled: bool,
    first: Option<u64>,
    last: f64,
    failed: Option<crate::Error>,
    /// What happened to the job before its first step here (an elastic regroup).
    event: Option<String>,
}

impl<W: Write> Reporter<W> {
    /// A reporter for `cfg`'s run writing to `out` (redrawn in place when `is_terminal`)
    /// and, when given, one JSON line per step to `metrics` (appended to when `resuming`).
    ///
    /// # Errors
    /// `Io` when the metrics file cannot be opened.
    pub fn new(
        cfg: &TrainConfig,
        out: W,
        is_terminal: bool,
        metrics: Option<&Path>,
        resuming: bool,
    ) -> Result<Self> {
        let metrics = match metrics {
            // A resumed run continues its metrics file.
            Some(p) if resuming => Some(MetricsWriter::append(p)?),
            Some(p) => Some(MetricsWriter::create(p)?),
            None => None,
        };
        let total = cfg.optimizer_steps() as u64;
        Ok(Reporter {
            progress: Progress::new(total, out, is_terminal).every(cfg.display_loss_steps as u64),
            metrics,
            global: cfg.global_batch() as f64,
            scaled: cfg.loss_scale() != 1.0,
            first: None,
            last: 0.0,
            failed: None,
            event: None,
        })
    }

    /// Notes `event` (what happened to the job before this run, such as an elastic
    /// regroup) in the metrics line of the first step.
    pub fn with_event(mut self, event: Option<String>) -> Self {
        self.event = event;
        self
    }

    /// Reports step `r`.
    pub fn step(&mut self, r: &StepReport) {
        let first = *self.first.get_or_insert(r.step);
        let elapsed = r.elapsed.as_secs_f64();
        let rate = (r.step + 1 - first) as f64 / elapsed.max(1e-9);
        let _ = self.progress.update(r.step + 1, r.loss, rate);
        if let Some(e) = r.eval_loss {
            let acc = r
                .eval_accuracy
                .map(|a| format!(", accuracy {:.2}%", 100.0 * a))
                .unwrap_or_default();
            let _ = self
                .progress
                .note(&format!("step {}: eval loss {e:.6}{acc}", r.step + 1));
        }
        if r.skipped {
            let _ = self.progress.note(&format!(
                "step {}: gradient overflow at loss scale {}; update skipped, scale halved",
                r.step + 1,
                r.loss_scale
            ));
        }
        for c in &r.saved {
            let _ = self.progress.note(&format!(
                "checkpoint: {} ({:.1} MiB in {:.2}s)",
                c.path.display(),
                c.bytes as f64 / (1 << 20) as f64,
                c.seconds
            ));
        }
        if let Some(w) = self.metrics.as_mut() {
            let m = StepMetrics {
                step: r.step + 1,
                loss: r.loss,
                lr: r.lr,
                samples_per_s: self.global / (elapsed - self.last).max(1e-9),
                elapsed_s: elapsed,
                step_s: Some(elapsed - self.last),
                eval_loss: r.eval_loss,
                eval_accuracy: r.eval_accuracy,
                grad_norm: Some(r.grad_norm),
                clip_coef: r.clip_coef,
                loss_scale: self.scaled.then_some(r.loss_scale),
                skipped: r.skipped,
                samples: Some((r.step + 1) * self.global as u64),
                event: self.event.take(),
                peak_memory_gb: r.peak_memory.map(|b| b as f64 / 1e9),
                ..Default::default()
            };
            if let Err(e) = w.write(&m) {
                self.failed.get_or_insert(e);
            }
        }
        self.last = elapsed;
    }

    /// Writes the closing line of a run that ended with `summary`.
    ///
    /// # Errors
    /// The first error writing the metrics file met.
    pub fn finish(self, summary: &TrainSummary) -> Result<()> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let secs = summary.elapsed.as_secs_f64().max(1e-9);
        let resumed = if summary.first_step > 0 {
            format!(" (resumed at step {})", summary.first_step)
        } else {
            String::new()
        };
        let line = format!(
            "done: {} steps on {} stage(s){resumed}, {:.2}s, {:.1} steps/s, {:.0} samples/s, final loss {:.6}",
            summary.steps,
            summary.stages,
            secs,
            summary.steps as f64 / secs,
            (summary.steps * summary.global_batch) as f64 / secs,
            summary.final_loss
        );
        let line = match summary.peak_memory {
            (predicted, Some(measured)) if predicted > 0 => format!(
                "{line}\npeak memory of this process: {:.2} GB (predicted {:.2} GB)",
                measured as f64 / 1e9,
                predicted as f64 / 1e9
            ),
            _ => line,
        };
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let stash: Vec<String> = summary
            .stash
            .iter()
            .filter(|p| p.measured + p.predicted > 0)
            .map(|p| {
                format!(
                    "stage {} {:.2}/{:.2}",
                    p.stage,
                    mib(p.measured),
                    mib(p.predicted)
                )
            })
            .collect();
        let line = match stash.is_empty() {
            true => line,
            false => format!(
                "{line}\npeak stash MiB (measured/predicted): {}",
                stash.join(", ")
            ),
        };
        let line = match host_traffic(summary) {
            Some(traffic) => format!(
                "{line}
{traffic}"
            ),
            None => line,
        };
        let _ = self.progress.finish(&line);
        Ok(())
    }
}

/// What the stages on their device copied between host and device, a step on average
/// (`None` where every stage keeps its state on the host).
fn host_traffic(summary: &TrainSummary) -> Option<String> {
    if summary.host_traffic.is_empty() || summary.steps == 0 {
        return None;
    }
    let per_step = |b: usize| b as f64 / summary.steps as f64;
    let stages: Vec<String> = (summary.host_traffic.iter())
        .map(|(stage, t)| {
            format!(
                "stage {stage} {:.0} in / {:.0} out",
                per_step(t.to_device),
                per_step(t.to_host)
            )
        })
        .collect();
    Some(format!(
        "host traffic a step, bytes (replica 0's stages on the device): {}",
        stages.join(", ")
    ))
}
