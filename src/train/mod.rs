//! A training run on the actor runtime: the configuration's model, cut into stages, one
//! [`OrtStage`] per (stage, replica), fed by [`StepData`] and driven by
//! `pipetrain_actors::run` under the configured pipeline schedule; resumed from a
//! checkpoint and saving checkpoints (`checkpointing`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain_actors::{
    EngineSettings, LossScaling, RunTrace, SavedCheckpoint, ScalerState, StepResult,
};

use crate::checkpoint::{model_fingerprint, slow_write, LoadedCheckpoint, ModelInfo};
use crate::compute::{Runtime, SessionOptions};
use crate::config::TrainConfig;
use crate::data::{read_safetensors, Batches};
use crate::graph::{
    assign_stages, build_stage_graphs, build_training_graph, export_inference_model, LossNormalize,
    TrainOptions,
};
use crate::onnx::proto::ModelProto;
use crate::onnx::{load_model, save_model, write_atomically};
use crate::pipeline::{OrtStage, StageSettings, StepData};
use crate::tensor::Tensor;
use crate::{Error, Result};

mod checkpointing;

pub use checkpointing::latest_checkpoint;

/// What one optimizer step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Step index (from 0).
    pub step: u64,
    /// Mean loss of the step's global batch, before the update.
    pub loss: f64,
    /// The learning rate of the step.
    pub lr: f64,
    /// Mean loss on the evaluation set after the step, when one was run.
    pub eval_loss: Option<f64>,
    /// Global L2 norm of the gradients (unscaled, before clipping).
    pub grad_norm: f64,
    /// The clip coefficient, when `max_grad_norm` is set.
    pub clip_coef: Option<f64>,
    /// The loss scale the step used.
    pub loss_scale: f64,
    /// The update was skipped (a gradient overflowed under dynamic loss scaling).
    pub skipped: bool,
    /// Checkpoints completed since the previous report.
    pub saved: Vec<SavedCheckpoint>,
    /// Time since training started.
    pub elapsed: Duration,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Optimizer steps run (by this process: a resumed run counts from its checkpoint).
    pub steps: usize,
    /// The first step this process ran (0, or a resumed checkpoint's step).
    pub first_step: u64,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Samples per optimizer step (all replicas).
    pub global_batch: usize,
    /// Training time (graph building and session creation excluded).
    pub elapsed: Duration,
    /// Pipeline stages.
    pub stages: usize,
    /// The trained parameters (replica 0's; every replica holds the same).
    pub parameters: Vec<(String, Tensor)>,
    /// What every actor did, when asked for.
    pub trace: Option<RunTrace>,
}

/// Trains as `cfg` says (a tokio runtime of its own; see [`train_async`] to embed).
///
/// # Errors
/// As [`train_async`].
pub fn train(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    record_trace: bool,
    on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    // Stage actors compute on threads of their own; the scheduler, coordinator and data
    // actors share one worker, so their messages wake no further threads on cores the
    // stages need (engine overhead on mlp fell from +5..15% to within +-1.5%).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .map_err(Error::io(config_path))?;
    runtime.block_on(train_async(rt, cfg, config_path, record_trace, on_step))
}

