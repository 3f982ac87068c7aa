//! A run's TensorBoard log (`log_dir`): the chosen scalars of every step, and histograms
//! of the parameters (and their gradients) named in `histogram_names`, which replica 0's
//! stages copy out as they update.

use crate::config::{TrainConfig, SCALAR_NAMES};
use crate::pipeline::HistogramTap;
use crate::telemetry::TensorBoardWriter;
use crate::{Error, Result};

use super::StepReport;

/// The open log of a run.
pub(super) struct Board {
    writer: TensorBoardWriter,
    scalars: Vec<String>,
    histograms: flume::Receiver<(String, u64, Vec<f32>)>,
}

impl Board {
    /// The log of `cfg`'s run (none without `log_dir`), and the tap replica 0's stages
    /// send histogram values to (none without `histogram_names`).
    ///
    /// # Errors
    /// `Config` naming a histogram name that is not a trainable parameter; `Io` when the
    /// folder or file cannot be made.
    pub fn open(
        cfg: &TrainConfig,
        config_path: &std::path::Path,
        params: &[String],
    ) -> Result<Option<(Board, Option<HistogramTap>)>> {
        let Some(dir) = &cfg.log_dir else {
            return Ok(None);
        };
        for (i, name) in cfg.histogram_names.iter().enumerate() {
            if !params.contains(name) {
                return Err(Error::Config {
                    path: config_path.to_path_buf(),
                    field: format!("histogram_names[{i}]"),
                    rule: format!("`{name}` is not a trainable parameter of the model"),
                });
            }
        }
        let (tx, histograms) = flume::unbounded();
        let tap = (!cfg.histogram_names.is_empty()).then(|| HistogramTap {
            names: cfg.histogram_names.clone(),
            tx,
        });
        let scalars = match &cfg.scalar_names {
            Some(names) => names.clone(),
            None => SCALAR_NAMES.iter().map(|s| s.to_string()).collect(),
        };
        let board = Board {
            writer: TensorBoardWriter::create(dir)?,
            scalars,
            histograms,
        };
        Ok(Some((board, tap)))
    }

    /// Writes a step's scalars (1-based steps, as the progress output and metrics) and the
    /// histograms that arrived, then flushes, so TensorBoard follows the run.
    ///
    /// # Errors
    /// `Io` naming the event file.
    pub fn step(&mut self, r: &StepReport) -> Result<()> {
        let step = r.step + 1;
        for name in &self.scalars {
            let value = match name.as_str() {
                "loss" => Some(r.loss),
                "lr" => Some(r.lr),
                "grad_norm" => Some(r.grad_norm),
                "clip_coef" => r.clip_coef,
                "loss_scale" => Some(r.loss_scale),
                "samples_per_s" => Some(r.samples_per_s),
                "eval_loss" => r.eval_loss,
                "eval_accuracy" => r.eval_accuracy,
                _ => None,
            };
            if let Some(v) = value {
                self.writer.scalar(name, step, v)?;
            }
        }
        for (tag, s, values) in self.histograms.drain() {
            self.writer.histogram(&tag, s + 1, &values)?;
        }
        self.writer.flush()
    }
}
