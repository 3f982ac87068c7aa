//! The training loop of one process: the model's stages run one after another.
//!
//! This is the compute core driven directly; the actor runtime (stage actors exchanging
//! micro-batches under a schedule) drives the same stage graphs concurrently.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::compute::{Runtime, SessionOptions, StageChain, StepOutput, TensorMap, TrainSession};
use crate::config::{OptimizerConfig, TrainConfig};
use crate::data::{read_safetensors, Batches};
use crate::graph::{
    assign_stages, build_stage_graphs, build_training_graph, export_inference_model, TrainOptions,
};
use crate::onnx::{load_model, save_model};
use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// What one optimizer step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Step index (from 0).
    pub step: usize,
    /// Loss of the step's batch before the update.
    pub loss: f64,
    /// Time since training started.
    pub elapsed: Duration,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Samples per step.
    pub batch_size: usize,
    /// Training time (graph building excluded).
    pub elapsed: Duration,
    /// Number of pipeline stages.
    pub stages: usize,
}

/// Trains as `cfg` says, calling `on_step` after every step.
///
/// # Errors
/// Any error of loading, graph building or running, naming its file or field.
pub fn train(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    mut on_step: impl FnMut(&StepReport),
) -> Result<TrainSummary> {
    let original = load_model(&cfg.model_path)?;
    let mut model = original.clone();
    if let Some(init) = &cfg.init_path {
        apply_init(&mut model, &read_safetensors(init)?, init)?;
    }
    let batches = Batches::open(&cfg.data, config_path)?;
    let first = batches.batch(0)?;
    let example: Vec<(&str, &Tensor)> = first.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let opts = TrainOptions {
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: cfg.runtime.contrib_ops,
    };
    let tg = build_training_graph(rt, &model, &opts, &example)?;
    let session_opts = SessionOptions {
        intra_threads: cfg.runtime.intra_op_threads,
        inter_threads: 1,
        optimize: cfg.runtime.optimize,
        // One session alone may spin; stage sessions take turns on the same cores.
        spin: cfg.pipeline.partition.is_none(),
        profile: false,
    };
    let mut runner = match &cfg.pipeline.partition {
        Some(p) => {
            let a = assign_stages(&tg, p)?;
            let stages = build_stage_graphs(&tg, &a)?;
            Runner::Chain(
                StageChain::new(rt, &tg, &stages, &session_opts, cfg.pipeline.split_backward)?,
                a.stages,
            )
        }
        None => Runner::Whole(TrainSession::new(rt, &tg, &session_opts)?),
    };
    let mut params: TensorMap = tg
        .params
        .iter()
        .map(|p| (p.name.clone(), p.init.clone()))
        .collect();
    let seed = match tg.metas.get(crate::graph::LOSS).map(|m| m.dtype) {
        Some(crate::tensor::DType::F64) => Tensor::f64(vec![], vec![1.0])?,
        _ => Tensor::f32(vec![], vec![1.0])?,
    };
    let OptimizerConfig::Sgd { lr } = cfg.optimizer;
    let start = Instant::now();
    let mut last = f64::NAN;
    for step in 0..cfg.num_train_steps {
        let batch = if step == 0 {
            first.clone()
        } else {
            batches.batch(step)?
        };
        let out = runner.step(&params, &batch, &seed)?;
        sgd(&mut params, &out.grads, lr);
        last = out.loss;
        on_step(&StepReport {
            step,
            loss: out.loss,
            elapsed: start.elapsed(),
        });
    }
    let elapsed = start.elapsed();
    if let Some(out) = &cfg.output_path {
        let trained: Vec<(&str, &Tensor)> = params.iter().map(|(k, v)| (k.as_str(), v)).collect();
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        }
        save_model(&export_inference_model(&model, &trained)?, out)?;
    }
    Ok(TrainSummary {
        steps: cfg.num_train_steps,
        final_loss: last,
        batch_size: batches.batch_size(),
        elapsed,
        stages: runner.stages(),
    })
}

enum Runner {
    Whole(TrainSession),
    Chain(StageChain, usize),
}

impl Runner {
    fn step(&mut self, params: &TensorMap, data: &TensorMap, seed: &Tensor) -> Result<StepOutput> {
        match self {
            Runner::Whole(s) => s.step(params, data, seed),
            Runner::Chain(c, _) => c.step(params, data, seed),
        }
    }

    fn stages(&self) -> usize {
        match self {
            Runner::Whole(_) => 1,
            Runner::Chain(_, n) => *n,
        }
    }
}

/// `p -= lr * g` (PyTorch's SGD without momentum or weight decay).
fn sgd(params: &mut TensorMap, grads: &TensorMap, lr: f64) {
    for (name, g) in grads {
        let Some(p) = params.get_mut(name) else {
            continue;
        };
        match (&mut p.data, &g.data) {
            (TensorData::F32(w), TensorData::F32(d)) => {
                let lr = lr as f32;
                w.iter_mut().zip(d).for_each(|(w, d)| *w -= lr * d);
            }
            (TensorData::F64(w), TensorData::F64(d)) => {
                w.iter_mut().zip(d).for_each(|(w, d)| *w -= lr * d)
            }
            _ => {}
        }
    }
}

/// Replaces initializers by the safetensors file's tensors of the same name.
fn apply_init(
    model: &mut crate::onnx::proto::ModelProto,
    init: &std::collections::HashMap<String, Tensor>,
    path: &Path,
) -> Result<()> {
    let graph = model
        .graph
        .as_mut()
        .ok_or_else(|| Error::graph("the model has no graph"))?;
    for (name, t) in init {
        let slot = graph
            .initializer
            .iter_mut()
            .find(|i| &i.name == name)
            .ok_or_else(|| Error::Data {
                path: path.to_path_buf(),
                what: name.clone(),
                reason: "not an initializer of the model".into(),
            })?;
        let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        if slot.dims != dims || slot.data_type != t.dtype().onnx() {
            return Err(Error::Data {
                path: path.to_path_buf(),
                what: name.clone(),
                reason: format!(
                    "shape {dims:?} type {:?} differs from the model's initializer (shape {:?})",
                    t.dtype(),
                    slot.dims
                ),
            });
        }
        *slot = t.to_proto(name);
    }
    Ok(())
}