/// Trains as `cfg` says, calling `on_step` after every optimizer step; resumes from
/// `checkpoint_to_load_path` when set, and saves checkpoints into `checkpoints_dir`.
/// Needs tokio's multi-thread runtime: stages compute on their own worker threads.
///
/// # Errors
/// Any error of loading, graph building or running, naming its file or field; a
/// checkpoint that does not fit the run; a stalled pipeline's who-waits-on-whom report;
/// a non-finite loss or gradient without dynamic loss scaling.
pub async fn train_async(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    record_trace: bool,
    mut on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    let mut model = load_model(&cfg.model_path)?;
    let fingerprint = model_fingerprint(&model);
    if let Some(init) = &cfg.init_path {
        apply_init(&mut model, &read_safetensors(init)?, init)?;
    }
    let resume = checkpointing::load_resume(cfg, &fingerprint)?;
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    let batches = Batches::open(&cfg.data, cfg.global_batch(), config_path)?;
    let first = batches.part(0, 0, d * m)?;
    let example: Vec<(&str, &Tensor)> = first.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let opts = TrainOptions {
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: !cfg.runtime.standard_ops_only,
    };
    let tg = build_training_graph(rt, &model, &opts, &example)?;
    if let Some(ckpt) = &resume {
        let shapes: Vec<(String, Vec<usize>)> = tg
            .params
            .iter()
            .map(|p| (p.name.clone(), p.meta.shape.clone()))
            .collect();
        ckpt.check_model(&shapes)?;
    }
    let assignment = assign_stages(&tg, &cfg.partition())?;
    let stages = build_stage_graphs(&tg, &assignment)?;
    let policy = cfg.grad_policy();
    let scaler = starting_scaler(cfg, resume.as_ref());
    let settings = stage_settings(cfg, scaler.scale);
    let session_opts = session_options(cfg);
    let mut computes = Vec::with_capacity(d);
    for replica in 0..d {
        let mut list = Vec::with_capacity(stages.len());
        for (s, g) in stages.iter().enumerate() {
            let mut st = settings.clone();
            st.overflow_at = cfg
                .debug
                .inject_grad_overflow
                .iter()
                .filter(|f| f.stage == s && f.replica == replica)
                .map(|f| f.step - 1)
                .collect();
            let mut stage = OrtStage::new(rt, &tg, g, &session_opts, &st)?;
            if let Some(ckpt) = &resume {
                stage.restore(ckpt)?;
            }
            list.push(stage);
        }
        computes.push(list);
    }
    let state_names: Vec<String> = computes
        .first()
        .and_then(|r| r.first())
        .map(|s| s.optimizer_state_names())
        .unwrap_or_default();
    let model_info = ModelInfo {
        path: cfg.model_path.clone(),
        fingerprint: fingerprint.clone(),
        tensors: tg.params.len(),
        parameters: tg.params.iter().map(|p| p.meta.numel() as u64).sum(),
    };
    let facts = checkpointing::RunFacts::new(cfg, &batches, model_info, state_names, stages.len());
    let reads = stages.iter().map(|s| s.io.data.clone()).collect();
    let mut data = StepData::new(batches, m, d, reads);
    if cfg.loss.normalize() == LossNormalize::Tokens {
        if let Some(label) = cfg.loss.label() {
            data = data.with_token_count(label, cfg.loss.ignore_index());
        }
    }
    let evaluation = match cfg.evaluation_period {
        Some(every) => {
            let k = cfg.eval_micro_batches;
            let eval = Batches::open(&cfg.eval_data(), cfg.batch_size * k * d, config_path)?;
            data = data.with_eval(eval, k);
            Some(pipetrain_actors::EvalSettings {
                every: every as u64,
                micro_batches: k,
            })
        }
        None => None,
    };
    let data = Arc::new(data);
    let schedule = cfg.schedule().generate().map_err(|e| Error::Config {
        path: config_path.to_path_buf(),
        field: "pipeline.schedule".into(),
        rule: e.to_string(),
    })?;
    let engine = EngineSettings {
        watchdog: Duration::from_secs_f64(cfg.watchdog_seconds),
        record_trace,
        evaluation,
        policy,
        scaler: Some(scaler),
        checkpoint: checkpointing::checkpointer(cfg, facts)?,
        ..EngineSettings::new(schedule, d)
    };
    let total = cfg.optimizer_steps() as u64;
    let first_step = resume.as_ref().map_or(0, |c| c.manifest.steps_done);
    drop(resume);
    let lr = cfg.lr_schedule.clone();
    let start = Instant::now();
    let out = pipetrain_actors::run(
        &engine,
        computes,
        data,
        Box::new(move |step| lr.lr_at(step, total)),
        first_step..total,
        |r: &StepResult| {
            on_step(&StepReport {
                step: r.step,
                loss: r.loss,
                lr: r.lr,
                eval_loss: r.eval_loss,
                grad_norm: r.grad_norm,
                clip_coef: r.clip_coef,
                loss_scale: r.loss_scale,
                skipped: r.skipped,
                saved: r.saved.clone(),
                elapsed: start.elapsed(),
            })
        },
    )
    .await
    .map_err(|e| Error::Runtime {
        source: Box::new(e),
    })?;
    let elapsed = start.elapsed();
    let parameters: Vec<(String, Tensor)> = out
        .computes
        .first()
        .into_iter()
        .flatten()
        .flat_map(OrtStage::parameters)
        .collect();
    if let Some(path) = &cfg.output_path {
        let trained: Vec<(&str, &Tensor)> =
            parameters.iter().map(|(k, v)| (k.as_str(), v)).collect();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        }
        save_model(&export_inference_model(&model, &trained)?, path)?;
    }
    Ok(TrainSummary {
        steps: out.steps.len(),
        first_step,
        final_loss: out.steps.last().map_or(f64::NAN, |s| s.loss),
        global_batch: cfg.global_batch(),
        elapsed,
        stages: assignment.stages,
        parameters,
        trace: out.trace,
    })
}

/// The loss scaler's state at the first step: a resumed dynamic scaler's, else the
/// configuration's.
fn starting_scaler(cfg: &TrainConfig, resume: Option<&LoadedCheckpoint>) -> ScalerState {
    let scaling = cfg.grad_policy().scaling;
    match (scaling, resume) {
        (LossScaling::Dynamic(_), Some(c)) if c.manifest.loss_scaler.mode == "dynamic" => {
            c.manifest.loss_scaler.state
        }
        _ => scaling.initial_state(),
    }
}

/// What every stage of `cfg`'s run shares.
fn stage_settings(cfg: &TrainConfig, loss_scale: f64) -> StageSettings {
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    StageSettings {
        split_backward: cfg.split_backward(),
        loss_scale,
        normalize: cfg.loss.normalize(),
        slow_save: slow_write(cfg.debug.checkpoint_write_delay_ms),
        ..StageSettings::new(cfg.optimizer.clone(), 1.0 / (m * d) as f64)
    }
}

/// ONNX Runtime session settings: the machine's cores shared among the stage actors.
fn session_options(cfg: &TrainConfig) -> SessionOptions {
    let actors = cfg.data_parallel_size * cfg.pipeline_parallel_size;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    SessionOptions {
        intra_threads: cfg
            .runtime
            .intra_op_threads
            .unwrap_or((cores / actors).max(1)),
        inter_threads: 1,
        optimize: !cfg.runtime.disable_optimizations,
        // One actor alone runs one training session (the fused forward + backward of a
        // single stage), and its threads spinning between kernels saves a wake-up each
        // (tiny_gpt +20% steps/s). With several sessions per stage (forward, backward) or
        // several actors, threads of an idle session spinning would steal the cores of
        // the busy one.
        spin: actors == 1 && cfg.stages() == 1 && !cfg.split_backward(),
        profile: false,
    }
}

/// Writes a run's trace as JSON (atomically).
///
/// # Errors
/// `Io` when the file cannot be written.
pub fn save_trace(trace: &RunTrace, path: &Path) -> Result<()> {
    let text = serde_json::to_vec_pretty(trace).map_err(|e| Error::Data {
        path: path.to_path_buf(),
        what: "trace".into(),
        reason: e.to_string(),
    })?;
    write_atomically(path, &text)
}

/// Replaces initializers by the safetensors file's tensors of the same name.
fn apply_init(
    model: &mut ModelProto,
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
