//! `pipetrain plan`: the layout, cuts, schedule, micro-batches and recompute of a
//! training configuration, chosen from costs measured on this machine and a memory cap.
//!
//! # How
//! 1. [`profile`]: each forward node's time, and its backward's split into the
//!    input-gradient and weight-gradient parts ([`split`]), from ONNX Runtime's profiler on
//!    a few real steps, at every micro-batch size and thread count the candidates need.
//! 2. [`search`]: every layout of the workers (data × tensor × pipeline), schedule, micro-batch
//!    count and recompute; each one's cuts balanced by time ([`costs`]), its step simulated
//!    on this machine's shared cores with the optimizer step and the reduction on the
//!    timeline, its memory per rank from the memory model.
//! 3. Those over the cap are dropped; the rest ranked by predicted step. The best is
//!    written as a configuration `train` accepts as it is ([`write_config`]).
//! 4. [`verify`]: runs candidates for real and sets the measured step beside the
//!    predicted one.
//!
//! Tensor parallelism is searched where the model splits (each shard count's profile
//! runs shard 0's graph in a real split run). Layouts over several processes
//! (`--manifest`) are not: each worker is an actor of one process.

mod calibrate;
mod command;
pub mod costs;
mod machine;
mod ort_profile;
pub mod profile;
mod report;
mod rivals;
mod runs;
pub mod search;
pub mod split;
mod verify;
mod write;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

pub use command::{plan_command, PlanArgs};
pub use profile::{Profile, ProfileRun};
pub(crate) use report::layout_text;
pub use report::report;
pub use search::{Candidate, Machinery, Simulated};
pub use verify::{measure_step, Measured};
pub use write::{candidate_text, write_config};

use crate::compute::{intra_threads_for, Runtime};
use crate::config::TrainConfig;
use crate::graph::flops_per_node;
use crate::{Error, Result};

/// What to plan for.
pub struct PlanOptions<'a> {
    /// The `pipetrain` executable the profile runs use.
    pub worker: &'a Path,
    /// Workers (stage actors of one process) to lay out.
    pub workers: usize,
    /// Each worker's memory cap, bytes.
    pub memory_per_worker: Option<u64>,
    /// The most micro-batches per step to try.
    pub max_micro_batches: usize,
    /// Steps each profile runs (the first two not counted).
    pub profile_steps: usize,
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
}

impl PlanRow {
    /// Whether every rank fits `cap`.
    pub fn fits(&self, cap: Option<u64>) -> bool {
        cap.is_none_or(|c| self.peak.iter().all(|&p| p <= c))
    }
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
    /// Micro-batch sizes whose profile run failed, and why (a model exported with a
    /// fixed batch size trains only that size): their candidates are left out.
    pub skipped: Vec<(usize, String)>,
    /// Tensor-shard counts the model cannot be split into, and why.
    pub tp_skipped: Vec<(usize, String)>,
    /// Intra-op threads per session at these workers.
    pub threads: usize,
    /// The cap each rank must fit.
    pub cap: Option<u64>,
    /// Seconds spent profiling.
    pub profile_seconds: f64,
    /// The machine as measured.
    pub machinery: Machinery,
    /// Each forward node's time at the configuration's micro-batch (or the nearest
    /// profiled), for `partition = { balanced = { by = "time" } }`.
    pub node_times: Option<crate::graph::NodeTimes>,
}

