//! The training configuration (TOML), validated once, up front.
//!
//! Field names follow ONNX Runtime's `TrainingRunner::Parameters` where one applies
//! (`model_path`, `batch_size`, `num_train_steps`, `gradient_accumulation_steps`,
//! `display_loss_steps`, `data_parallel_size`, ...), with its meanings: `batch_size` is the
//! samples of one micro-batch, and `num_train_steps` counts forward/backward passes of a
//! replica, so a run makes `num_train_steps / gradient_accumulation_steps` optimizer steps
//! of `batch_size x gradient_accumulation_steps x data_parallel_size` samples each.
//! Relative paths are relative to the configuration file's folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pipetrain_actors::{DynamicScaling, GradPolicy, LossScaling};
use pipetrain_schedules::ScheduleSpec;
use serde::{Deserialize, Serialize};

use crate::data::{ShardSpec, SynthSpec};
use crate::graph::{BalanceBy, LossSpec, Partition, Recompute};
use crate::models::ModelSpec;
use crate::optim::{LrSchedule, OptimizerConfig};
use crate::{Error, Result};

mod field;
mod run_state;
use field::field_at;
pub use run_state::{DebugConfig, DynamicScalerConfig, FaultAt};

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
    /// Training data.
    pub data: DataConfig,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// The learning rate and its schedule.
    pub lr_schedule: LrSchedule,
    /// Pipeline schedule and partition.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// ONNX Runtime settings.
    #[serde(default)]
    pub runtime: RuntimeConfig,
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
    /// Activation recompute: `"none"` keeps every forward value the backward reads per
    /// in-flight micro-batch; `"stage"` keeps only what a stage received, and its
    /// backward runs the stage's forward again.
    #[serde(default)]
    pub recompute: Recompute,
    /// Loss scale (ORT's `loss_scale`): a static factor, or 0 for dynamic scaling with
    /// ONNX Runtime's `DynamicLossScaler` semantics (see `loss_scaler`). Default 1: none.
    #[serde(default = "one_f64")]
    pub loss_scale: f64,
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
pub const SCALAR_NAMES: [&str; 8] = [
    "loss",
    "lr",
    "grad_norm",
    "clip_coef",
    "loss_scale",
    "samples_per_s",
    "eval_loss",
    "eval_accuracy",
];

fn one_f64() -> f64 {
    1.0
}

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

/// Where batches come from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// An `.npz` archive (or `synth`).
    #[serde(default)]
    pub path: PathBuf,
    /// A synthetic data set made by pipetrain (`kind = "language" | "images" |
    /// "teacher"`) instead of a file.
    #[serde(default)]
    pub synth: Option<SynthSpec>,
    /// An integer array `[steps, global batch]` of row indices: optimizer step `s` uses
    /// rows `batch_order[s]`. Without it, steps take consecutive rows.
    #[serde(default)]
    pub batch_order: Option<String>,
    /// How the arrays feed the model (not used with `shards`).
    #[serde(default)]
    pub layout: DataLayout,
    /// ONNX Runtime `.pb` shard folders instead of a file (`[data.shards]`).
    #[serde(default)]
    pub shards: Option<ShardSpec>,
}

/// How arrays of the data file become model inputs. The default, no feeds, stands for
/// "not given": data fed by a service, or `shards`; [`crate::data::Batches::open`] refuses
/// it for a file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DataLayout {
    /// Each model input (and the label) is the array of the given name.
    Arrays {
        /// Model input or label name -> array name.
        feeds: BTreeMap<String, String>,
    },
    /// Language modelling: `array` rows of `T + 1` tokens give the input `row[..T]` and
    /// the label `row[1..]`.
    NextToken {
        /// The token array.
        array: String,
        /// The model's token input.
        input: String,
        /// The label name (as in the loss).
        label: String,
    },
}

impl Default for DataLayout {
    fn default() -> DataLayout {
        DataLayout::Arrays {
            feeds: BTreeMap::new(),
        }
    }
}

