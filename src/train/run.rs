//! The body of a run: the model and its checkpoint, the stage graphs and their
//! computes, the data, the engine's settings, and the events of the run as it goes.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain_actors::{EngineSettings, LossScaling, ScalerState, StepResult};

use super::{apply_init, checkpointing, RunEvent, RunOptions, StepReport, TrainSummary};
use crate::checkpoint::{model_fingerprint, slow_write, LoadedCheckpoint, ModelInfo};
use crate::compute::{Runtime, SessionOptions};
use crate::config::TrainConfig;
use crate::data::{read_safetensors, Batches, FedBatches, StepBatches};
use crate::graph::{
    assign_stages, build_stage_graphs, build_training_graph, export_inference_model, LossNormalize,
    TrainOptions,
};
use crate::onnx::save_model;
use crate::pipeline::{OrtStage, StageSettings, StepData};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Trains as `cfg` says, driven by `opts` (see [`super::train_async`]).
pub(super) async fn run_training(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    opts: RunOptions<'_>,
) -> Result<TrainSummary> {
    let RunOptions {
        record_trace,
        data: fed,
        eval_data: fed_eval,
        control,
        on_event,
    } = opts;
    let mut model = cfg.load_model()?;
    let fingerprint = model_fingerprint(&model);
    if let Some(init) = &cfg.init_path {
        apply_init(&mut model, &read_safetensors(init)?, init)?;
    }
    let (resume, changes) = checkpointing::load_resume(cfg, &fingerprint)?;
    for change in changes {
        on_event(RunEvent::Warning(change));
    }
    let first_step = resume.as_ref().map_or(0, |c| c.manifest.steps_done);
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    let (batches, order_len, rows): (Box<dyn StepBatches>, _, _) = match fed {
        Some(source) => (Box::new(FedBatches(source)), None, 0),
        None => {
            let b = Batches::open(&cfg.data, cfg.global_batch(), config_path)?;
            let (order_len, rows) = (b.order_len(), b.rows());
            (Box::new(b), order_len, rows)
        }
    };
    // The first step the run trains: an embedder's source starts there.
    let first = batches.part(first_step as usize, 0, d * m)?;
    let example: Vec<(&str, &Tensor)> = first.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let opts = TrainOptions {
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: !cfg.runtime.standard_ops_only,
    };
    let tg = build_training_graph(rt, &model, &opts, &example)?;
    // Graph building's probes and copies are freed now; glibc keeps freed heap in the
    // process unless asked (tiny_gpt: resident memory 88 -> 45 MiB here, and the run's
    // peak from 134 to 103 MiB).
    release_freed_memory();
    for (path, built) in [
        (
            &cfg.model_with_loss_func_path,
            cfg.model_with_loss_func_path
                .as_ref()
                .map(|_| tg.model_with_loss()),
        ),
        (
            &cfg.model_with_training_graph_path,
            cfg.model_with_training_graph_path
                .as_ref()
                .map(|_| Ok(tg.model_with_training_graph())),
        ),
    ] {
        if let (Some(path), Some(model)) = (path, built) {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
            }
            save_model(&model?, path)?;
        }
    }
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
    let param_names: Vec<String> = tg.params.iter().map(|p| p.name.clone()).collect();
    let (mut board, tap) = match super::board::Board::open(cfg, config_path, &param_names)? {
        Some((b, tap)) => (Some(b), tap),
        None => (None, None),
    };
    let policy = cfg.grad_policy();
    let scaler = starting_scaler(cfg, resume.as_ref());
    let settings = stage_settings(cfg, scaler.scale);
    let session_opts = session_options(cfg);
    let mut computes = Vec::with_capacity(d);
    for replica in 0..d {
        let mut list = Vec::with_capacity(stages.len());
        for (s, g) in stages.iter().enumerate() {
            let mut st = settings.clone();
            if replica == 0 {
                st.histograms = tap.clone();
            }
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
        spec: cfg.model.clone(),
        fingerprint: fingerprint.clone(),
        tensors: tg.params.len(),
        parameters: tg.params.iter().map(|p| p.meta.numel() as u64).sum(),
    };
    let facts = checkpointing::RunFacts::new(
        cfg,
        (order_len, rows),
        model_info,
        state_names,
        stages.len(),
    );
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
            let eval: Box<dyn StepBatches> = match fed_eval {
                Some(source) => Box::new(FedBatches(source)),
                None => Box::new(Batches::open(
                    &cfg.eval_data(),
                    cfg.batch_size * k * d,
                    config_path,
                )?),
            };
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
        control,
        spin: stage_spin(cfg),
        ..EngineSettings::new(schedule, d)
    };
    let total = cfg.optimizer_steps() as u64;
    drop(resume);
    on_event(RunEvent::Started {
        first_step,
        total_steps: total,
        stages: assignment.stages,
        replicas: d,
    });
    let lr = cfg.lr_schedule.clone();
    let start = Instant::now();
    let mut last = Duration::ZERO;
    let out = pipetrain_actors::run(
        &engine,
        computes,
        data,
        Box::new(move |step| lr.lr_at(step, total)),
        first_step..total,
        |r: &StepResult| {
            let elapsed = start.elapsed();
            let step_s = (elapsed - last).as_secs_f64().max(1e-9);
            last = elapsed;
            let report = StepReport {
                step: r.step,
                loss: r.loss,
                lr: r.lr,
                eval_loss: r.eval_loss,
                eval_accuracy: r.eval_accuracy,
                grad_norm: r.grad_norm,
                clip_coef: r.clip_coef,
                loss_scale: r.loss_scale,
                skipped: r.skipped,
                saved: r.saved.clone(),
                samples_per_s: cfg.global_batch() as f64 / step_s,
                elapsed,
            };
            if let Some(b) = board.as_mut() {
                if let Err(e) = b.step(&report) {
                    on_event(RunEvent::Warning(format!("TensorBoard log stopped: {e}")));
                    board = None;
                }
            }
            for e in report.events() {
                on_event(e);
            }
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

/// Gives memory the allocator holds but no longer uses back to the system (glibc's
/// `malloc_trim`; elsewhere nothing to do).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free heap pages to the system; it touches no
    // live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
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

/// How long stage actors poll for messages before parking: 2 ms when each has a core
/// of its own (mlp at pp = 2 hands over every 0.2-0.4 ms), none when they share cores.
fn stage_spin(cfg: &TrainConfig) -> Duration {
    let actors = cfg.data_parallel_size * cfg.pipeline_parallel_size;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    if actors > 1 && actors <= cores {
        Duration::from_millis(2)
    } else {
        Duration::ZERO
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
