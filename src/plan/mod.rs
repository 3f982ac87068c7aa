//! `pipetrain plan`: the layout, cuts, schedule, micro-batches and recompute of a
//! training configuration, chosen from costs measured on this machine and a memory cap.
//!
//! # How
//! 1. [`profile`]: each forward node's time, and its backward's split into the
//!    input-gradient and weight-gradient parts ([`split`]), from ONNX Runtime's profiler on
//!    a few real steps, at every micro-batch size and thread count the candidates need.
//! 2. [`search`]: every layout of the workers (data × pipeline), schedule, micro-batch
//!    count and recompute; each one's cuts balanced by time ([`costs`]), its step simulated
//!    on this machine's shared cores with the optimizer step and the reduction on the
//!    timeline, its memory per rank from the memory model.
//! 3. Those over the cap are dropped; the rest ranked by predicted step. The best is
//!    written as a configuration `train` accepts as it is ([`write_config`]).
//! 4. [`verify`]: runs candidates for real and sets the measured step beside the
//!    predicted one.
//!
//! Tensor parallelism is not searched yet (it needs a model it can split), nor are
//! layouts over several processes (`--manifest`): each worker is an actor of one process.

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
    /// The profiles, by (threads, micro-batch).
    pub profiles: Vec<Profile>,
    /// Micro-batch sizes whose profile run failed, and why (a model exported with a
    /// fixed batch size trains only that size): their candidates are left out.
    pub skipped: Vec<(usize, String)>,
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
    let tg = crate::train::graph_of(rt, cfg, config_path)?;
    let cut = costs::Cuttable::of(&tg);
    let values = search::node_values(&tg);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let threads = match cfg.runtime.intra_op_threads {
        Some(t) => t,
        None => intra_threads_for(flops_per_node(&tg), cores / opts.workers.max(1)),
    };
    let candidates = search::candidates(cfg, opts.workers, opts.max_micro_batches);
    let started = Instant::now();
    let run = ProfileRun {
        worker: opts.worker,
        config: config_path,
        steps: opts.profile_steps.max(3),
        warmup: 2,
        global_batch: cfg.global_batch(),
        pipelines: opts.workers >= 2,
    };
    let mut profiles: BTreeMap<usize, Profile> = BTreeMap::new();
    let mut skipped: Vec<(usize, String)> = Vec::new();
    let mut sizes: Vec<usize> = candidates.iter().map(|c| c.micro_batch).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for &b in sizes.iter().rev() {
        tracing::info!("profiling micro-batches of {b} at {threads} thread(s)");
        match profile::measure(&run, &tg, threads, b) {
            Ok(p) => {
                profiles.insert(b, p);
            }
            // A model exported with a fixed batch trains one micro-batch size only.
            Err(e) => skipped.push((b, e.to_string())),
        }
    }
    if profiles.is_empty() {
        let why: Vec<String> = skipped.iter().map(|(_, e)| e.clone()).collect();
        return Err(plan_error("profiling", why.join("; ")));
    }
    let (step_overhead, action_gap) =
        profile::fit_overheads(&profiles.values().collect::<Vec<_>>());
    for p in profiles.values_mut() {
        p.action_gap = action_gap;
    }
    let sizes: Vec<&Profile> = profiles.values().collect();
    let predict = |b: usize, m: &Machinery| {
        let c = search::Candidate {
            dp: 2,
            pp: 1,
            schedule: crate::config::ScheduleKind::OneFOneB,
            virtual_stages: 1,
            micro_batches: cfg.global_batch() / (2 * b),
            micro_batch: b,
            recompute: crate::graph::Recompute::None,
        };
        search::simulate_candidate(&c, profiles.get(&b)?, (&cut, &values), m, None).map(|s| s.step)
    };
    let shape = (cores, threads, opts.workers, cfg.global_batch());
    let machinery = machine::measure(&run, &sizes, shape, step_overhead, &predict)?;
    let profile_seconds = started.elapsed().as_secs_f64();
    let nearest = profiles
        .values()
        .min_by_key(|p| p.micro_batch.abs_diff(cfg.batch_size));
    let node_times = nearest.map(|p| costs::node_times(p, &tg));
    let scale_of = |mb: usize| mb as f64 / cfg.batch_size as f64;
    let mut rows = Vec::new();
    for c in candidates {
        let Some(p) = profiles.get(&c.micro_batch) else {
            continue;
        };
        let Some(sim) = search::simulate_candidate(&c, p, (&cut, &values), &machinery, None) else {
            continue;
        };
        let cuts = search::cut_names(&tg, &cut.live, &sim.bounds);
        // What `train` would refuse (1F1B with fewer micro-batches than stages, say).
        if c.apply(cfg, &cuts).validate(config_path).is_err() {
            continue;
        }
        let peak = crate::train::rank_bytes(&tg, &c.apply(cfg, &cuts), scale_of(c.micro_batch))
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
        tg: &tg,
        cut: &cut,
        values: &values,
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
        threads,
        cap: opts.memory_per_worker,
        profile_seconds,
        machinery,
        node_times,
    })
}

/// An error of the planner's own.
pub(crate) fn plan_error(what: &str, reason: impl Into<String>) -> Error {
    Error::Plan {
        what: what.into(),
        reason: reason.into(),
    }
}
