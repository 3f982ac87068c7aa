//! `pipetrain plan`: the layout, cuts, schedule, micro-batches, recompute and ZeRO stage
//! of a training configuration, chosen from costs measured on this machine and a memory cap.
//!
//! # How
//! 1. [`profile`]: each forward node's time, and its backward's split into the
//!    input-gradient and weight-gradient parts (`cost::split`), from ONNX Runtime's profiler on
//!    a few real steps, at every micro-batch size and tensor-shard count the candidates
//!    need (`measured`; in pipeline stages where one worker cannot hold the model under
//!    the cap); the machine's hand-offs, interference and replica costs (`machine`); a
//!    stage's own cost calibrated against the recorded pipeline run (`calibrate`).
//! 2. [`search`]: every layout of the workers (data × tensor × pipeline), schedule, micro-batch
//!    count, recompute and (with replicas) the ZeRO stage; each one's cuts balanced by time (`cost::stages`), its step simulated
//!    on this machine's shared cores with the optimizer step and the reduction on the
//!    timeline, its memory per rank from the memory model.
//! 3. Those over the cap are dropped; the rest ranked by predicted step, a layout that
//!    recomputes after its twin without where they tie (`rank`). The best (or the
//!    rank `--pick` names) is written as a configuration `train` accepts as it is
//!    ([`write_config`]).
//! 4. [`verify`]: runs candidates for real and sets the measured step beside the
//!    predicted one (`proof`: in rounds, beside a control run of the profile's that says
//!    how far the machine drifted, `control`).
//!
//! Tensor parallelism is searched where the model splits (each shard count's profile
//! runs shard 0's graph in a real split run). With a cluster manifest (`--manifest`),
//! the workers are its nodes' slots, one `pipetrain launch` process a node: what leaves a
//! node crosses the link measured through pipetrain's transport (`link`), the
//! reductions whose replicas span nodes run the mesh's ring (`cost::Nodes`), and
//! `--measure` launches the nodes of a manifest on this machine (`cluster`).

mod cache;
mod calibrate;
#[cfg(feature = "cluster")]
mod cluster;
#[cfg(feature = "cluster")]
mod cluster_calibrate;
#[cfg(feature = "cluster")]
mod command;
#[cfg(feature = "cluster")]
mod control;
mod fits;
mod fixed_batch;
#[cfg(feature = "cluster")]
mod link;
mod machine;
mod measured;
mod ort_profile;
mod overlap;
mod passes;
pub mod process;
pub mod profile;
#[cfg(feature = "cluster")]
mod proof;
#[cfg(feature = "cluster")]
mod proof_text;
mod rank;
mod report;
mod rivals;
mod rounds;
mod runs;
pub mod search;
mod shares;
mod verify;
mod write;

use std::path::Path;
use std::time::Instant;

#[cfg(feature = "cluster")]
pub use command::{plan_command, PlanArgs};
pub use fits::Caps;
use measured::{calibrate_stage_overheads, measure_all};
pub(crate) use measured::{Profiles, Sharded};
pub use profile::{Profile, ProfileRun};
#[cfg(feature = "cluster")]
pub(crate) use report::layout_text;
pub use report::report;
pub use search::{Candidate, Machinery, Simulated};
pub use verify::{measure_step, Measured};
pub use write::{candidate_text, write_config};

use crate::compute::{intra_threads_for, Runtime};
use crate::config::TrainConfig;
use crate::cost::{Link, Nodes};
use crate::graph::flops_per_node;
use crate::{Error, Result};

/// What to plan for.
pub struct PlanOptions<'a> {
    /// The `pipetrain` executable the profile runs use.
    pub worker: &'a Path,
    /// Workers (stage actors of one process) to lay out.
    pub workers: usize,
    /// The memory caps each layout must fit.
    pub caps: Caps,
    /// What this process held when it started, with ONNX Runtime loaded (`None`: now).
    pub baseline: Option<process::Baseline>,
    /// The most micro-batches per step to try.
    pub max_micro_batches: usize,
    /// Steps each profile runs (the first two not counted).
    pub profile_steps: usize,
    /// Rounds of the profile's timed runs, each profile the median of its rounds.
    pub profile_rounds: usize,
    /// Where the measurements are kept between plans (`cache`): read when made for this
    /// plan, else measured and written.
    pub profile_cache: Option<&'a Path>,
    /// The nodes of a cluster the workers are spread over (one process a node); `None`:
    /// one process.
    pub cluster: Option<ClusterOptions>,
}

/// A cluster's nodes as the plan weighs them.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The nodes' slots and machines.
    pub nodes: Nodes,
    /// The link between two nodes.
    pub link: Link,
    /// The manifest to calibrate what a stage's message between nodes costs against, a
    /// job launched on its nodes (all on this machine, and the link measured, not
    /// given).
    #[cfg(feature = "cluster")]
    pub calibrate: Option<crate::cluster::ClusterManifest>,
}

