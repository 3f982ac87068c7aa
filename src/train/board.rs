//! A run's TensorBoard log (`log_dir`): the chosen scalars of every step, and histograms
//! of the parameters (and their gradients) named in `histogram_names`, which replica 0's
//! stages copy out as they update. A parameter split across tensor shards is put
//! together from every shard's part (where the shards run in this process) before its
//! histogram is written.

use std::collections::{BTreeMap, HashMap};

use crate::config::{TrainConfig, SCALAR_NAMES};
use crate::graph::tensor_parallel::ShardSpec;
use crate::pipeline::{HistogramTap, Tapped};
use crate::telemetry::TensorBoardWriter;
use crate::{Error, Result};

use super::StepReport;

/// The open log of a run.
pub(super) struct Board {
    writer: TensorBoardWriter,
    scalars: Vec<String>,
    histograms: flume::Receiver<Tapped>,
    /// The split parameters whose shards' parts are put together: how each is split,
    /// and its whole shape (empty where only shard 0 sends).
    split: BTreeMap<String, (ShardSpec, Vec<usize>)>,
    /// Parts of split tensors waiting for the other shards', by tag and step.
    parts: HashMap<(String, u64), Vec<Option<Vec<f32>>>>,
    /// The shards that send.
    shards: usize,
}

impl Board {
    /// The log of `cfg`'s run (none without `log_dir`), and the tap replica 0's stages
    /// send histogram values to (none without `histogram_names`). `split`: the split
    /// parameters, where every shard of replica 0 runs in this process.
    ///
    /// # Errors
    /// `Config` naming a histogram name that is not a trainable parameter; `Io` when the
    /// folder or file cannot be made.
    pub fn open(
        cfg: &TrainConfig,
        config_path: &std::path::Path,
        params: &[String],
        split: Option<&BTreeMap<String, (ShardSpec, Vec<usize>)>>,
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
        let shards = match split {
            Some(_) => cfg.horizontal_parallel_size.max(1),
            None => 1,
        };
        let tap = (!cfg.histogram_names.is_empty()).then(|| HistogramTap {
            names: cfg.histogram_names.clone(),
            shards,
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
            split: split.cloned().unwrap_or_default(),
            parts: HashMap::new(),
            shards,
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
                "peak_memory_gb" => r.peak_memory.map(|b| b as f64 / 1e9),
                _ => None,
            };
            if let Some(v) = value {
                self.writer.scalar(name, step, v)?;
            }
        }
        let arrived: Vec<Tapped> = self.histograms.drain().collect();
        for t in arrived {
            if let Some((tag, step, values)) = self.whole(t) {
                self.writer.histogram(&tag, step + 1, &values)?;
            }
        }
        self.writer.flush()
    }

    /// The whole tensor `t` is of, once every shard's part has arrived (a tensor not
    /// split comes whole from shard 0; the other shards' copies of it are left out).
    fn whole(&mut self, t: Tapped) -> Option<(String, u64, Vec<f32>)> {
        let name = t.tag.split_once('/').map_or("", |(_, n)| n);
        let Some((spec, full)) = self.split.get(name) else {
            return (t.shard == 0).then_some((t.tag, t.step, t.values));
        };
        let key = (t.tag, t.step);
        let parts = self
            .parts
            .entry(key.clone())
            .or_insert_with(|| vec![None; self.shards]);
        *parts.get_mut(t.shard)? = Some(t.values);
        if parts.iter().any(Option::is_none) {
            return None;
        }
        let parts = self.parts.remove(&key)?;
        let mut values = vec![0.0; full.iter().product()];
        for (rank, part) in parts.iter().enumerate() {
            spec.place(part.as_deref()?, full, rank, &mut values);
        }
        Some((key.0, key.1, values))
    }
}
