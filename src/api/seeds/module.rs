//! ORT's on-device training loop (seed 002): [`Module`], [`Optimizer`] and
//! [`LinearLrScheduler`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use pipetrain_actors::{GradPolicy, StageCompute};

use super::state::CheckpointState;
use crate::checkpoint::{self, LoadedCheckpoint};
use crate::compute::{intra_threads_for, Runtime, SessionOptions};
use crate::graph::{
    assign_stages, build_stage_graphs, build_training_graph, export_inference_model,
    flops_per_node, BalanceBy, LossSpec, Partition, TrainOptions, DROPOUT_KEY, LOSS,
};
use crate::onnx::proto::ModelProto;
use crate::onnx::{load_model, save_model};
use crate::optim::{LrDecay, LrSchedule, OptimizerConfig};
use crate::pipeline::{OrtStage, Payload, StageSettings};
use crate::tensor::{Tensor, TensorMap};
use crate::{Error, Result};

/// The model to train on this device: ORT's `Module` (one stage, fused forward and
/// backward).
///
/// Each step has two forms: `async` ([`Module::train_step`], [`Module::eval_step`],
/// [`Optimizer::step`]), which computes on tokio's blocking threads so the caller's
/// runtime goes on meanwhile (it needs a tokio runtime, of any flavour), and
/// `_blocking`, which computes on the calling thread.
pub struct Module {
    /// Shared with a step computing on a blocking thread (one at a time: steps take
    /// `&mut self`).
    pub(super) stage: Arc<Mutex<OrtStage>>,
    pub(super) model: ModelProto,
    pub(super) model_path: PathBuf,
    pub(super) fingerprint: String,
    pub(super) loss: LossSpec,
    pub(super) training: bool,
    /// Optimizer state from the checkpoint, waiting for the optimizer.
    pub(super) pending: Option<LoadedCheckpoint>,
    /// Optimizer steps taken.
    pub(super) steps: u64,
    /// Training steps since the last optimizer step: with `steps`, what its training-mode
    /// dropouts draw from (as `pipetrain train`'s micro-batches at seed 0, one replica).
    pub(super) micro_batch: u64,
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
            inputs: Default::default(),
            loss: loss.clone(),
            trainable: None,
            contrib_ops: true,
            fused_kernels: true,
            cuda_kernels: false,
            cuda_kernels_untried: false,
            flash_attention: false,
            params: Default::default(),
        };
        let mut tg = build_training_graph(rt, &model, &opts, &feeds)?;
        // The CPU's own kernels, as `pipetrain train` writes them (`train::settings`).
        crate::graph::scatter_adds_as_rows_add(&mut tg.graph);
        crate::graph::key_dropouts(&mut tg);
        if let Some(blas) = rt.blas() {
            crate::graph::blas_products(&mut tg.graph, &tg.metas, blas.smallest_products());
        }
        let one = Partition::Balanced {
            stages: 1,
            by: BalanceBy::Flops,
        };
        let graphs = build_stage_graphs(&tg, &assign_stages(&tg, &one)?)?;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        // What `pipetrain train` gives one stage alone: every core (one where the step's
        // kernels are too small to share), spinning threads.
        let session = SessionOptions {
            intra_threads: intra_threads_for(flops_per_node(&tg), cores),
            inter_threads: 1,
            optimize: true,
            spin: true,
            profile: false,
            device: crate::compute::Device::Cpu,
            deterministic: true,
            mixed_precision: None,
            state_on_device: false,
            device_path_on_host: false,
            cuda_kernels: false,
            cuda_graph: false,
        };
        let settings = StageSettings::new(OptimizerConfig::default(), 1.0);
        let stage = OrtStage::new(rt, &tg, &graphs[0], &session, &settings)?;
        if let Some(ckpt) = &state.loaded {
            ckpt.check_model(&tg.param_shapes())?;
        }
        let steps = state.loaded.as_ref().map_or(0, |c| c.manifest.steps_done);
        Ok(Module {
            stage: Arc::new(Mutex::new(stage)),
            model,
            model_path: model_path.to_path_buf(),
            fingerprint,
            loss,
            training: true,
            pending: state.loaded,
            steps,
            micro_batch: 0,
        })
        .and_then(|m| {
            // Parameters come from the checkpoint now; the optimizer's state when the
            // optimizer is made.
            if let Some(ckpt) = &m.pending {
                m.stage().restore_params(ckpt)?;
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

    /// The stage, between steps.
    pub(super) fn stage(&self) -> MutexGuard<'_, OrtStage> {
        lock(&self.stage)
    }

    /// Forward and backward of `batch` (ORT's `TrainStep`): gradients accumulate until
    /// [`Module::lazy_reset_grad`]; the loss. Computes on a blocking thread.
    ///
    /// # Errors
    /// `Config` in evaluation mode; ONNX Runtime's errors naming the input.
    pub async fn train_step(&mut self, batch: &TensorMap) -> Result<f64> {
        self.check_training()?;
        let (stage, data) = (self.stage.clone(), self.training_payload(batch)?);
        off_runtime(move || train_on(&mut lock(&stage), data)).await
    }

    /// [`Module::train_step`] on the calling thread.
    ///
    /// # Errors
    /// As [`Module::train_step`].
    pub fn train_step_blocking(&mut self, batch: &TensorMap) -> Result<f64> {
        self.check_training()?;
        let data = self.training_payload(batch)?;
        train_on(&mut self.stage(), data)
    }

    /// The loss of `batch` without gradients (ORT's `EvalStep`). Computes on a blocking
    /// thread.
    ///
    /// # Errors
    /// ONNX Runtime's errors naming the input.
    pub async fn eval_step(&mut self, batch: &TensorMap) -> Result<f64> {
        let (stage, data) = (self.stage.clone(), payload(batch));
        off_runtime(move || eval_on(&mut lock(&stage), data)).await
    }

    /// [`Module::eval_step`] on the calling thread.
    ///
    /// # Errors
    /// As [`Module::eval_step`].
    pub fn eval_step_blocking(&mut self, batch: &TensorMap) -> Result<f64> {
        eval_on(&mut self.stage(), payload(batch))
    }

    /// `batch` for a training step, with the key its dropouts draw from; counts the step.
    fn training_payload(&mut self, batch: &TensorMap) -> Result<Payload> {
        let mut data = payload(batch);
        let key = vec![0, self.steps as i64, 0, self.micro_batch as i64];
        data.insert(
            DROPOUT_KEY.into(),
            Arc::new(Tensor::i64(vec![4], key)?.into()),
        );
        self.micro_batch += 1;
        Ok(data)
    }

    fn check_training(&self) -> Result<()> {
        if self.training {
            return Ok(());
        }
        Err(Error::Config {
            path: "<module>".into(),
            field: "mode".into(),
            rule: "train_step needs training mode (module.train())".into(),
        })
    }

    /// Starts a new accumulation with the next [`Module::train_step`] (ORT's
    /// `LazyResetGrad`: nothing is zeroed now; the next gradients overwrite).
    pub fn lazy_reset_grad(&mut self) {
        self.stage().reset_accumulation();
    }

    /// Writes the inference model (the forward model with the trained weights).
    ///
    /// # Errors
    /// `Io` naming the file.
    pub fn export_model_for_inferencing(&self, path: &Path) -> Result<()> {
        let trained = self.stage().host_parameters();
        let views: Vec<(&str, &Tensor)> = trained.iter().map(|(n, t)| (n.as_str(), t)).collect();
        save_model(&export_inference_model(&self.model, &views)?, path)
    }

    /// The trained parameters, by name.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.stage().host_parameters()
    }
}

