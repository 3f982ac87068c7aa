//! The APIs of ONNX Runtime's training documents, in Rust.
//!
//! - [`TrainingRunner`] (seed 000, `TrainingRunner::Run`): a whole run from
//!   [`TrainingParameters`] with the runner's field names, on a training loader and an
//!   optional evaluation loader (none: no evaluation).
//! - The on-device loop of seed 002 (`CheckpointState` / `Module` / `Optimizer`):
//!   `module.train_step(batch)`, `optimizer.step(&mut module)`, `module.lazy_reset_grad()`,
//!   `module.eval_step(batch)`, a [`LinearLrScheduler`], and
//!   [`Module::export_model_for_inferencing`]. It runs the same stage compute as
//!   `pipetrain train` (one fused forward + backward session), so the same model, data and
//!   optimizer give bitwise the same weights.
//!
//! Where Rust's ownership differs from ORT's Python objects: ORT's `Optimizer` holds its
//! module; here [`Optimizer::step`] takes the module, and the optimizer's state lives with
//! the module's parameters.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pipetrain_actors::{GradPolicy, StageCompute};

use super::{TrainSummary, Trainer};
use crate::checkpoint::{self, LoadedCheckpoint, Manifest};
use crate::compute::{Runtime, SessionOptions};
use crate::config::TrainConfig;
use crate::data::BatchSource;
use crate::graph::{
    assign_stages, build_stage_graphs, build_training_graph, export_inference_model, BalanceBy,
    LossSpec, Partition, TrainOptions, LOSS,
};
use crate::onnx::proto::ModelProto;
use crate::onnx::{load_model, save_model};
use crate::optim::{LrDecay, LrSchedule, OptimizerConfig};
use crate::pipeline::{OrtStage, Payload, StageSettings};
use crate::tensor::{Tensor, TensorMap};
use crate::{Error, Result};

/// ONNX Runtime's `TrainingRunner::Parameters`, the fields that apply (seed 003's names).
#[derive(Debug, Clone)]
pub struct TrainingParameters {
    /// The forward ONNX model.
    pub model_path: PathBuf,
    /// The loss to attach (ORT's `loss_func_info`).
    pub loss: LossSpec,
    /// Where the trained inference model is written (`output_dir/model.onnx`).
    pub output_dir: Option<PathBuf>,
    /// Samples per micro-batch.
    pub batch_size: usize,
    /// Forward/backward passes (of one replica).
    pub num_train_steps: usize,
    /// The peak learning rate (ORT's `lr_params.initial_lr`).
    pub learning_rate: f64,
    /// Linear warmup share of the steps (ORT's `lr_params.warmup_ratio`).
    pub warmup_ratio: f64,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Log the loss every this many steps.
    pub display_loss_steps: usize,
    /// `"SGDOptimizer"` (ORT's default), `"Adam"` (AdamW, PyTorch semantics) or `"Lamb"`.
    pub training_optimizer_name: String,
    /// Data-parallel replicas.
    pub data_parallel_size: usize,
    /// Pipeline stages.
    pub pipeline_parallel_size: usize,
    /// Evaluate every this many optimizer steps (with an evaluation loader).
    pub evaluation_period: usize,
    /// Checkpoints: folder, period, how many to keep, one to resume from.
    pub checkpoints_dir: Option<PathBuf>,
    /// See `checkpoints_dir`.
    pub checkpoint_period: Option<usize>,
    /// See `checkpoints_dir`.
    pub max_num_checkpoints: Option<usize>,
    /// See `checkpoints_dir`.
    pub checkpoint_to_load_path: Option<PathBuf>,
    /// A static loss scale, or 0 for dynamic scaling.
    pub loss_scale: f64,
}

impl TrainingParameters {
    /// Parameters with ORT's defaults for everything but the model, loss and sizes.
    pub fn new(
        model_path: impl Into<PathBuf>,
        loss: LossSpec,
        batch_size: usize,
        num_train_steps: usize,
    ) -> Self {
        TrainingParameters {
            model_path: model_path.into(),
            loss,
            output_dir: None,
            batch_size,
            num_train_steps,
            learning_rate: 1e-3,
            warmup_ratio: 0.0,
            gradient_accumulation_steps: 1,
            display_loss_steps: 10,
            training_optimizer_name: "SGDOptimizer".into(),
            data_parallel_size: 1,
            pipeline_parallel_size: 1,
            evaluation_period: 10,
            checkpoints_dir: None,
            checkpoint_period: None,
            max_num_checkpoints: None,
            checkpoint_to_load_path: None,
            loss_scale: 1.0,
        }
    }

