//! The training configuration (TOML), validated once, up front.
//!
//! Field names follow ONNX Runtime's `TrainingRunner::Parameters` where one applies
//! (`model_path`, `batch_size`, `num_train_steps`, `gradient_accumulation_steps`,
//! `display_loss_steps`, `data_parallel_size`, ...), with its meanings: `batch_size` is the
//! samples of one micro-batch, and `num_train_steps` counts forward/backward passes of a
//! replica, so a run makes `num_train_steps / gradient_accumulation_steps` optimizer steps
//! of `batch_size x gradient_accumulation_steps x data_parallel_size` samples each.
//! Relative paths are relative to the configuration file's folder.

use std::path::{Path, PathBuf};

use pipetrain_actors::{DynamicScaling, GradPolicy, LossScaling};
use pipetrain_schedules::ScheduleSpec;
use serde::Deserialize;

use crate::data::ShardSpec;
use crate::graph::{BalanceBy, LossSpec, Partition, Recompute};
use crate::models::ModelSpec;
use crate::optim::{LrSchedule, OptimizerConfig};
use crate::{Error, Result};

mod field;
mod run_state;
mod sections;
mod validate;
use field::field_at;
pub use run_state::{DebugConfig, DynamicScalerConfig, FaultAt};
pub use sections::{
    AllReduce, DataConfig, DataLayout, PipelineConfig, RuntimeConfig, ScheduleKind,
};

