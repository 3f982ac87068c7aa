//! The body of a run: the model and its checkpoint, the stage graphs and their
//! computes, the data, the engine's settings, and the events of the run as it goes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain_actors::{Collective, EngineSettings, StepResult};

use super::cluster::{gather_parameters, ClusterPart};
use super::settings::{
    session_options, stage_settings, stage_spin, starting_scaler, training_graph,
};
use super::{apply_init, checkpointing, RunEvent, RunOptions, StashPeak, StepReport, TrainSummary};
use crate::checkpoint::{model_fingerprint, ModelInfo};
use crate::compute::{check_device, Runtime};
use crate::config::TrainConfig;
use crate::data::{open_step_batches, read_safetensors, FedBatches, StepBatches};
use crate::graph::{
    assign_stages, build_stage_graphs_with, export_inference_model, with_tied_shared, LossNormalize,
};
use crate::onnx::save_model;
use crate::pipeline::{OrtStage, StepData};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Trains as `cfg` says, driven by `opts` (see [`super::train_async`]); with `cluster`,
/// this process's part of a run spread over several.
pub(super) async fn run_training<K: Collective>(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    opts: RunOptions<'_>,
    cluster: Option<ClusterPart<K>>,
) -> Result<TrainSummary> {
    let RunOptions {
        record_trace,
        data: fed,
        eval_data: fed_eval,
        control,
        on_event,
    } = opts;
    check_device(cfg.runtime.device).map_err(|rule| Error::Config {
        path: config_path.to_path_buf(),
        field: "runtime.device".into(),
        rule,
    })?;
    let mut model = cfg.load_model()?;
    super::settings::warn_about_model(cfg, &model)?;
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
    let is_fed = fed.is_some();
    let (batches, order_len, rows): (Box<dyn StepBatches>, _, _) = match fed {
        Some(source) => (Box::new(FedBatches(source)), None, 0),
        None => open_step_batches(&cfg.data, cfg.global_batch(), d, config_path)?,
    };
    // Shapes are measured on the first micro-batch of the first step the run trains (an
    // embedder's source starts there), of a replica this process runs: with shards split
    // by files, a process reads no other replica's files.
    let probe = cluster
        .as_ref()
        .and_then(|c| c.members.iter().map(|&(r, _)| r).min())
        .unwrap_or(0);
    let example = batches.part(first_step as usize, probe * m, d * m)?;
    let batches = super::data_rules::checked_batches(cfg, &model, batches, &example, is_fed)?;
    drop(example);
    let tg = training_graph(
        rt,
        cfg,
        &model,
        batches.as_ref(),
        first_step as usize,
        probe,
    )?;
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
    let (tg, assignment) = with_tied_shared(&tg, assign_stages(&tg, &cfg.partition())?);
    let stages = build_stage_graphs_with(&tg, &assignment, cfg.recompute).map_err(|e| match e {
        Error::Partition { reason } if reason.starts_with("recompute") => Error::Config {
            path: config_path.to_path_buf(),
            field: "recompute".into(),
            rule: reason,
        },
        e => e,
    })?;
    let schedule = cfg.schedule().generate().map_err(|e| Error::Config {
        path: config_path.to_path_buf(),
        field: "pipeline.schedule".into(),
        rule: e.to_string(),
    })?;
    let placement = schedule.placement().to_vec();
    let predicted = super::memory::predicted_stash(&tg, &stages, &schedule);
    // The (replica, stage) computes this process holds: all of them, or its members'.
    let owned: Vec<(usize, usize)> = (0..d)
        .flat_map(|r| (0..stages.len()).map(move |s| (r, s)))
        .filter(|&(r, s)| cluster.as_ref().is_none_or(|c| c.owns(r, s, &placement)))
        .collect();
    // Only the process that reports the run writes TensorBoard's log.
    let reports = cluster.as_ref().is_none_or(|c| c.node == 0);
    let param_names: Vec<String> = tg.params.iter().map(|p| p.name.clone()).collect();
    let opened = match reports {
        true => super::board::Board::open(cfg, config_path, &param_names)?,
        false => None,
    };
    let (mut board, tap) = match opened {
        Some((b, tap)) => (Some(b), tap),
        None => (None, None),
    };
    let policy = cfg.grad_policy();
    let scaler = starting_scaler(cfg, resume.as_ref());
    let settings = stage_settings(cfg, scaler.scale);
    let local_actors = cluster
        .as_ref()
        .map_or(d * cfg.pipeline_parallel_size, |c| c.members.len());
    let session_opts = session_options(cfg, local_actors);
    let mut computes = HashMap::new();
    for replica in 0..d {
        for (s, g) in stages.iter().enumerate() {
            if !owned.contains(&(replica, s)) {
                continue;
            }
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
            st.stall = cfg
                .debug
                .stall
                .filter(|f| f.stage == s && f.replica == replica)
                .map(|f| (f.step - 1, Duration::from_secs(f.seconds)));
            let mut stage = OrtStage::new(rt, &tg, g, &session_opts, &st)?;
            if let Some(ckpt) = &resume {
                stage.restore(ckpt)?;
            }
            computes.insert((replica, s), stage);
        }
    }
    let state_names: Vec<String> = computes
        .values()
        .next()
        .map(OrtStage::optimizer_state_names)
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
                None => {
                    open_step_batches(&cfg.eval_data(), cfg.batch_size * k * d, d, config_path)?.0
                }
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
    let engine = EngineSettings {
        watchdog: Duration::from_secs_f64(cfg.watchdog_seconds),
        record_trace,
        evaluation,
        policy,
        scaler: Some(scaler),
        checkpoint: checkpointing::checkpointer(cfg, facts)?,
        control,
        spin: stage_spin(local_actors),
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
    let on_step = |r: &StepResult| {
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
    };
    let lr_at = Box::new(move |step| lr.lr_at(step, total));
    let steps = first_step..total;
    let failed = |e| Error::Runtime {
        source: Box::new(e),
    };
    let (results, trace, parameters, peaks): (_, _, _, Vec<(usize, usize)>) = match cluster {
        None => {
            let by_replica = (0..d)
                .map(|r| {
                    (0..stages.len())
                        .map(|s| computes.remove(&(r, s)).expect("every stage was built"))
                        .collect()
                })
                .collect();
            let out = pipetrain_actors::run(&engine, by_replica, data, lr_at, steps, on_step)
                .await
                .map_err(failed)?;
            let first = out.computes.first().into_iter().flatten();
            let peaks = first
                .clone()
                .enumerate()
                .map(|(s, c)| (s, c.peak_stash_bytes()));
            let peaks = peaks.collect();
            let params = first.flat_map(OrtStage::parameters).collect();
            (out.steps, out.trace, params, peaks)
        }
        Some(part) => {
            let bus = part.dist.bus.clone();
            let out = pipetrain_actors::run_distributed(
                &engine, computes, data, lr_at, steps, on_step, part.dist,
            )
            .await
            .map_err(failed)?;
            let mut mine: Vec<_> = out
                .computes
                .into_iter()
                .filter(|((r, _), _)| *r == 0)
                .collect();
            mine.sort_by_key(|((_, s), _)| *s);
            let local = mine.iter().flat_map(|(_, c)| c.parameters()).collect();
            let peaks = mine.iter().map(|((_, s), c)| (*s, c.peak_stash_bytes()));
            let peaks = peaks.collect();
            (
                out.steps,
                out.trace,
                gather_parameters(bus.as_ref(), local).await?,
                peaks,
            )
        }
    };
    let elapsed = start.elapsed();
    if let (Some(path), true) = (&cfg.output_path, reports) {
        let trained: Vec<(&str, &Tensor)> =
            parameters.iter().map(|(k, v)| (k.as_str(), v)).collect();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        }
        save_model(&export_inference_model(&model, &trained)?, path)?;
    }
    Ok(TrainSummary {
        steps: results.len(),
        first_step,
        final_loss: results.last().map_or(f64::NAN, |s| s.loss),
        global_batch: cfg.global_batch(),
        elapsed,
        stages: assignment.stages,
        parameters,
        trace,
        stash: peaks
            .into_iter()
            .map(|(stage, measured)| StashPeak {
                stage,
                measured: measured as u64,
                predicted: predicted.get(stage).copied().unwrap_or(0),
            })
            .collect(),
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