    /// The run's configuration (validated as a configuration file is).
    fn config(&self, with_eval: bool) -> Result<TrainConfig> {
        let optimizer = match self.training_optimizer_name.as_str() {
            "SGDOptimizer" => OptimizerConfig::Sgd {
                momentum: 0.0,
                dampening: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            },
            "Adam" | "AdamOptimizer" => OptimizerConfig::default(),
            "Lamb" | "LambOptimizer" => OptimizerConfig::Lamb {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            other => {
                return Err(Error::Config {
                    path: "<parameters>".into(),
                    field: "training_optimizer_name".into(),
                    rule: format!("one of SGDOptimizer, Adam, Lamb; got `{other}`"),
                })
            }
        };
        let mut text = format!(
            "model_path = {:?}\nbatch_size = {}\nnum_train_steps = {}\ngradient_accumulation_steps = {}\n\
             display_loss_steps = {}\ndata_parallel_size = {}\npipeline_parallel_size = {}\nloss_scale = {:?}\n",
            self.model_path,
            self.batch_size,
            self.num_train_steps,
            self.gradient_accumulation_steps,
            self.display_loss_steps,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.loss_scale,
        );
        if with_eval {
            text += &format!("evaluation_period = {}\n", self.evaluation_period);
        }
        if let Some(dir) = &self.output_dir {
            text += &format!("output_path = {:?}\n", dir.join("model.onnx"));
        }
        for (key, value) in [
            ("checkpoints_dir", &self.checkpoints_dir),
            ("checkpoint_to_load_path", &self.checkpoint_to_load_path),
        ] {
            if let Some(v) = value {
                text += &format!("{key} = {v:?}\n");
            }
        }
        for (key, value) in [
            ("checkpoint_period", self.checkpoint_period),
            ("max_num_checkpoints", self.max_num_checkpoints),
        ] {
            if let Some(v) = value {
                text += &format!("{key} = {v}\n");
            }
        }
        let decay = if self.warmup_ratio > 0.0 {
            "linear"
        } else {
            "constant"
        };
        // The loaders supply the data, so the data table names none; the loss and the
        // optimizer are set from the parameters below (the text only needs valid ones).
        text += &format!(
            "[data]\npath = \"<loader>\"\nlayout = {{ kind = \"arrays\", feeds = {{}} }}\n\
             [lr_schedule]\nkind = \"{decay}\"\nlr = {:?}\nwarmup_ratio = {:?}\n\
             [optimizer]\nkind = \"sgd\"\n[loss]\nkind = \"output\"\nname = \"loss\"\n",
            self.learning_rate, self.warmup_ratio
        );
        let path = Path::new("<parameters>");
        let mut cfg = TrainConfig::parse(&text, path)?;
        optimizer.validate(path)?;
        cfg.optimizer = optimizer;
        cfg.loss = self.loss.clone();
        Ok(cfg)
    }
}

/// ONNX Runtime's `TrainingRunner`: a whole run from [`TrainingParameters`].
pub struct TrainingRunner {
    params: TrainingParameters,
    rt: Runtime,
}

impl TrainingRunner {
    /// A runner for `params` on the process's ONNX Runtime.
    ///
    /// # Errors
    /// `RuntimeLibrary` when ONNX Runtime cannot be loaded.
    pub fn new(params: TrainingParameters) -> Result<TrainingRunner> {
        Ok(TrainingRunner {
            params,
            rt: Runtime::from_env()?,
        })
    }