/// A training run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The forward ONNX model (or `[model]`, a built-in one).
    #[serde(default)]
    pub model_path: PathBuf,
    /// A built-in model (`kind = "gpt2" | "squeezenet" | "mlp"` with its sizes) instead
    /// of a file: generated with its initial weights when the run starts.
    #[serde(default)]
    pub model: Option<ModelSpec>,
    /// Initial weights (safetensors) replacing the model's initializers of the same name.
    #[serde(default)]
    pub init_path: Option<PathBuf>,
    /// Where the trained inference model is written.
    #[serde(default)]
    pub output_path: Option<PathBuf>,
    /// Also write the forward model with the loss attached here (ORT's name).
    #[serde(default)]
    pub model_with_loss_func_path: Option<PathBuf>,
    /// Also write the whole training graph (forward, loss, backward) here (ORT's name).
    #[serde(default)]
    pub model_with_training_graph_path: Option<PathBuf>,
    /// Samples per micro-batch (per replica).
    pub batch_size: usize,
    /// Forward/backward passes per replica over the whole run.
    pub num_train_steps: usize,
    /// Micro-batches per optimizer step and replica (pipeline micro-batches).
    #[serde(default = "one")]
    pub gradient_accumulation_steps: usize,
    /// Log the loss every this many optimizer steps.
    #[serde(default = "ten")]
    pub display_loss_steps: usize,
    /// Data-parallel replicas.
    #[serde(default = "one")]
    pub data_parallel_size: usize,
    /// Pipeline ranks.
    #[serde(default = "one")]
    pub pipeline_parallel_size: usize,
    /// Tensor-parallel size (ORT's `horizontal_parallel_size`); only 1 is supported.
    #[serde(default = "one")]
    pub horizontal_parallel_size: usize,
    /// Processes x devices of the job, when launched on a cluster; must equal
    /// data x horizontal x pipeline parallel sizes.
    #[serde(default)]
    pub world_size: Option<usize>,
    /// With data parallelism, a stage's gradients are reduced across replicas in
    /// buckets of about this many MiB, each starting while the rest of the step's last
    /// backward still runs (as PyTorch DDP's `bucket_cap_mb`); 0: one reduction of all
    /// a stage's gradients after its backward.
    #[serde(default = "bucket_mb")]
    pub gradient_bucket_mb: f64,
    /// The loss.
    pub loss: LossSpec,
    /// Embedding rows that get no gradient from their lookups (`[params]`: PyTorch's
    /// padding rows, found by default, and rows listed by table).
    #[serde(default)]
    pub params: crate::graph::ParamOptions,
    /// Training data.
    pub data: DataConfig,
    /// Values of model inputs the data does not feed, by input name (an exporter's
    /// `onnx::Neg_1` from a `forward` argument left at its default, a flag): each
    /// becomes a constant of the training graph.
    #[serde(default)]
    pub inputs: std::collections::BTreeMap<String, crate::graph::InputValue>,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Combine the replicas' gradients by Adasum instead of summing them (ONNX Runtime's
    /// `enable_adasum`); needs a power-of-two `data_parallel_size`.
    #[serde(default)]
    pub enable_adasum: bool,
    /// Shard the optimizer state across the data-parallel replicas (ZeRO stage 1, as
    /// ONNX Runtime's TrainingRunner's `deepspeed_zero` stage): each replica keeps and
    /// updates the state of its part of every stage, and the updated parameters are
    /// all-gathered; the same bits as unsharded, the optimizer's memory / replicas.
    /// 2: the gradients too, reduce-scattered in buckets as each micro-batch's backward
    /// makes them (float32 rounding of stage 1), their memory / replicas.
    /// 0 (default): every replica keeps all of it. Stage 3 is not built.
    #[serde(default)]
    pub deepspeed_zero_stage: u8,
    /// Parameter groups with their own weight decay, learning-rate scale, betas or eps
    /// (`[[optimizer_attributes]]`, as ONNX Runtime's per-weight optimizer attributes).
    #[serde(default)]
    pub optimizer_attributes: Vec<crate::optim::ParamGroup>,
    /// The learning rate and its schedule.
    pub lr_schedule: LrSchedule,
    /// Pipeline schedule and partition.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// ONNX Runtime settings.
    #[serde(default)]
    pub runtime: RuntimeConfig,
    /// What training-mode dropouts draw their masks from, with the step, the replica and
    /// the micro-batch (`graph::keyed_dropout`; ONNX Runtime's TrainingRunner's `seed`).
    #[serde(default)]
    pub seed: u64,
    /// Evaluate every this many optimizer steps (ORT's `evaluation_period`); none: never.
    #[serde(default)]
    pub evaluation_period: Option<usize>,
    /// Evaluation micro-batches per replica, of `batch_size` samples each.
    #[serde(default = "one")]
    pub eval_micro_batches: usize,
    /// The evaluation data; default: the training data file's first rows (no batch order).
    #[serde(default)]
    pub eval_data: Option<DataConfig>,
    /// Fail the run when no stage makes progress for this many seconds.
    #[serde(default = "watchdog")]
    pub watchdog_seconds: f64,
    /// Where checkpoints are written (ORT's `checkpoints_dir`), one folder each.
    #[serde(default)]
    pub checkpoints_dir: Option<PathBuf>,
    /// Save a checkpoint after every this many optimizer steps, and after the last one
    /// (ORT's `checkpoint_period`); needs `checkpoints_dir`.
    #[serde(default)]
    pub checkpoint_period: Option<usize>,
    /// Keep only the newest this many checkpoints; older ones are deleted once a newer
    /// one is complete (ORT's `max_num_checkpoints`). Default: keep all.
    #[serde(default)]
    pub max_num_checkpoints: Option<usize>,
    /// Resume from this checkpoint folder (ORT's `checkpoint_to_load_path`).
    #[serde(default)]
    pub checkpoint_to_load_path: Option<PathBuf>,
    /// Clip the global L2 norm of the gradients to this (`torch.nn.utils.clip_grad_norm_`).
    #[serde(default)]
    pub max_grad_norm: Option<f64>,
    /// Matrix products in half precision, the rest and the parameters in float32
    /// (ORT's `use_mixed_precision`; see `graph::autocast`).
    #[serde(default)]
    pub use_mixed_precision: bool,
    /// With `use_mixed_precision`: bfloat16 rather than float16 (ORT's `use_bfloat16`).
    #[serde(default)]
    pub use_bfloat16: bool,
    /// Activation recompute: `"none"` keeps every forward value the backward reads per
    /// in-flight micro-batch; `"stage"` keeps only what a stage received, and its
    /// backward runs the stage's forward again.
    #[serde(default)]
    pub recompute: Recompute,
    /// Loss scale (ORT's `loss_scale`): a static factor, or 0 for dynamic scaling with
    /// ONNX Runtime's `DynamicLossScaler` semantics (see `loss_scaler`). Default: 0 with
    /// float16 mixed precision (as ORT's mixed-precision runs), else 1 (none); see
    /// [`TrainConfig::loss_scale`].
    #[serde(default)]
    pub loss_scale: Option<f64>,
    /// The dynamic loss scaler's settings, for `loss_scale = 0`.
    #[serde(default)]
    pub loss_scaler: DynamicScalerConfig,
    /// TensorBoard event files go here (ORT's `log_dir`): scalars every step, histograms
    /// of `histogram_names`.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    /// Which scalars to write (ORT's `scalar_names`); default all of
    /// [`SCALAR_NAMES`].
    #[serde(default)]
    pub scalar_names: Option<Vec<String>>,
    /// Parameters whose values and gradients get a histogram every step (ORT's
    /// `histogram_names`).
    #[serde(default)]
    pub histogram_names: Vec<String>,
    /// Test aids: faults to inject, slower checkpoint writes.
    #[serde(default)]
    pub debug: DebugConfig,
}