/// One candidate's outcome.
#[derive(Debug, Clone)]
pub struct PlanRow {
    /// The layout.
    pub candidate: Candidate,
    /// The tensors ending each stage but the last.
    pub cuts: Vec<String>,
    /// Its simulated step.
    pub simulated: Simulated,
    /// Predicted peak bytes per pipeline rank.
    pub peak: Vec<u64>,
    /// Predicted peak bytes per process: the ranks it holds and what it holds beside
    /// them (`process`).
    pub processes: Vec<u64>,
}

/// A finished plan: every candidate that could be simulated, fastest first, and the
/// layout a user would write by default for comparison.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Candidates, by predicted step.
    pub rows: Vec<PlanRow>,
    /// 1F1B, as many micro-batches as ranks, cuts by parameter count.
    pub default: Option<PlanRow>,
    /// The fastest pipeline layout's cuts balanced by parameters and by FLOPs instead of
    /// time (`"params"`, `"flops"`), for comparison.
    pub cut_rivals: Vec<(&'static str, PlanRow)>,
    /// The profiles, by (tensor shards, micro-batch).
    pub profiles: Vec<Profile>,
    /// Micro-batch sizes whose profile run failed, and why: their candidates are left
    /// out. (A model exported with a fixed batch is planned at that size alone:
    /// `fixed_batch`.)
    pub skipped: Vec<(usize, String)>,
    /// Tensor-shard counts the model cannot be split into, and why.
    pub tp_skipped: Vec<(usize, String)>,
    /// Intra-op threads per session at these workers.
    pub threads: usize,
    /// The caps each layout must fit.
    pub cap: Caps,
    /// What each process holds beside its ranks, as measured here.
    pub process_base: process::ProcessBase,
    /// Seconds spent profiling.
    pub profile_seconds: f64,
    /// The profile cache the measurements were read from, and how many seconds before
    /// they were measured (`None`: measured now).
    pub profile_read: Option<(std::path::PathBuf, Option<u64>)>,
    /// The machine as measured.
    pub machinery: Machinery,
    /// The profile at the configuration's micro-batch (or the nearest profiled) by node
    /// name, for `partition = { balanced = { by = "time" } }`.
    pub node_times: Option<crate::cost::SavedProfile>,
    /// The cluster's nodes, where the layouts span several.
    pub nodes: Option<Nodes>,
    /// Layouts left out because a stage's tensor shards would span nodes.
    pub shards_across_nodes: usize,
    /// The model's input declared with a fixed batch, and that batch: the only
    /// micro-batch size planned.
    pub fixed_batch: Option<(String, usize)>,
}

/// Plans `cfg` (read from `config_path`).
///
/// # Errors
/// The model, data or graph cannot be built; a profile run fails.
pub fn plan(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    opts: &PlanOptions<'_>,
) -> Result<Plan> {
    // Built as `train` builds it, what the process holds measured beside it.
    let (tg, process_base) = process::ProcessBase::measure(
        || crate::train::graph_of(rt, cfg, config_path),
        cfg.batch_size,
        opts.baseline.unwrap_or_else(process::Baseline::now),
    )?;
    process_base.check_room(opts.caps.process.as_ref())?;
    let whole = Sharded::from_graph(tg, 1, cfg.batch_size);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let nodes = opts.cluster.as_ref().map(|c| &c.nodes);
    // Workers on each machine: nodes on other machines bring cores of their own.
    let hosts = nodes.map_or(1, |n| n.hosts.max(1));
    let per_host = opts.workers.div_ceil(hosts).max(1);
    let threads = match cfg.runtime.intra_op_threads {
        Some(t) => t,
        None => intra_threads_for(flops_per_node(&whole.tg), cores / per_host),
    };
    let (models, tp_skipped) = Sharded::all(rt, cfg, config_path, whole, opts.workers);
    let tps: Vec<usize> = models.iter().map(|m| m.tp).collect();
    let mut candidates = search::candidates(cfg, opts.workers, &tps, opts.max_micro_batches);
    let fixed_batch = fixed_batch::keep_its_size(cfg, opts.workers, &mut candidates)?;
    let before = candidates.len();
    candidates.retain(|c| nodes.is_none_or(|n| !n.splits_shards(c)));
    let shards_across_nodes = before - candidates.len();
    let started = Instant::now();
    let run = ProfileRun {
        worker: opts.worker,
        config: config_path,
        steps: opts.profile_steps.max(3),
        warmup: 2,
        global_batch: cfg.global_batch(),
        pipelines: opts.workers >= 2,
        shards: 1,
        stages: 1,
        cuts: &[],
    };
    let measure = || {
        let m = measure_all(&run, (&models, cfg, opts), &candidates, (threads, started))?;
        Ok(cache::Measured {
            process: Some(process_base),
            ..m
        })
    };
    let (measured, read) = match opts.profile_cache {
        Some(path) => {
            let made_for =
                cache::MadeFor::of((cfg, config_path), opts, (cores, threads, run.steps))?;
            cache::load_or_measure(path, &made_for, measure)?
        }
        None => (measure()?, false),
    };
    // The cache's where it kept one: a plan from it is the same plan.
    let process_base = measured.process.unwrap_or(process_base);
    let whole = &models[0];
    let (profiles, here) = fitted(&measured, whole, cfg, (cores, threads, opts.workers));
    // ZeRO stage 2 where its cost was measured.
    candidates.retain(|c| c.zero < 2 || here.zero2_per_value.is_some());
    let profile_seconds = measured.seconds;
    let profile_read = opts.profile_cache.filter(|_| read);
    let profile_read = profile_read.map(|p| (p.to_path_buf(), measured.age()));
    let nearest = profiles
        .values()
        .filter(|p| p.shards == 1)
        .min_by_key(|p| p.micro_batch.abs_diff(cfg.batch_size));
    let node_times = nearest.map(|p| crate::cost::SavedProfile::of(p, &whole.tg, &here));
    let machinery = on_cluster(&run, opts, (&profiles, whole), &here, hosts);
    let rows = search::simulated_rows(
        candidates,
        (cfg, config_path),
        &models,
        &profiles,
        (&machinery, nodes),
        &process_base,
    );
    let fixed = rivals::Fixed {
        cfg,
        models: &models,
        machinery: &machinery,
        profiles: &profiles,
        nodes,
        process_base: &process_base,
    };
    let default = fixed.default_row(opts);
    let best_pipeline = rows
        .iter()
        .find(|r| r.candidate.pp > 1 && r.fits(&opts.caps));
    let cut_rivals = best_pipeline.map_or_else(Vec::new, |r| fixed.cut_rivals(&r.candidate));
    Ok(Plan {
        rows,
        default,
        cut_rivals,
        profiles: profiles.into_values().collect(),
        skipped: measured.skipped.clone(),
        tp_skipped,
        threads,
        cap: opts.caps.clone(),
        process_base,
        profile_seconds,
        profile_read,
        machinery,
        node_times,
        nodes: nodes.cloned(),
        shards_across_nodes,
        fixed_batch,
    })
}