    /// Trains on `train_loader`'s batches (the global batch of each optimizer step),
    /// evaluating on `eval_loader`'s step-0 batch every `evaluation_period` steps; with no
    /// evaluation loader, no evaluation (as seed 000 says).
    ///
    /// # Errors
    /// A parameter that breaks a rule (`Config` naming it), and anything a run can fail
    /// with.
    pub fn run(
        &mut self,
        train_loader: impl BatchSource,
        eval_loader: Option<Box<dyn BatchSource>>,
    ) -> Result<TrainSummary> {
        let cfg = self.params.config(eval_loader.is_some())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .map_err(Error::io("<tokio runtime>"))?;
        let mut trainer = Trainer::new(cfg).with_data(train_loader);
        if let Some(eval) = eval_loader {
            trainer.eval_data = Some(Arc::from(eval));
        }
        let rt = self.rt.clone();
        runtime.block_on(async move { trainer.start(&rt)?.wait().await })
    }
}

/// The state a [`Module`] and [`Optimizer`] start from: a pipetrain checkpoint
/// (parameters and optimizer state by name), initial weights from a safetensors file,
/// or the model's own initializers.
pub struct CheckpointState {
    loaded: Option<LoadedCheckpoint>,
    init: Option<(PathBuf, std::collections::HashMap<String, Tensor>)>,
}

impl CheckpointState {
    /// The model's own initializers (what ORT's artifacts' first checkpoint holds).
    pub fn initial() -> CheckpointState {
        CheckpointState {
            loaded: None,
            init: None,
        }
    }

    /// Initial weights from a safetensors file (as `init_path`), or the model's own when
    /// `None`.
    ///
    /// # Errors
    /// `Io` / `Data` naming the file.
    pub fn from_init(path: Option<&Path>) -> Result<CheckpointState> {
        let init = match path {
            Some(p) => Some((p.to_path_buf(), crate::data::read_safetensors(p)?)),
            None => None,
        };
        Ok(CheckpointState { loaded: None, init })
    }

    /// A checkpoint folder written by `pipetrain train` or [`CheckpointState::save`].
    ///
    /// # Errors
    /// `Checkpoint` naming what is missing or damaged.
    pub fn load(dir: &Path) -> Result<CheckpointState> {
        Ok(CheckpointState {
            loaded: Some(LoadedCheckpoint::open(dir)?),
            init: None,
        })
    }

    /// Writes the module's parameters and the optimizer's state to `dir` as a pipetrain
    /// checkpoint (a new folder: written beside, then renamed into place).
    ///
    /// # Errors
    /// `Io` naming a file that cannot be written.
    pub fn save(module: &Module, optimizer: &Optimizer, dir: &Path) -> Result<()> {
        let tmp = dir.with_extension("tmp-save");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(Error::io(&tmp))?;
        let (layout, params, opt) = module.stage.state();
        let job = checkpoint::save_job(0, &tmp, layout, params, opt, None, &Default::default())?;
        let shards = job().map_err(|e| Error::Checkpoint {
            path: tmp.clone(),
            reason: e.to_string(),
        })?;
        let manifest = module.manifest(optimizer, shards);
        manifest.write_synced(&tmp)?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(Error::io(dir))?;
        }
        std::fs::rename(&tmp, dir).map_err(Error::io(dir))
    }
}

/// The model to train on this device: ORT's `Module` (one stage, fused forward and
/// backward).
pub struct Module {
    stage: OrtStage,
    model: ModelProto,
    model_path: PathBuf,
    fingerprint: String,
    loss: LossSpec,
    training: bool,
    /// Optimizer state from the checkpoint, waiting for the optimizer.
    pending: Option<LoadedCheckpoint>,
    /// Optimizer steps taken.
    steps: u64,
}

impl Module {
    /// The model at `model_path` with `loss` attached, for batches shaped like `example`
    /// (each model input and the label, by name), starting from `state`.
    ///
    /// # Errors
    /// Graph building's errors; `Checkpoint` when `state` does not fit the model.
    pub fn new(
        rt: &Runtime,
        model_path: &Path,
        loss: LossSpec,
        example: &TensorMap,
        state: CheckpointState,
    ) -> Result<Module> {
        let mut model = load_model(model_path)?;
        let fingerprint = checkpoint::model_fingerprint(&model);
        if let Some((path, init)) = &state.init {
            crate::train::apply_init(&mut model, init, path)?;
        }
        let feeds: Vec<(&str, &Tensor)> = example.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let opts = TrainOptions {
            loss: loss.clone(),
            trainable: None,
            contrib_ops: true,
        };
        let tg = build_training_graph(rt, &model, &opts, &feeds)?;
        let one = Partition::Balanced {
            stages: 1,
            by: BalanceBy::Flops,
        };
        let graphs = build_stage_graphs(&tg, &assign_stages(&tg, &one)?)?;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        // What `pipetrain train` gives one stage alone: every core, spinning threads.
        let session = SessionOptions {
            intra_threads: cores,
            inter_threads: 1,
            optimize: true,
            spin: true,
            profile: false,
        };
        let settings = StageSettings::new(OptimizerConfig::default(), 1.0);
        let stage = OrtStage::new(rt, &tg, &graphs[0], &session, &settings)?;
        if let Some(ckpt) = &state.loaded {
            let shapes: Vec<(String, Vec<usize>)> = tg
                .params
                .iter()
                .map(|p| (p.name.clone(), p.meta.shape.clone()))
                .collect();
            ckpt.check_model(&shapes)?;
        }
        let steps = state.loaded.as_ref().map_or(0, |c| c.manifest.steps_done);
        Ok(Module {
            stage,
            model,
            model_path: model_path.to_path_buf(),
            fingerprint,
            loss,
            training: true,
            pending: state.loaded,
            steps,
        })
        .and_then(|mut m| {
            // Parameters come from the checkpoint now; the optimizer's state when the
            // optimizer is made.
            if let Some(ckpt) = &m.pending {
                m.stage.restore_params(ckpt)?;
            }
            Ok(m)
        })
    }