impl DataLayout {
    /// Whether this is the default (no feeds): the layout was not given.
    pub fn is_unset(&self) -> bool {
        matches!(self, DataLayout::Arrays { feeds } if feeds.is_empty())
    }
}

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (PipeDream-flush).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` stages per rank.
    #[serde(rename = "interleaved_1f1b")]
    Interleaved1f1b,
    /// Zero-bubble ZB-H1: backward split into input and weight gradients.
    ZbH1,
    /// Zero-bubble ZB-V: two stages per rank folded into a V (rank `r` holds stages `r`
    /// and `2p - 1 - r`), backward split as ZB-H1's.
    ZbV,
}

/// Pipeline schedule and partition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// The schedule.
    #[serde(default)]
    pub schedule: ScheduleKind,
    /// Stages per rank (interleaved schedules).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// How to cut the model; default: balanced by FLOPs.
    #[serde(default)]
    pub partition: Option<Partition>,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: ScheduleKind::default(),
            virtual_stages: 1,
            partition: None,
        }
    }
}

/// ONNX Runtime settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Threads per operator; default: the machine's cores shared among the stage actors.
    #[serde(default)]
    pub intra_op_threads: Option<usize>,
    /// Switch off ONNX Runtime's graph optimizations.
    #[serde(default)]
    pub disable_optimizations: bool,
    /// Keep backward graphs to standard ONNX ops (no `com.microsoft.FusedMatMul`).
    #[serde(default)]
    pub standard_ops_only: bool,
    /// Where to compute: `"cpu"` (default), `"cuda"` or `"cuda:N"`.
    #[serde(default)]
    pub device: crate::compute::Device,
    /// Record ONNX Runtime's per-operator profile of every session: a JSON file per
    /// session in the working folder (`pipetrain_<session>_<time>.json`, ONNX Runtime's
    /// `enable_profiling`), written when the run ends.
    #[serde(default)]
    pub profile: bool,
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
        cfg.validate(path)?;
        Ok(cfg)
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
        match self.pipeline.schedule {
            ScheduleKind::ZbV => 2 * self.pipeline_parallel_size,
            _ => self.pipeline_parallel_size * self.pipeline.virtual_stages,
        }
    }

    /// How [`TrainConfig::stages`] follows from the settings, for error messages.
    fn stages_rule(&self) -> &'static str {
        match self.pipeline.schedule {
            ScheduleKind::ZbV => "2 x pipeline_parallel_size (zb_v)",
            _ => "pipeline_parallel_size x virtual_stages",
        }
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
        let (p, m) = (
            self.pipeline_parallel_size,
            self.gradient_accumulation_steps,
        );
        match self.pipeline.schedule {
            ScheduleKind::Gpipe => ScheduleSpec::GPipe {
                stages: p,
                micro_batches: m,
            },
            ScheduleKind::OneFOneB => ScheduleSpec::OneFOneB {
                stages: p,
                micro_batches: m,
            },
            ScheduleKind::Interleaved1f1b => ScheduleSpec::Interleaved1F1B {
                ranks: p,
                virtual_stages: self.pipeline.virtual_stages,
                micro_batches: m,
            },
            ScheduleKind::ZbH1 => ScheduleSpec::ZbH1 {
                stages: p,
                micro_batches: m,
            },
            ScheduleKind::ZbV => ScheduleSpec::ZbV {
                ranks: p,
                micro_batches: m,
            },
        }
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

    /// How the coordinator clips and scales.
    pub fn grad_policy(&self) -> GradPolicy {
        let d = self.loss_scaler;
        GradPolicy {
            max_norm: self.max_grad_norm,
            scaling: if self.loss_scale == 0.0 {
                LossScaling::Dynamic(DynamicScaling {
                    initial: d.initial,
                    window: d.window,
                    min: d.min,
                    max: d.max,
                })
            } else {
                LossScaling::Static(self.loss_scale)
            },
        }
    }

    /// Whether stages run their backward as input-gradient and weight-gradient halves.
    pub fn split_backward(&self) -> bool {
        matches!(
            self.pipeline.schedule,
            ScheduleKind::ZbH1 | ScheduleKind::ZbV
        )
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            rule,
        };
        match (&self.model, self.model_path.as_os_str().is_empty()) {
            (Some(_), false) => {
                return Err(bad(
                    "model",
                    "give either `model_path` (a file) or `[model]` (a built-in model), not both"
                        .into(),
                ))
            }
            (None, true) => {
                return Err(bad(
                    "model_path",
                    "missing: give the model file, or a built-in `[model]` (kind = \"gpt2\", \"squeezenet\" or \"mlp\")"
                        .into(),
                ))
            }
            (Some(spec), true) => spec.validate(path)?,
            (None, false) => {}
        }
        for (field, d) in [
            ("data", Some(&self.data)),
            ("eval_data", self.eval_data.as_ref()),
        ] {
            let Some(d) = d else { continue };
            if d.shards.is_some() {
                let given = [
                    ("path", !d.path.as_os_str().is_empty()),
                    ("synth", d.synth.is_some()),
                    ("batch_order", d.batch_order.is_some()),
                    ("layout", !d.layout.is_unset()),
                ];
                if let Some((name, _)) = given.iter().find(|(_, g)| *g) {
                    return Err(bad(
                        &format!("{field}.{name}"),
                        "does not apply to `shards` (their `input_name_map` feeds the model)"
                            .into(),
                    ));
                }
                continue;
            }
            match (&d.synth, d.path.as_os_str().is_empty()) {
                (Some(_), false) => return Err(bad(
                    field,
                    "give either `path` (an .npz file) or `synth` (a synthetic data set), not both"
                        .into(),
                )),
                (None, true) => {
                    return Err(bad(
                        &format!("{field}.path"),
                        "missing: give an .npz file, or `synth = { kind = ... }`".into(),
                    ))
                }
                (Some(spec), true) => spec.validate(path)?,
                (None, false) => {}
            }
        }
        let positive = [
            ("batch_size", self.batch_size),
            ("num_train_steps", self.num_train_steps),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("display_loss_steps", self.display_loss_steps),
            ("data_parallel_size", self.data_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
            ("horizontal_parallel_size", self.horizontal_parallel_size),
            ("pipeline.virtual_stages", self.pipeline.virtual_stages),
            ("eval_micro_batches", self.eval_micro_batches),
            ("evaluation_period", self.evaluation_period.unwrap_or(1)),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(bad(field, "must be at least 1".into()));
            }
        }
        if self.horizontal_parallel_size != 1 {
            return Err(bad(
                "horizontal_parallel_size",
                "tensor parallelism is not supported; use 1".into(),
            ));
        }
        let product =
            self.data_parallel_size * self.horizontal_parallel_size * self.pipeline_parallel_size;
        if let Some(world) = self.world_size.filter(|&w| w != product) {
            return Err(bad(
                "world_size",
                format!(
                    "must equal data_parallel_size x horizontal_parallel_size x pipeline_parallel_size = {product}, got {world}"
                ),
            ));
        }
        if self.num_train_steps % self.gradient_accumulation_steps != 0 {
            return Err(bad(
                "num_train_steps",
                format!(
                    "must be divisible by gradient_accumulation_steps ({}), got {}",
                    self.gradient_accumulation_steps, self.num_train_steps
                ),
            ));
        }
        let (p, m) = (
            self.pipeline_parallel_size,
            self.gradient_accumulation_steps,
        );
        let needs_full_pipe = matches!(
            self.pipeline.schedule,
            ScheduleKind::OneFOneB | ScheduleKind::ZbH1
        );
        if needs_full_pipe && m < p {
            return Err(bad(
                "gradient_accumulation_steps",
                format!(
                    "{:?} needs at least as many micro-batches as pipeline stages ({p}), got {m}",
                    self.pipeline.schedule
                ),
            ));
        }
        if self.pipeline.virtual_stages > 1
            && self.pipeline.schedule != ScheduleKind::Interleaved1f1b
        {
            return Err(bad(
                "pipeline.virtual_stages",
                "only the interleaved_1f1b schedule has virtual stages".into(),
            ));
        }
        if let Err(e) = self.schedule().generate() {
            return Err(bad("pipeline.schedule", e.to_string()));
        }
        if let Some(Partition::CutAt(cuts)) = &self.pipeline.partition {
            if cuts.len() + 1 != self.stages() {
                return Err(bad(
                    "pipeline.partition.cut_at",
                    format!(
                        "{} cuts make {} stages; the pipeline has {}",
                        cuts.len(),
                        cuts.len() + 1,
                        self.stages()
                    ),
                ));
            }
        }
        if let Some(Partition::Balanced { stages, .. }) = &self.pipeline.partition {
            if *stages != self.stages() {
                return Err(bad(
                    "pipeline.partition.balanced.stages",
                    format!(
                        "must equal {} = {}, got {stages}",
                        self.stages_rule(),
                        self.stages()
                    ),
                ));
            }
        }
        if !(self.watchdog_seconds.is_finite() && self.watchdog_seconds > 0.0) {
            return Err(bad(
                "watchdog_seconds",
                format!("must be a positive number, got {}", self.watchdog_seconds),
            ));
        }
        if !(self.gradient_bucket_mb.is_finite() && self.gradient_bucket_mb >= 0.0) {
            return Err(bad(
                "gradient_bucket_mb",
                format!(
                    "must be a number of MiB, 0 or more, got {}",
                    self.gradient_bucket_mb
                ),
            ));
        }
        if self.runtime.intra_op_threads == Some(0) {
            return Err(bad("runtime.intra_op_threads", "must be at least 1".into()));
        }
        self.validate_run_state(path)?;
        self.optimizer.validate(path)?;
        self.lr_schedule.validate(path)?;
        Ok(())
    }
}
