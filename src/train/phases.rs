//! The phases of a run before it trains, each a function of what the one before made:
//! the model and the checkpoint it resumes ([`prepare`]), the data ([`open_data`]), the
//! graphs and the schedule ([`build_graphs`]), and the stage computes this process
//! runs ([`make_computes`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::Schedule;

use super::replica_links::{join_device_replicas, MemberDevices};
use super::settings::{replica_settings, stage_settings, training_graph, warn_about_model};
use super::{apply_init, checkpointing, RunEvent};
use crate::checkpoint::{model_fingerprint, LoadedCheckpoint};
use crate::compute::{check_device, HostPool, LocalShards, Runtime, SessionOptions, ShardLink};
use crate::config::TrainConfig;
use crate::data::{open_step_batches, read_safetensors, BatchSource, FedBatches, StepBatches};
use crate::graph::{
    assign_stages, build_stage_graphs_with, with_tied_shared, StageAssignment, StageGraphs,
    TrainingGraph,
};
use crate::onnx::proto::ModelProto;
use crate::onnx::save_model;
use crate::pipeline::OrtStage;
use crate::pipeline::{HistogramTap, StageSettings};
use crate::{Error, Result};

/// The model as it trains, and where it starts.
pub(super) struct Prepared {
    pub model: ModelProto,
    /// The model file's fingerprint, before `init_path` changed any weight.
    pub fingerprint: String,
    pub resume: Option<LoadedCheckpoint>,
    /// The first step this run trains (0, or the checkpoint's).
    pub first_step: u64,
}

/// Mixed precision casts float32 products to half and back: a model with parameters of
/// another float type is refused, naming one.
fn mixed_precision_fits(model: &crate::onnx::proto::ModelProto, config_path: &Path) -> Result<()> {
    use crate::tensor::DType;
    let inits = model.graph.iter().flat_map(|g| &g.initializer);
    let other = inits
        .filter_map(|t| Some((t, DType::from_onnx(t.data_type)?)))
        .find(|(_, d)| d.is_float() && *d != DType::F32);
    match other {
        Some((t, d)) => Err(Error::Config {
            path: config_path.to_path_buf(),
            field: "use_mixed_precision".into(),
            rule: format!(
                "needs a float32 model; its initializer `{}` is {d:?}",
                t.name
            ),
        }),
        None => Ok(()),
    }
}

/// Checks the device, loads the model (and `init_path`'s weights), and the checkpoint to
/// resume from, reporting what changed since it was written.
pub(super) fn prepare(
    cfg: &TrainConfig,
    config_path: &Path,
    on_event: &mut (dyn FnMut(RunEvent) + Send),
) -> Result<Prepared> {
    check_device(cfg.runtime.device).map_err(|rule| Error::Config {
        path: config_path.to_path_buf(),
        field: "runtime.device".into(),
        rule,
    })?;
    for (i, &device) in cfg.runtime.devices.iter().enumerate() {
        check_device(device).map_err(|rule| Error::Config {
            path: config_path.to_path_buf(),
            field: format!("runtime.devices[{i}]"),
            rule,
        })?;
    }
    let mut model = cfg.load_model()?;
    warn_about_model(cfg, &model)?;
    if cfg.use_mixed_precision {
        mixed_precision_fits(&model, config_path)?;
        if cfg.runtime.device == crate::compute::Device::Cpu {
            tracing::warn!(
                "use_mixed_precision on the CPU: ONNX Runtime's CPU provider has float16 \
                 kernels for few products and runs the others in float32; it pays on a GPU"
            );
        }
    }
    let fingerprint = model_fingerprint(&model);
    if let Some(init) = &cfg.init_path {
        apply_init(&mut model, &read_safetensors(init)?, init)?;
    }
    let (resume, changes) = checkpointing::load_resume(cfg, &fingerprint)?;
    for change in changes {
        on_event(RunEvent::Warning(change));
    }
    let first_step = resume.as_ref().map_or(0, |c| c.manifest.steps_done);
    Ok(Prepared {
        model,
        fingerprint,
        resume,
        first_step,
    })
}

/// The run's batches, checked against the model.
pub(super) struct OpenedData {
    pub batches: Box<dyn StepBatches>,
    /// Steps in the data's batch order, when it has one.
    pub order_len: Option<usize>,
    /// Rows of data.
    pub rows: usize,
    /// The replica whose first micro-batch measures the shapes.
    pub probe: usize,
}