    /// Training mode (ORT's `module.train()`): [`Module::train_step`] computes gradients.
    pub fn train(&mut self) {
        self.training = true;
    }

    /// Evaluation mode (ORT's `module.eval()`): [`Module::eval_step`] runs the forward
    /// graph only.
    pub fn eval(&mut self) {
        self.training = false;
    }

    /// Forward and backward of `batch` (ORT's `TrainStep`): gradients accumulate until
    /// [`Module::lazy_reset_grad`]; the loss.
    ///
    /// # Errors
    /// `Config` in evaluation mode; ONNX Runtime's errors naming the input.
    pub async fn train_step(&mut self, batch: &TensorMap) -> Result<f64> {
        if !self.training {
            return Err(Error::Config {
                path: "<module>".into(),
                field: "mode".into(),
                rule: "train_step needs training mode (module.train())".into(),
            });
        }
        let data = payload(batch);
        let out = self
            .stage
            .forward(0, None, Some(data))
            .await
            .map_err(boxed)?;
        self.stage
            .backward(0, pipetrain_actors::BackwardPart::Full, None)
            .await
            .map_err(boxed)?;
        out.loss
            .ok_or_else(|| Error::graph("the module computed no loss"))
    }

    /// The loss of `batch` without gradients (ORT's `EvalStep`).
    ///
    /// # Errors
    /// ONNX Runtime's errors naming the input.
    pub async fn eval_step(&mut self, batch: &TensorMap) -> Result<f64> {
        let out = self
            .stage
            .evaluate(0, None, Some(payload(batch)))
            .await
            .map_err(boxed)?;
        out.loss
            .ok_or_else(|| Error::graph(format!("the module computed no `{LOSS}`")))
    }

    /// Starts a new accumulation with the next [`Module::train_step`] (ORT's
    /// `LazyResetGrad`: nothing is zeroed now; the next gradients overwrite).
    pub fn lazy_reset_grad(&mut self) {
        self.stage.reset_accumulation();
    }

    /// Writes the inference model (the forward model with the trained weights).
    ///
    /// # Errors
    /// `Io` naming the file.
    pub fn export_model_for_inferencing(&self, path: &Path) -> Result<()> {
        let trained = self.stage.parameters();
        let views: Vec<(&str, &Tensor)> = trained.iter().map(|(n, t)| (n.as_str(), t)).collect();
        save_model(&export_inference_model(&self.model, &views)?, path)
    }

