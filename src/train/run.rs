//! The body of a run: its phases before training (`phases.rs`), the engine over the
//! stage computes (`engine.rs`), the events of the run as it goes, and the trained model
//! at the end.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain_actors::{Collective, EngineSettings, StepResult};

use super::cluster::ClusterPart;
use super::engine::{run_engine, EngineOutput};
use super::phases::{build_graphs, make_computes, open_data, prepare, Built, OpenedData, Prepared};
use super::settings::{intra_op_threads, session_options, stage_spin, starting_scaler};
use super::{checkpointing, RunEvent, RunOptions, StashPeak, StepReport, TrainSummary};
use crate::checkpoint::ModelInfo;
use crate::compute::{Runtime, SessionOptions};
use crate::config::TrainConfig;
use crate::data::{open_step_batches, BatchSource, FedBatches, StepBatches};
use crate::graph::{export_inference_model, flops_per_node, LossNormalize};
use crate::onnx::save_model;
use crate::pipeline::{HistogramTap, OrtStage, StepData};
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
        cancel,
    } = opts;
    let go_on = || match &cancel {
        Some(c) if c.load(std::sync::atomic::Ordering::Relaxed) => Err(Error::Cancelled),
        _ => Ok(()),
    };
    let mut laps = crate::telemetry::Laps::start();
    let building = crate::telemetry::AnonPeak::start();
    let mut prepared = prepare(cfg, config_path, on_event)?;
    laps.lap("loading the model");
    go_on()?;
    // The engine's replicas: every tensor shard of every data-parallel replica.
    let hp = cfg.horizontal_parallel_size;
    let probe = cluster
        .as_ref()
        .and_then(|c| c.members.iter().map(|&(r, _)| r / hp).min())
        .unwrap_or(0);
    let opened = open_data(cfg, config_path, fed, &prepared, probe)?;
    laps.lap("opening the data");
    go_on()?;
    let mut built = build_graphs(rt, cfg, config_path, &prepared, &opened)?;
    laps.lap("building the graphs");
    go_on()?;
    // The trained model is the original with the trained values: the original's copies of
    // them are not needed again (GPT-2 small: 0.5 GB).
    strip_trained(&mut prepared.model, &built.tg);
    let replicas = cfg.data_parallel_size * hp;
    let owned = owned_computes(&built, replicas, cluster.as_ref());
    let so_far = building.peak();
    drop(building);
    let predicted_peak = super::memory::check_fits(cfg, &built, &owned, so_far)?.total();
    // Only the process that reports the run writes TensorBoard's log.
    let reports = cluster.as_ref().is_none_or(|c| c.node == 0);
    let cluster_node = cluster.as_ref().map(|c| c.node);
    let (board, tap) = open_board(cfg, config_path, (&built, &owned), reports)?;
    let scaler = starting_scaler(cfg, prepared.resume.as_ref());
    let local_actors = cluster
        .as_ref()
        .map_or(replicas * cfg.pipeline_parallel_size, |c| c.members.len());
    let session_opts = stage_session_options(cfg, &built, local_actors);
    let placement = built.schedule.placement();
    let devices = match cluster.as_ref() {
        Some(c) => c.stage_devices(placement),
        None => super::replica_links::spread(cfg, &owned, placement),
    };
    let computes = make_computes(
        rt,
        cfg,
        &built,
        (
            &owned,
            cluster.as_ref().and_then(|c| c.shard_groups.as_deref()),
        ),
        (&session_opts, scaler.scale),
        (tap, prepared.resume.as_ref()),
        (&devices, cluster.as_ref().map(|c| c.dist.bus.as_ref())),
    )
    .await?;
    // The stages hold the parameters' values now.
    built.tg.release_initial_values();
    laps.lap("opening the sessions");
    go_on()?;
    tracing::info!("ready to train in {}", laps.summary());
    let facts = run_facts(cfg, &prepared, &built, &computes, &opened);
    let (data, evaluation) = step_data(cfg, config_path, opened.batches, &built, fed_eval)?;
    let engine = EngineSettings {
        watchdog: Duration::from_secs_f64(cfg.watchdog_seconds),
        record_trace,
        evaluation,
        policy: cfg.grad_policy(),
        scaler: Some(scaler),
        checkpoint: checkpointing::checkpointer(cfg, facts)?,
        control,
        spin: stage_spin(local_actors),
        shards: hp,
        partial_stats: cfg.shards_optimizer_state(),
        ..EngineSettings::new(built.schedule, replicas)
    };
    let Prepared {
        model,
        first_step,
        resume,
        ..
    } = prepared;
    // The resumed checkpoint's tensors are in the stages now.
    drop(resume);
    let total = cfg.optimizer_steps() as u64;
    on_event(RunEvent::Started {
        first_step,
        total_steps: total,
        stages: built.assignment.stages,
        replicas: cfg.data_parallel_size,
    });
    let start = Instant::now();
    let on_step = step_reporter(cfg, start, board, on_event);
    let lr = cfg.lr_schedule.clone();
    let lr_at = Box::new(move |step| lr.lr_at(step, total));
    let run = (first_step..total, on_step);
    let gather = cfg.output_path.is_some();
    let stages = (built.stages.len(), built.tg.shards.as_ref(), gather);
    let (results, trace, parameters, peaks) =
        run_engine(&engine, computes, data, lr_at, run, cluster, stages).await?;
    let elapsed = start.elapsed();
    if reports {
        let done = first_step + results.len() as u64;
        save_trained(cfg, &model, &parameters, (done, total))?;
    }
    let ran = (first_step, elapsed, built.assignment.stages);
    let output = (results, trace, parameters, peaks);
    let mut done = summary(cfg, ran, &built.predicted, output);
    done.peak_memory = (predicted_peak, crate::telemetry::peak_resident_bytes());
    // Every process's own, where only the reporting one prints the closing line.
    if let (Some(peak), Some(part)) = (done.peak_memory.1, cluster_node) {
        tracing::info!(
            "node {part}: peak memory of this process: {:.2} GB (predicted {:.2} GB)",
            peak as f64 / 1e9,
            predicted_peak as f64 / 1e9
        );
    }
    Ok(done)
}