/// The profiles by size with the fitted overheads and their stage runs calibrated, and
/// the machine as its runs measured it (`shape`: cores, threads a session, workers).
fn fitted(
    measured: &cache::Measured,
    whole: &Sharded,
    cfg: &TrainConfig,
    shape: (usize, usize, usize),
) -> (Profiles, Machinery) {
    let mut profiles = measured.by_size();
    let unsplit: Vec<&Profile> = profiles.values().filter(|p| p.shards == 1).collect();
    let (step_overhead, action_gap) = profile::fit_overheads(&unsplit);
    for p in profiles.values_mut() {
        p.action_gap = action_gap;
    }
    let sizes: Vec<&Profile> = profiles.values().filter(|p| p.shards == 1).collect();
    // Two replicas of one stage at micro-batches of `b`: the machine's own runs.
    let predict = |b: usize, zero: u8, m: &Machinery| {
        let c = search::Candidate {
            zero,
            ..search::Candidate::one_f_one_b((2, 1, 1), (cfg.global_batch() / (2 * b), b))
        };
        let p = profiles.get(&(1, b))?;
        search::simulate_candidate(&c, p, (&whole.cut, &whole.values), m, None).map(|s| s.step)
    };
    let here = machine::machinery(&measured.machine, &sizes, shape, step_overhead, &predict);
    calibrate_stage_overheads(&mut profiles, whole, &here, cfg);
    (profiles, here)
}

/// The machine the layouts are simulated on: `here`'s, and over a cluster its hosts'
/// cores pooled (each node's ranks taken as sharing the pool evenly) and the link its
/// nodes cross, calibrated against launched jobs where the manifest asks.
fn on_cluster(
    run: &ProfileRun<'_>,
    opts: &PlanOptions<'_>,
    (profiles, whole): (&Profiles, &Sharded),
    here: &Machinery,
    hosts: usize,
) -> Machinery {
    let link = opts.cluster.as_ref().map(|c| c.link);
    let (contention, replica_sync) = (here.contention, here.replica_sync);
    #[cfg(feature = "cluster")]
    let (link, contention, replica_sync) = match opts.cluster.as_ref().filter(|_| opts.workers >= 2)
    {
        Some(ClusterOptions {
            nodes,
            link,
            calibrate: Some(manifest),
        }) => {
            let at = (manifest, nodes, *link);
            let c = cluster_calibrate::calibrate(run, profiles, (whole, here), at);
            (Some(c.link), c.contention, c.replica_sync)
        }
        _ => (link, contention, replica_sync),
    };
    #[cfg(not(feature = "cluster"))]
    let _ = (run, profiles, whole);
    Machinery {
        cores: here.cores * hosts,
        link,
        contention,
        replica_sync,
        ..*here
    }
}

/// An error of the planner's own.
pub(crate) fn plan_error(what: &str, reason: impl Into<String>) -> Error {
    Error::Plan {
        what: what.into(),
        reason: reason.into(),
    }
}