impl Plan {
    /// The fastest candidate that fits.
    pub fn best(&self) -> Option<&PlanRow> {
        self.rows.iter().find(|r| r.fits(self.cap))
    }
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
    let whole = Sharded::of(rt, cfg, config_path, 1)?;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let threads = match cfg.runtime.intra_op_threads {
        Some(t) => t,
        None => intra_threads_for(flops_per_node(&whole.tg), cores / opts.workers.max(1)),
    };
    let (models, tp_skipped) = Sharded::all(rt, cfg, config_path, whole, opts.workers);
    let tps: Vec<usize> = models.iter().map(|m| m.tp).collect();
    let candidates = search::candidates(cfg, opts.workers, &tps, opts.max_micro_batches);
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
    };
    let (mut profiles, skipped) = profile_all(&run, (&models, cfg, opts), &candidates, threads);
    if profiles.is_empty() {
        let why: Vec<String> = skipped.iter().map(|(_, e)| e.clone()).collect();
        return Err(plan_error("profiling", why.join("; ")));
    }
    let unsplit: Vec<&Profile> = profiles.values().filter(|p| p.shards == 1).collect();
    let (step_overhead, action_gap) = profile::fit_overheads(&unsplit);
    for p in profiles.values_mut() {
        p.action_gap = action_gap;
    }
    let whole = &models[0];
    let sizes: Vec<&Profile> = profiles.values().filter(|p| p.shards == 1).collect();
    let predict = |b: usize, m: &Machinery| {
        let c = search::Candidate {
            dp: 2,
            tp: 1,
            pp: 1,
            schedule: crate::config::ScheduleKind::OneFOneB,
            virtual_stages: 1,
            micro_batches: cfg.global_batch() / (2 * b),
            micro_batch: b,
            recompute: crate::graph::Recompute::None,
        };
        let p = profiles.get(&(1, b))?;
        search::simulate_candidate(&c, p, (&whole.cut, &whole.values), m, None).map(|s| s.step)
    };
    let shape = (cores, threads, opts.workers, cfg.global_batch());
    let machinery = machine::measure(&run, &sizes, shape, step_overhead, &predict)?;
    calibrate_stage_runs(&mut profiles, whole, &machinery, cfg);
    let profile_seconds = started.elapsed().as_secs_f64();
    let nearest = profiles
        .values()
        .filter(|p| p.shards == 1)
        .min_by_key(|p| p.micro_batch.abs_diff(cfg.batch_size));
    let node_times = nearest.map(|p| costs::node_times(p, &whole.tg));
    let scale_of = |mb: usize| mb as f64 / cfg.batch_size as f64;
    let mut rows = Vec::new();
    for c in candidates {
        let (Some(model), Some(p)) = (
            models.iter().find(|m| m.tp == c.tp),
            profiles.get(&(c.tp, c.micro_batch)),
        ) else {
            continue;
        };
        let Some(sim) = search::simulate_candidate(&c, p, model.costs(), &machinery, None) else {
            continue;
        };
        let cuts = search::cut_names(&model.tg, &model.cut.live, &sim.bounds);
        // What `train` would refuse (1F1B with fewer micro-batches than stages, say).
        if c.apply(cfg, &cuts).validate(config_path).is_err() {
            continue;
        }
        let applied = c.apply(cfg, &cuts);
        let peak = crate::train::rank_bytes(&model.tg, &applied, scale_of(c.micro_batch))
            .unwrap_or_default();
        rows.push(PlanRow {
            candidate: c,
            cuts,
            simulated: sim,
            peak,
        });
    }
    rows.sort_by(|a, b| a.simulated.step.total_cmp(&b.simulated.step));
    let fixed = rivals::Fixed {
        cfg,
        models: &models,
        machinery: &machinery,
        profiles: &profiles,
    };
    let default = fixed.default_row(opts);
    let best_pipeline = rows
        .iter()
        .find(|r| r.candidate.pp > 1 && r.fits(opts.memory_per_worker));
    let cut_rivals = best_pipeline.map_or_else(Vec::new, |r| fixed.cut_rivals(&r.candidate));
    Ok(Plan {
        rows,
        default,
        cut_rivals,
        profiles: profiles.into_values().collect(),
        skipped,
        tp_skipped,
        threads,
        cap: opts.memory_per_worker,
        profile_seconds,
        machinery,
        node_times,
    })
}

/// The model as a layout of `tp` tensor shards sees it: shard 0's training graph, where
/// it can be cut, and each forward node's parameter values (a shard's part of a split
/// parameter).
pub(crate) struct Sharded {
    /// Tensor shards.
    pub tp: usize,
    /// Shard 0's training graph.
    pub tg: crate::graph::TrainingGraph,
    /// Where it can be cut.
    pub cut: costs::Cuttable,
    /// Each forward node's parameter values.
    pub values: Vec<f64>,
}

impl Sharded {
    fn of(rt: &Runtime, cfg: &TrainConfig, config_path: &Path, tp: usize) -> Result<Sharded> {
        let mut c = cfg.clone();
        c.horizontal_parallel_size = tp;
        let tg = crate::train::graph_of(rt, &c, config_path)?;
        Ok(Sharded {
            tp,
            cut: costs::Cuttable::of(&tg),
            values: search::node_values(&tg),
            tg,
        })
    }

    /// `whole` and the model split at every shard count above 1 that divides `workers`
    /// and the model allows; the counts it does not, with why.
    fn all(
        rt: &Runtime,
        cfg: &TrainConfig,
        config_path: &Path,
        whole: Sharded,
        workers: usize,
    ) -> (Vec<Sharded>, Vec<(usize, String)>) {
        let (mut models, mut refused) = (vec![whole], Vec::new());
        for tp in (2..=workers).filter(|t| workers % t == 0) {
            match Sharded::of(rt, cfg, config_path, tp) {
                Ok(m) => models.push(m),
                Err(e) => refused.push((tp, e.to_string())),
            }
        }
        (models, refused)
    }