/// Drops the values of `model`'s initializers that train (their shapes and types stay):
/// the run ends by writing the trained values in their place.
fn strip_trained(model: &mut crate::onnx::proto::ModelProto, tg: &crate::graph::TrainingGraph) {
    let trained: std::collections::HashSet<String> = tg
        .whole_param_shapes()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for t in model
        .graph
        .iter_mut()
        .flat_map(|g| g.initializer.iter_mut())
    {
        if trained.contains(&t.name) {
            t.raw_data = Default::default();
            t.float_data = Vec::new();
        }
    }
}

/// The (replica, stage) computes this process holds: all of them, or its members'.
fn owned_computes<K: Collective>(
    built: &Built,
    replicas: usize,
    cluster: Option<&ClusterPart<K>>,
) -> Vec<(usize, usize)> {
    let placement = built.schedule.placement();
    (0..replicas)
        .flat_map(|r| (0..built.stages.len()).map(move |s| (r, s)))
        .filter(|&(r, s)| cluster.is_none_or(|c| c.owns(r, s, placement)))
        .collect()
}

/// TensorBoard's log and its tap on the stages' parameters, where this process writes
/// it and the configuration asks for one.
fn open_board(
    cfg: &TrainConfig,
    config_path: &Path,
    (built, owned): (&Built, &[(usize, usize)]),
    reports: bool,
) -> Result<(Option<super::board::Board>, Option<HistogramTap>)> {
    if !reports {
        return Ok((None, None));
    }
    let names: Vec<String> = built.tg.params.iter().map(|p| p.name.clone()).collect();
    // A split parameter's parts put together where every shard of replica 0's stages
    // runs here; else shard 0's part alone.
    let hp = cfg.horizontal_parallel_size;
    let stages_of = |r: usize| -> Vec<usize> {
        owned
            .iter()
            .filter(|&&(o, _)| o == r)
            .map(|&(_, s)| s)
            .collect()
    };
    let all_here = (1..hp).all(|r| stages_of(r) == stages_of(0));
    let split = built
        .tg
        .shards
        .as_ref()
        .filter(|_| all_here)
        .map(|p| &p.specs);
    Ok(super::board::Board::open(cfg, config_path, &names, split)?
        .map_or((None, None), |(b, tap)| (Some(b), tap)))
}

/// The stage actors' session settings, their intra-op threads chosen from the step's
/// work per node.
fn stage_session_options(cfg: &TrainConfig, built: &Built, actors: usize) -> SessionOptions {
    let work = flops_per_node(&built.tg);
    let threads = intra_op_threads(cfg, actors, work);
    tracing::info!(
        "ONNX Runtime intra-op threads per session: {threads} ({:.2} MFLOP per kernel of the step)",
        work / 1e6
    );
    session_options(cfg, actors, threads)
}

