//! Per-step metrics as JSON Lines: one object per line, written whole and flushed, so that
//! `tail -f`, a notebook or a plotting script can follow a run while it trains.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::{Error, Result};

/// What one optimizer step did: one line of the metrics file.
///
/// Unknown fields are accepted when reading (no `deny_unknown_fields`), unlike configs: a
/// reader of an older version should still follow a newer run's file. Optional fields are
/// left out of the line when `None`.
///
/// JSON has no NaN or infinity, and `serde_json` writes them as `null`; a diverged loss is
/// exactly what a metrics file must record, so the required numbers read `null` back as
/// NaN (an infinite loss therefore reads back as NaN), and the optional ones as `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps completed, counting from 1.
    pub step: u64,
    /// Mean training loss over the step's micro-batches.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Learning rate used for the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    /// Training samples per second over the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    /// Tokens per second, for models whose inputs are token sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Seconds since training started, at the end of the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub elapsed_s: f64,
    /// Seconds the step itself took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_s: Option<f64>,
    /// Mean loss on the evaluation set after the step, when one was run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Accuracy on the evaluation set after the step (classification losses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Global L2 norm of the gradients, before any clipping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// The clip coefficient applied (`max_grad_norm`): `min(1, max / (norm + 1e-6))`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_coef: Option<f64>,
    /// The loss scale the step used, when the loss is scaled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The update was skipped: a gradient overflowed under dynamic loss scaling.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Training samples consumed by the end of the step (all replicas, from the run's
    /// start, across resumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    /// Idle share of the pipeline's ranks during the step, from its traced timeline
    /// ([`pipetrain_schedules::Timeline::bubble_fraction`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
    /// What happened to the job just before this step, in words: an elastic job that
    /// went on with fewer nodes says so on its first step after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// The peak resident memory of the process writing the file so far, GB (Linux's
    /// `VmHWM`; node 0's process in a launched job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_gb: Option<f64>,
}

/// Reads `null` as NaN: see [`StepMetrics`].
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Writes [`StepMetrics`] to a file, one JSON object per line.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    /// Unbuffered on purpose: each line goes out in one `write` as soon as it is complete,
    /// so readers never wait for a buffer to fill, and with [`MetricsWriter::append`]
    /// (`O_APPEND`) lines from a resumed run are never interleaved mid-line.
    file: File,
}

impl MetricsWriter {
    /// Creates (or truncates) the file at `path`, and its parent directories.
    ///
    /// # Errors
    /// [`Error::Io`] naming `path` when a directory or the file cannot be created.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), false)
    }

    /// Opens the file at `path` for appending, creating it (and its parent directories)
    /// when missing: a run resumed from a checkpoint continues its metrics file.
    ///
    /// # Errors
    /// [`Error::Io`] naming `path` when a directory or the file cannot be opened.
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), true)
    }

    fn open(path: &Path, append: bool) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(Error::io(path))?;
        Ok(MetricsWriter {
            path: path.to_owned(),
            file,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `m` as one line and flushes it.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when the line cannot be written.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        // Serialising a struct of numbers cannot fail in serde_json; the error is still
        // mapped rather than unwrapped, as library code does not panic.
        let mut line = serde_json::to_vec(m)
            .map_err(std::io::Error::other)
            .map_err(Error::io(&self.path))?;
        line.push(b'\n');
        self.file.write_all(&line).map_err(Error::io(&self.path))?;
        self.file.flush().map_err(Error::io(&self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_fields_are_left_out() {
        let m = StepMetrics {
            step: 3,
            loss: 2.5,
            lr: 0.1,
            samples_per_s: 100.0,
            elapsed_s: 1.5,
            ..StepMetrics::default()
        };
        let line = serde_json::to_string(&m).unwrap();
        assert_eq!(
            line,
            r#"{"step":3,"loss":2.5,"lr":0.1,"samples_per_s":100.0,"elapsed_s":1.5}"#
        );
        assert_eq!(serde_json::from_str::<StepMetrics>(&line).unwrap(), m);
    }

    #[test]
    fn nan_loss_reads_back_as_nan() {
        let m = StepMetrics {
            loss: f64::NAN,
            grad_norm: Some(f64::INFINITY),
            ..StepMetrics::default()
        };
        let line = serde_json::to_string(&m).unwrap();
        assert!(line.contains(r#""loss":null"#), "{line}");
        let back: StepMetrics = serde_json::from_str(&line).unwrap();
        assert!(back.loss.is_nan());
        assert_eq!(back.grad_norm, None);
    }

    #[test]
    fn unknown_fields_are_accepted() {
        let line = r#"{"step":1,"loss":1.0,"lr":0.1,"samples_per_s":1.0,"elapsed_s":1.0,"new":7}"#;
        assert_eq!(serde_json::from_str::<StepMetrics>(line).unwrap().step, 1);
    }
}