/// ORT's `Optimizer`: the update of a [`Module`]'s parameters.
pub struct Optimizer {
    pub(super) config: OptimizerConfig,
    pub(super) lr: f64,
}

impl Optimizer {
    /// An optimizer of `config` for `module` at learning rate `lr`; its state comes from
    /// the module's checkpoint state when that holds one of this kind.
    ///
    /// # Errors
    /// `Config` for a bad configuration; `Checkpoint` when the checkpoint's optimizer
    /// state does not fit.
    pub fn new(config: OptimizerConfig, lr: f64, module: &mut Module) -> Result<Optimizer> {
        module.stage().set_optimizer(&config)?;
        if let Some(ckpt) = module.pending.take() {
            module.stage().restore(&ckpt)?;
        }
        Ok(Optimizer { config, lr })
    }

    /// One update of `module`'s parameters from its accumulated gradients (ORT's
    /// `OptimizerStep`). Computes on a blocking thread.
    ///
    /// # Errors
    /// The optimizer's errors.
    pub async fn step(&mut self, module: &mut Module) -> Result<()> {
        let (stage, steps, lr) = (module.stage.clone(), module.steps, self.lr);
        off_runtime(move || update_on(&mut lock(&stage), steps, lr)).await?;
        module.steps += 1;
        module.micro_batch = 0;
        Ok(())
    }

    /// [`Optimizer::step`] on the calling thread.
    ///
    /// # Errors
    /// As [`Optimizer::step`].
    pub fn step_blocking(&mut self, module: &mut Module) -> Result<()> {
        update_on(&mut module.stage(), module.steps, self.lr)?;
        module.steps += 1;
        module.micro_batch = 0;
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

fn lock(stage: &Mutex<OrtStage>) -> MutexGuard<'_, OrtStage> {
    stage.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `work` on tokio's blocking threads, so the caller's runtime goes on meanwhile.
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work).await.map_err(|e| {
        Error::runtime(pipetrain_actors::ActorError::ActorGone {
            actor: format!("the module's compute ({e})"),
        })
    })?
}

/// A training step's forward and backward; the loss. The stage computes as it is
/// called (its futures never wait on anything), so they are driven here on this thread.
fn train_on(stage: &mut OrtStage, data: Payload) -> Result<f64> {
    pollster::block_on(async {
        let out = stage.forward(0, None, Some(data)).await.map_err(boxed)?;
        stage
            .backward(0, pipetrain_actors::BackwardPart::Full, None)
            .await
            .map_err(boxed)?;
        out.loss
            .ok_or_else(|| Error::graph("the module computed no loss"))
    })
}

/// An evaluation step's loss.
fn eval_on(stage: &mut OrtStage, data: Payload) -> Result<f64> {
    pollster::block_on(async {
        let out = stage.evaluate(0, None, Some(data)).await.map_err(boxed)?;
        out.loss
            .ok_or_else(|| Error::graph(format!("the module computed no `{LOSS}`")))
    })
}

/// The optimizer's update of step `steps` at rate `lr`.
fn update_on(stage: &mut OrtStage, steps: u64, lr: f64) -> Result<()> {
    let policy = GradPolicy::default();
    let stats = stage.grad_stats(steps);
    let (decision, _) = policy.decide(policy.scaling.initial_state(), &[stats]);
    pollster::block_on(stage.update(steps, lr, &decision)).map_err(boxed)
}

fn payload(batch: &TensorMap) -> Payload {
    batch
        .iter()
        .map(|(k, v)| (k.clone(), Arc::new(v.clone().into())))
        .collect()
}

fn boxed(e: pipetrain_actors::BoxError) -> Error {
    Error::runtime(pipetrain_actors::ActorError::Compute {
        replica: 0,
        shards: 1,
        stage: 0,
        action: pipetrain_actors::schedules::Action::forward(0, 0),
        source: e,
    })
}