/// Opens the data (the configuration's, or an embedder's `fed` source) and checks it
/// against `p`'s model. `probe` is the lowest replica this process runs: with shards
/// split by files, a process reads no other replica's files.
pub(super) fn open_data(
    cfg: &TrainConfig,
    config_path: &Path,
    fed: Option<Arc<dyn BatchSource>>,
    p: &Prepared,
    probe: usize,
) -> Result<OpenedData> {
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    let is_fed = fed.is_some();
    let (batches, order_len, rows): (Box<dyn StepBatches>, _, _) = match fed {
        Some(source) => (Box::new(FedBatches::new(source)), None, 0),
        None => open_step_batches(&cfg.data, cfg.global_batch(), d, config_path)?,
    };
    // Shapes are measured on the first micro-batch of the first step the run trains (an
    // embedder's source starts there), of a replica this process runs.
    let example = batches.part(p.first_step as usize, probe * m, d * m)?;
    let batches = super::data_rules::checked_batches(cfg, &p.model, batches, &example, is_fed)?;
    Ok(OpenedData {
        batches,
        order_len,
        rows,
        probe,
    })
}

/// The graphs of the run and its schedule.
pub(super) struct Built {
    pub tg: TrainingGraph,
    pub assignment: StageAssignment,
    pub stages: Vec<StageGraphs>,
    pub schedule: Schedule,
    /// Per stage, the stash's predicted peak bytes.
    pub predicted: Vec<u64>,
}

/// Builds the training graph (measuring shapes on the first micro-batch), writes the
/// debugging models asked for, checks the resumed checkpoint against it, and cuts it
/// into stages under the configured schedule.
pub(super) fn build_graphs(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    p: &Prepared,
    data: &OpenedData,
) -> Result<Built> {
    let tg = training_graph(
        rt,
        cfg,
        &p.model,
        data.batches.as_ref(),
        p.first_step as usize,
        data.probe,
    )?;
    if let Some(plan) = &tg.shards {
        tracing::info!("{}", plan.summary());
    }
    // Graph building's probes and copies are freed now; glibc keeps freed heap in the
    // process unless asked (tiny_gpt: resident memory 88 -> 45 MiB here, and the run's
    // peak from 134 to 103 MiB).
    release_freed_memory();
    // The graphs written for users hold no fused kernels (the CPU's or the GPU's): the
    // same graph built without them (a split graph keeps its collectives).
    let written =
        cfg.model_with_training_graph_path.is_some() || cfg.model_with_loss_func_path.is_some();
    let gpu_kernels = cfg.runtime.cuda_kernels && cfg.runtime.device != crate::compute::Device::Cpu;
    let standard = match (written, cfg.runtime.fused_kernels || gpu_kernels) {
        (true, true) => {
            let mut plain = cfg.clone();
            plain.runtime.fused_kernels = false;
            plain.runtime.cuda_kernels = false;
            let (step, probe) = (p.first_step as usize, data.probe);
            Some(training_graph(
                rt,
                &plain,
                &p.model,
                data.batches.as_ref(),
                step,
                probe,
            )?)
        }
        _ => None,
    };
    write_debug_models(cfg, standard.as_ref().unwrap_or(&tg))?;
    if let Some(ckpt) = &p.resume {
        ckpt.check_model(&tg.whole_param_shapes())?;
    }
    check_param_groups(cfg, config_path, &tg)?;
    let (shared, assignment) =
        with_tied_shared(&tg, assign_stages(&tg, &crate::cost::partition(&tg, cfg)?)?);
    let shared: Option<TrainingGraph> = match shared {
        Cow::Owned(t) => Some(t),
        Cow::Borrowed(_) => None,
    };
    let tg = shared.unwrap_or(tg);
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
    let predicted = super::memory::predicted_stash(&tg, &stages, &schedule);
    Ok(Built {
        tg,
        assignment,
        stages,
        schedule,
        predicted,
    })
}

/// `model_with_loss_func_path` and `model_with_training_graph_path`, when set.
fn write_debug_models(cfg: &TrainConfig, tg: &TrainingGraph) -> Result<()> {
    let models = [
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
    ];
    for (path, built) in models {
        if let (Some(path), Some(model)) = (path, built) {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
            }
            save_model(&model?, path)?;
        }
    }
    Ok(())
}

/// The most bytes of spent stage outputs a process keeps for reuse.
const HOST_POOL_BYTES: usize = 256 << 20;