    /// What simulating a candidate needs of the model.
    pub fn costs(&self) -> (&costs::Cuttable, &[f64]) {
        (&self.cut, &self.values)
    }
}

/// The fewest pipeline stages (dividing the workers) in which the memory model predicts
/// every rank of `tg`'s model to fit the cap at micro-batches of `micro_batch`, for a
/// profile's runs: 1 without a cap; the workers where none fits (the runs may then fail,
/// and the plan says what is short).
fn stages_that_fit(
    tg: &crate::graph::TrainingGraph,
    (cfg, opts): (&TrainConfig, &PlanOptions<'_>),
    micro_batch: usize,
) -> usize {
    let Some(cap) = opts.memory_per_worker else {
        return 1;
    };
    let workers = opts.workers.max(1);
    let activations = micro_batch as f64 / cfg.batch_size.max(1) as f64;
    let fits = |k: usize| {
        let mut c = cfg.clone();
        (c.data_parallel_size, c.pipeline_parallel_size) = (1, k);
        c.gradient_accumulation_steps = cfg.global_batch() / micro_batch.max(1);
        c.pipeline.schedule = crate::config::ScheduleKind::ZbH1;
        c.pipeline.virtual_stages = 1;
        c.pipeline.partition = None;
        let ranks = crate::train::rank_bytes(tg, &c, activations);
        ranks.is_ok_and(|r| r.iter().all(|&b| b <= cap))
    };
    (1..=workers)
        .filter(|k| workers % k == 0)
        .find(|&k| fits(k))
        .unwrap_or(workers)
}

/// Profiles by (tensor shards, micro-batch).
pub(crate) type Profiles = BTreeMap<(usize, usize), Profile>;

/// Profiles every (tensor shards, micro-batch) the candidates need, largest micro-batch
/// first; a size whose run fails (a model exported with a fixed batch) is left out with
/// why.
fn profile_all(
    run: &ProfileRun<'_>,
    (models, cfg, opts): (&[Sharded], &TrainConfig, &PlanOptions<'_>),
    candidates: &[search::Candidate],
    threads: usize,
) -> (Profiles, Vec<(usize, String)>) {
    let mut profiles = BTreeMap::new();
    let mut skipped = Vec::new();
    // Unsplit first (a size it cannot train, a split model cannot either), each largest
    // micro-batch first.
    let mut needed: Vec<(usize, usize)> =
        candidates.iter().map(|c| (c.tp, c.micro_batch)).collect();
    needed.sort_unstable_by_key(|&(tp, b)| (tp, std::cmp::Reverse(b)));
    needed.dedup();
    for &(tp, b) in &needed {
        let Some(model) = models.iter().find(|m| m.tp == tp) else {
            continue;
        };
        if skipped.iter().any(|(s, _)| *s == b) {
            continue;
        }
        tracing::info!("profiling micro-batches of {b} at {threads} thread(s), {tp} shard(s)");
        // A model no worker holds whole runs in as few pipeline stages as hold it.
        let stages = stages_that_fit(&model.tg, (cfg, opts), b);
        let sharded = ProfileRun {
            shards: tp,
            stages,
            pipelines: run.pipelines && tp == 1,
            ..*run
        };
        match profile::measure(&sharded, &model.tg, threads, b) {
            Ok(p) => {
                profiles.insert((tp, b), p);
            }
            Err(e) if tp == 1 => skipped.push((b, e.to_string())),
            Err(e) => tracing::warn!("{e}: layouts of {tp} shards left out"),
        }
    }
    (profiles, skipped)
}

/// Each unsplit profile's per-action stage cost calibrated against its two-stage run (a
/// size too large for one, the nearest calibrated size's: the cost is the action's, not
/// its values'); a split model's profile takes the unsplit one's at its micro-batch.
fn calibrate_stage_runs(
    profiles: &mut Profiles,
    whole: &Sharded,
    machinery: &Machinery,
    cfg: &TrainConfig,
) {
    let calibrated: BTreeMap<usize, f64> = profiles
        .iter()
        .filter(|((tp, _), _)| *tp == 1)
        .filter_map(|(&(_, b), p)| Some((b, calibrate::stage_run(p, whole, machinery, cfg)?)))
        .collect();
    let nearest = |b: usize| {
        let by_distance = calibrated.iter().min_by_key(|(&c, _)| c.abs_diff(b));
        by_distance.map_or(0.0, |(_, &cost)| cost)
    };
    for (&(_, b), p) in profiles.iter_mut() {
        p.stage_run = nearest(b);
    }
}

/// An error of the planner's own.
pub(crate) fn plan_error(what: &str, reason: impl Into<String>) -> Error {
    Error::Plan {
        what: what.into(),
        reason: reason.into(),
    }
}