/// The scalars a run can write to TensorBoard.
pub const SCALAR_NAMES: [&str; 9] = [
    "loss",
    "lr",
    "grad_norm",
    "clip_coef",
    "loss_scale",
    "samples_per_s",
    "eval_loss",
    "eval_accuracy",
    "peak_memory_gb",
];

fn one() -> usize {
    1
}

fn ten() -> usize {
    10
}

fn bucket_mb() -> f64 {
    25.0
}

fn watchdog() -> f64 {
    300.0
}

impl TrainConfig {
    /// Reads, resolves relative paths against the file's folder, and validates.
    ///
    /// # Errors
    /// `Io` when unreadable; `Config` naming the field and the rule otherwise.
    pub fn load(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
        TrainConfig::parse(&text, path)
    }

    /// Parses TOML text; `path` names the file in errors and anchors relative paths.
    ///
    /// # Errors
    /// `Config` naming the field and the rule.
    pub fn parse(text: &str, path: &Path) -> Result<TrainConfig> {
        let mut cfg: TrainConfig = toml::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            field: field_at(text, &e),
            rule: e.message().to_string(),
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let resolve = |p: &mut PathBuf| {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = dir.join(&*p);
            }
        };
        resolve(&mut cfg.model_path);
        resolve(&mut cfg.data.path);
        if let Some(e) = cfg.eval_data.as_mut() {
            resolve(&mut e.path);
        }
        for d in std::iter::once(&mut cfg.data).chain(cfg.eval_data.as_mut()) {
            if let Some(spec) = d.shards.as_mut() {
                resolve(&mut spec.train_data_dir);
                spec.test_data_dir.as_mut().map(resolve);
            }
        }
        cfg.init_path.as_mut().map(resolve);
        cfg.output_path.as_mut().map(resolve);
        cfg.model_with_loss_func_path.as_mut().map(resolve);
        cfg.model_with_training_graph_path.as_mut().map(resolve);
        cfg.checkpoints_dir.as_mut().map(resolve);
        cfg.log_dir.as_mut().map(resolve);
        cfg.checkpoint_to_load_path.as_mut().map(resolve);
        cfg.pipeline.profile.as_mut().map(resolve);
        cfg.read_node_times(path)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Checks the rules [`TrainConfig::load`] checks (for a configuration built or edited
    /// in code); errors name `path`.
    ///
    /// # Errors
    /// `Config` naming the field and the rule.
    pub fn check(&self, path: &Path) -> Result<()> {
        self.validate(path)
    }

    /// Optimizer steps in the run.
    pub fn optimizer_steps(&self) -> usize {
        self.num_train_steps / self.gradient_accumulation_steps
    }

    /// Samples per optimizer step over all replicas.
    pub fn global_batch(&self) -> usize {
        self.batch_size * self.gradient_accumulation_steps * self.data_parallel_size
    }

    /// Pipeline stages (ranks x virtual stages).
    pub fn stages(&self) -> usize {
        self.pipeline
            .schedule
            .stages(self.pipeline_parallel_size, self.pipeline.virtual_stages)
    }

    /// How [`TrainConfig::stages`] follows from the settings, for error messages.
    fn stages_rule(&self) -> &'static str {
        match self.pipeline.schedule.v_shaped() {
            true => "2 x pipeline_parallel_size (a V-shaped schedule)",
            false => "pipeline_parallel_size x virtual_stages",
        }
    }

