//! ONNX Runtime's `TrainingRunner` and its parameters (seeds 000 and 003).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::api::{TrainSummary, Trainer};
use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::BatchSource;
use crate::graph::LossSpec;
use crate::optim::OptimizerConfig;
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
    /// Tensor shards per stage (Megatron-LM's split; see the README's "Tensor parallelism").
    pub horizontal_parallel_size: usize,
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
            horizontal_parallel_size: 1,
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
             display_loss_steps = {}\ndata_parallel_size = {}\npipeline_parallel_size = {}\n\
             horizontal_parallel_size = {}\nloss_scale = {:?}\n",
            self.model_path,
            self.batch_size,
            self.num_train_steps,
            self.gradient_accumulation_steps,
            self.display_loss_steps,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.horizontal_parallel_size,
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
        // The run has threads of its own: this works from inside a runtime too (where it
        // blocks the calling thread until the run ends; async code awaits
        // `TrainingRunner::run_async`).
        self.trainer(train_loader, eval_loader)?
            .start(&self.rt)?
            .wait_blocking()
    }

    /// [`TrainingRunner::run`] for async code: the run trains on its own threads while
    /// the caller's runtime goes on.
    ///
    /// # Errors
    /// As [`TrainingRunner::run`].
    pub async fn run_async(
        &mut self,
        train_loader: impl BatchSource,
        eval_loader: Option<Box<dyn BatchSource>>,
    ) -> Result<TrainSummary> {
        let trainer = self.trainer(train_loader, eval_loader)?;
        trainer.start(&self.rt)?.wait().await
    }

    /// The run of the parameters on these loaders.
    fn trainer(
        &self,
        train_loader: impl BatchSource,
        eval_loader: Option<Box<dyn BatchSource>>,
    ) -> Result<Trainer> {
        let cfg = self.params.config(eval_loader.is_some())?;
        let mut trainer = Trainer::new(cfg).with_data(train_loader);
        if let Some(eval) = eval_loader {
            trainer.eval_data = Some(Arc::from(eval));
        }
        Ok(trainer)
    }
}