    /// The trained parameters, by name.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.stage.parameters()
    }

    fn manifest(
        &self,
        optimizer: &Optimizer,
        shards: Vec<pipetrain_actors::ShardFile>,
    ) -> Manifest {
        let cfg = optimizer.config.clone();
        let params = self.stage.parameters();
        Manifest {
            format: checkpoint::FORMAT.into(),
            format_version: checkpoint::FORMAT_VERSION,
            pipetrain_version: env!("CARGO_PKG_VERSION").into(),
            steps_done: self.steps,
            created_unix_s: checkpoint::now_unix_s(),
            layout: checkpoint::Layout {
                data_parallel_size: 1,
                pipeline_parallel_size: 1,
                virtual_stages: 1,
                stages: 1,
                schedule: "1f1b".into(),
            },
            model: checkpoint::ModelInfo {
                path: self.model_path.clone(),
                spec: None,
                fingerprint: self.fingerprint.clone(),
                tensors: params.len(),
                parameters: params.iter().map(|(_, t)| t.len() as u64).sum(),
            },
            optimizer: checkpoint::OptimizerInfo {
                config: cfg.clone(),
                state: self.stage.optimizer_state_names(),
            },
            lr_schedule: checkpoint::LrInfo {
                config: LrSchedule {
                    lr: optimizer.lr,
                    ..LrSchedule::default()
                },
                step: self.steps,
                total_steps: self.steps,
                next_lr: optimizer.lr,
            },
            data: checkpoint::DataPosition {
                next_step: self.steps,
                global_batch: 0,
                sample_offset: 0,
                batch_order: None,
                batch_order_row: None,
                epoch: 0,
                shuffle_seed: None,
            },
            loss_scaler: checkpoint::ScalerInfo {
                mode: "static".into(),
                state: GradPolicy::default().scaling.initial_state(),
            },
            settings: checkpoint::Settings::new(
                [
                    ("model".to_string(), serde_json::json!(self.fingerprint)),
                    (
                        "loss".to_string(),
                        serde_json::to_value(&self.loss).unwrap_or_default(),
                    ),
                ]
                .into(),
                Default::default(),
            ),
            shards,
        }
    }
}

/// ORT's `Optimizer`: the update of a [`Module`]'s parameters.
pub struct Optimizer {
    config: OptimizerConfig,
    lr: f64,
}

impl Optimizer {
    /// An optimizer of `config` for `module` at learning rate `lr`; its state comes from
    /// the module's checkpoint state when that holds one of this kind.
    ///
    /// # Errors
    /// `Config` for a bad configuration; `Checkpoint` when the checkpoint's optimizer
    /// state does not fit.
    pub fn new(config: OptimizerConfig, lr: f64, module: &mut Module) -> Result<Optimizer> {
        module.stage.set_optimizer(&config)?;
        if let Some(ckpt) = module.pending.take() {
            module.stage.restore(&ckpt)?;
        }
        Ok(Optimizer { config, lr })
    }

    /// One update of `module`'s parameters from its accumulated gradients (ORT's
    /// `OptimizerStep`).
    ///
    /// # Errors
    /// The optimizer's errors.
    pub async fn step(&mut self, module: &mut Module) -> Result<()> {
        let policy = GradPolicy::default();
        let stats = module.stage.grad_stats(module.steps);
        let (decision, _) = policy.decide(policy.scaling.initial_state(), &[stats]);
        module
            .stage
            .update(module.steps, self.lr, &decision)
            .await
            .map_err(boxed)?;
        module.steps += 1;
        Ok(())
    }

    /// Sets the learning rate of the next steps.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// The learning rate of the next step.
    pub fn get_learning_rate(&self) -> f64 {
        self.lr
    }
}

/// ORT's `LinearLRScheduler`: linear warmup from 0 over `warmup_step_count` steps to
/// `initial_lr`, then linear decay to 0 at `total_step_count`.
pub struct LinearLrScheduler {
    schedule: LrSchedule,
    total: u64,
    step: u64,
}

impl LinearLrScheduler {
    /// The schedule; sets `optimizer`'s rate for the first step.
    pub fn new(
        optimizer: &mut Optimizer,
        warmup_step_count: u64,
        total_step_count: u64,
        initial_lr: f64,
    ) -> Self {
        let schedule = LrSchedule {
            kind: LrDecay::Linear,
            lr: initial_lr,
            warmup_ratio: warmup_step_count as f64 / total_step_count.max(1) as f64,
        };
        optimizer.set_learning_rate(schedule.lr_at(0, total_step_count));
        LinearLrScheduler {
            schedule,
            total: total_step_count,
            step: 0,
        }
    }

    /// Moves to the next step and sets `optimizer`'s rate for it (ORT's
    /// `scheduler_step`).
    pub fn scheduler_step(&mut self, optimizer: &mut Optimizer) {
        self.step += 1;
        optimizer.set_learning_rate(self.schedule.lr_at(self.step, self.total));
    }
}

fn payload(batch: &TensorMap) -> Payload {
    batch
        .iter()
        .map(|(k, v)| (k.clone(), Arc::new(v.clone())))
        .collect()
}

fn boxed(e: pipetrain_actors::BoxError) -> Error {
    Error::Runtime {
        source: Box::new(pipetrain_actors::ActorError::Compute {
            replica: 0,
            stage: 0,
            action: pipetrain_actors::schedules::Action::forward(0, 0),
            source: e,
        }),
    }
}