    /// `partition = { balanced = { by = "time" } }` made a [`Partition::Weighted`] with the
    /// times `pipeline.profile` holds.
    fn read_node_times(&mut self, path: &Path) -> Result<()> {
        let Some(Partition::Balanced {
            stages,
            by: BalanceBy::Time,
        }) = self.pipeline.partition
        else {
            return Ok(());
        };
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            rule,
        };
        let Some(file) = &self.pipeline.profile else {
            return Err(bad(
                "pipeline.profile",
                "balancing by time reads the nodes' times from a profile: write one with \
                 `pipetrain plan CONFIG --save-profile FILE` and name it here"
                    .into(),
            ));
        };
        let text = std::fs::read(file).map_err(Error::io(file))?;
        let read: crate::graph::NodeTimes = serde_json::from_slice(&text).map_err(|e| {
            bad(
                "pipeline.profile",
                format!("{}: not a profile: {e}", file.display()),
            )
        })?;
        if read.micro_batch != self.batch_size {
            tracing::warn!(
                "{}: times measured at micro-batches of {}, this run's are {}",
                file.display(),
                read.micro_batch,
                self.batch_size
            );
        }
        self.pipeline.partition = Some(Partition::Weighted {
            stages,
            times: read.times,
        });
        Ok(())
    }

    /// The partition into [`TrainConfig::stages`] stages.
    pub fn partition(&self) -> Partition {
        self.pipeline
            .partition
            .clone()
            .unwrap_or(Partition::Balanced {
                stages: self.stages(),
                by: BalanceBy::Flops,
            })
    }

    /// The schedule's specification.
    pub fn schedule(&self) -> ScheduleSpec {
        self.pipeline.schedule.spec(
            self.pipeline_parallel_size,
            self.pipeline.virtual_stages,
            self.gradient_accumulation_steps,
        )
    }

    /// The forward model: the file at `model_path`, or the built-in `[model]` generated.
    ///
    /// # Errors
    /// `Io` / `NotOnnx` for the file; `Config` for a built-in model's sizes.
    pub fn load_model(&self) -> Result<crate::onnx::proto::ModelProto> {
        match &self.model {
            Some(spec) => crate::models::build(spec),
            None => crate::onnx::load_model(&self.model_path),
        }
    }

    /// What names the model in messages: its file, or the built-in model's kind.
    pub fn model_name(&self) -> String {
        match &self.model {
            Some(spec) => format!("built-in {}", spec.kind()),
            None => self.model_path.display().to_string(),
        }
    }

    /// The evaluation data: `eval_data`, else the training file read from its first rows.
    /// With training shards, their `test_data_dir` (else the training shards) in order,
    /// split by samples.
    pub fn eval_data(&self) -> DataConfig {
        self.eval_data.clone().unwrap_or_else(|| DataConfig {
            batch_order: None,
            shards: self.data.shards.as_ref().map(|s| ShardSpec {
                train_data_dir: s.test_data_dir.clone().unwrap_or(s.train_data_dir.clone()),
                shuffle_seed: None,
                split: crate::data::shards::ShardSplit::Samples,
                ..s.clone()
            }),
            ..self.data.clone()
        })
    }

    /// The half type of the matrix products, `None` without mixed precision.
    pub fn half(&self) -> Option<crate::graph::autocast::Half> {
        use crate::graph::autocast::Half;
        self.use_mixed_precision.then_some(match self.use_bfloat16 {
            true => Half::BF16,
            false => Half::F16,
        })
    }

    /// The loss scale: as given, or 0 (dynamic) with float16 mixed precision, whose
    /// small gradients would otherwise underflow, or 1 (none).
    pub fn loss_scale(&self) -> f64 {
        let float16 = self.half() == Some(crate::graph::autocast::Half::F16);
        self.loss_scale.unwrap_or(if float16 { 0.0 } else { 1.0 })
    }

    /// How the coordinator clips and scales.
    pub fn grad_policy(&self) -> GradPolicy {
        let d = self.loss_scaler;
        GradPolicy {
            max_norm: self.max_grad_norm,
            scaling: if self.loss_scale() == 0.0 {
                LossScaling::Dynamic(DynamicScaling {
                    initial: d.initial,
                    window: d.window,
                    min: d.min,
                    max: d.max,
                })
            } else {
                LossScaling::Static(self.loss_scale())
            },
        }
    }

    /// Whether each data-parallel replica keeps the optimizer state of its part of
    /// every stage only (`deepspeed_zero_stage` 1 or 2 with replicas to share it).
    pub fn shards_optimizer_state(&self) -> bool {
        self.deepspeed_zero_stage >= 1 && self.data_parallel_size > 1
    }

    /// Whether each data-parallel replica keeps the gradients of its part of every
    /// stage only (`deepspeed_zero_stage = 2` with replicas to share them).
    pub fn shards_gradients(&self) -> bool {
        self.deepspeed_zero_stage == 2 && self.data_parallel_size > 1
    }

    /// Whether stages run their backward as input-gradient and weight-gradient halves.
    pub fn split_backward(&self) -> bool {
        self.pipeline.schedule.splits_backward()
    }
}