/// The trained model, where the configuration names an `output_path`, with how far it
/// trained in its metadata: `(done, total)` optimizer steps (a run stopped by a signal
/// writes `pipetrain.complete = false`).
fn save_trained(
    cfg: &TrainConfig,
    model: &crate::onnx::proto::ModelProto,
    parameters: &[(String, Tensor)],
    steps: (u64, u64),
) -> Result<()> {
    let Some(path) = &cfg.output_path else {
        return Ok(());
    };
    let trained: Vec<(&str, &Tensor)> = parameters.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    }
    let mut exported = export_inference_model(model, &trained)?;
    crate::graph::mark_trained_steps(&mut exported, steps);
    save_model(&exported, path)
}

/// The run's summary from what the engine handed back: `ran` is the first step, the time
/// the steps took and the stage count, `predicted` each stage's predicted stash peak.
fn summary(
    cfg: &TrainConfig,
    (first_step, elapsed, stages): (u64, Duration, usize),
    predicted: &[u64],
    (results, trace, parameters, peaks): EngineOutput,
) -> TrainSummary {
    TrainSummary {
        steps: results.len(),
        first_step,
        final_loss: results.last().map_or(f64::NAN, |s| s.loss),
        global_batch: cfg.global_batch(),
        elapsed,
        stages,
        parameters,
        trace,
        shard_traffic: (peaks.iter().filter_map(|p| p.shard_traffic)).reduce(|a, b| a + b),
        host_traffic: (peaks
            .iter()
            .filter_map(|p| Some((p.stage, p.host_traffic?))))
        .collect(),
        peak_memory: (0, None),
        stash: peaks
            .into_iter()
            .map(|p| StashPeak {
                stage: p.stage,
                measured: p.peak_stash as u64,
                predicted: predicted.get(p.stage).copied().unwrap_or(0),
            })
            .collect(),
    }
}

/// What a checkpoint records of the run.
fn run_facts(
    cfg: &TrainConfig,
    p: &Prepared,
    built: &Built,
    computes: &HashMap<(usize, usize), OrtStage>,
    opened: &OpenedData,
) -> checkpointing::RunFacts {
    let state_names: Vec<String> = computes
        .values()
        .next()
        .map(OrtStage::optimizer_state_names)
        .unwrap_or_default();
    let model_info = ModelInfo {
        path: cfg.model_path.clone(),
        spec: cfg.model.clone(),
        fingerprint: p.fingerprint.clone(),
        tensors: built.tg.params.len(),
        parameters: built
            .tg
            .whole_param_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum(),
    };
    checkpointing::RunFacts::new(
        cfg,
        (opened.order_len, opened.rows),
        model_info,
        state_names,
        built.stages.len(),
    )
}

/// The data actor's source: the stages' micro-batches (and token counts), and the
/// evaluation data when the run evaluates.
fn step_data(
    cfg: &TrainConfig,
    config_path: &Path,
    batches: Box<dyn StepBatches>,
    built: &Built,
    fed_eval: Option<Arc<dyn BatchSource>>,
) -> Result<(Arc<StepData>, Option<pipetrain_actors::EvalSettings>)> {
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    let reads = built.stages.iter().map(|s| s.io.data.clone()).collect();
    let mut data = StepData::new(batches, m, d, reads)
        .with_shards(cfg.horizontal_parallel_size)
        .with_seed(cfg.seed);
    if cfg.loss.normalize() == LossNormalize::Tokens {
        if let Some(label) = cfg.loss.label() {
            data = data.with_token_count(label, cfg.loss.ignore_index());
        }
    }
    let evaluation = match cfg.evaluation_period {
        Some(every) => {
            let k = cfg.eval_micro_batches;
            let eval: Box<dyn StepBatches> = match fed_eval {
                Some(source) => Box::new(FedBatches::new(source)),
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
    Ok((Arc::new(data), evaluation))
}

/// Turns each step's result into the run's events (and TensorBoard's log, which stops
/// with a warning if it cannot be written).
fn step_reporter<'a>(
    cfg: &'a TrainConfig,
    start: Instant,
    mut board: Option<super::board::Board>,
    on_event: &'a mut (dyn FnMut(RunEvent) + Send),
) -> impl FnMut(&StepResult) + Send + 'a {
    let mut last = Duration::ZERO;
    move |r: &StepResult| {
        let elapsed = r.ended.saturating_duration_since(start);
        let step_s = elapsed.saturating_sub(last).as_secs_f64().max(1e-9);
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
            peak_memory: crate::telemetry::peak_resident_bytes(),
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
    }
}