/// The stage computes of the (replica, stage) pairs in `owned`, each on its device
/// (`devices`; else `session_opts`'), with their debugging faults, restored from the
/// checkpoint when resuming; replica 0's feed the histograms. `bus` joins the job's
/// processes, where it has several.
pub(super) async fn make_computes(
    rt: &Runtime,
    cfg: &TrainConfig,
    built: &Built,
    (owned, groups): (&[(usize, usize)], Option<&dyn crate::compute::ShardGroups>),
    (session_opts, scale): (&SessionOptions, f64),
    (tap, resume): (Option<HistogramTap>, Option<&LoadedCheckpoint>),
    (devices, bus): (&MemberDevices, Option<&dyn pipetrain_actors::Bus>),
) -> Result<HashMap<(usize, usize), OrtStage>> {
    let settings = stage_settings(cfg, scale);
    let mut links = match groups {
        Some(g) if cfg.horizontal_parallel_size > 1 => {
            owned.iter().map(|&(r, s)| ((r, s), g.link(r, s))).collect()
        }
        _ => shard_links(cfg, owned)?,
    };
    let mut planned: Vec<((usize, usize), StageSettings)> = owned
        .iter()
        .map(|&(replica, s)| {
            let mut st = replica_settings(cfg, &settings, (replica, s), tap.as_ref());
            st.shard = links.remove(&(replica, s));
            ((replica, s), st)
        })
        .collect();
    let stages = built.stages.len();
    join_device_replicas(cfg, session_opts, (&mut planned, devices), stages, bus).await?;
    let mut computes = HashMap::new();
    // The stages' outputs, freed a few actions after they are made, come back for the
    // next micro-batch's (`compute::HostPool`); on the host only.
    let pool = (session_opts.device == crate::compute::Device::Cpu)
        .then(|| HostPool::new(HOST_POOL_BYTES));
    for ((replica, s), st) in planned {
        let opts = SessionOptions {
            device: devices
                .get(&(replica, s))
                .copied()
                .unwrap_or(session_opts.device),
            ..*session_opts
        };
        let mut stage = OrtStage::new(rt, &built.tg, &built.stages[s], &opts, &st)?;
        if let Some(pool) = &pool {
            stage.use_host_pool(pool);
        }
        if let Some(ckpt) = resume {
            stage.restore(ckpt)?;
        }
        computes.insert((replica, s), stage);
    }
    Ok(computes)
}

/// Each tensor shard's collective handle, by (engine replica, stage), when the model is
/// split (`horizontal_parallel_size > 1`) in a run of one process: the shards of a
/// data-parallel replica's stage meet in a group of this process. A shard waits for the others as long as the
/// watchdog lets a run stand still.
///
/// # Errors
/// `Config` when a group's shards are not all in this process.
fn shard_links(
    cfg: &TrainConfig,
    owned: &[(usize, usize)],
) -> Result<HashMap<(usize, usize), ShardLink>> {
    let hp = cfg.horizontal_parallel_size;
    if hp <= 1 {
        return Ok(HashMap::new());
    }
    let patience = Duration::from_secs_f64(cfg.watchdog_seconds);
    let mut groups: HashMap<(usize, usize), Arc<LocalShards>> = HashMap::new();
    let mut links = HashMap::new();
    for &(replica, s) in owned {
        let (dp, rank) = (replica / hp, replica % hp);
        let whole = (0..hp).all(|k| owned.contains(&(dp * hp + k, s)));
        if !whole {
            return Err(Error::TensorParallel {
                node: format!("stage {s} of data-parallel replica {dp}"),
                rule: format!("its {hp} tensor shards must run in one process"),
            });
        }
        let group = groups
            .entry((dp, s))
            .or_insert_with(|| LocalShards::new(hp, patience));
        links.insert((replica, s), group.link(rank));
    }
    Ok(links)
}

/// Gives memory the allocator holds but no longer uses back to the system (glibc's
/// `malloc_trim`; elsewhere nothing to do).
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free heap pages to the system; it touches no
    // live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Refuses a `[[optimizer_attributes]]` pattern that matches none of the model's
/// parameters (a typo would otherwise leave the group silently empty).
fn check_param_groups(cfg: &TrainConfig, config_path: &Path, tg: &TrainingGraph) -> Result<()> {
    let names: Vec<&str> = tg.params.iter().map(|p| p.name.as_str()).collect();
    match crate::optim::unmatched_patterns(&cfg.optimizer_attributes, &names).first() {
        None => Ok(()),
        Some((i, pattern)) => Err(Error::Config {
            path: config_path.to_path_buf(),
            field: format!("optimizer_attributes[{i}].params"),
            rule: format!(
                "`{pattern}` matches none of the model's {} parameters (e.g. `{}`)",
                names.len(),
                names[..names.len().min(3)].join("`, `")
            ),
        }),
    }
}
