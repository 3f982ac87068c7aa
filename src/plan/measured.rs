//! What the planner measures before it searches: the model as each tensor-shard count
//! sees it, the profiles at every (shards, micro-batch) the candidates need (in pipeline
//! stages where one worker cannot hold the model under the cap), and a stage's own cost
//! calibrated against the recorded pipeline runs.

use std::collections::BTreeMap;
use std::path::Path;

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::graph::{BalanceBy, TrainingGraph};
use crate::Result;

use super::cache::Measured;
use super::profile::{self, Profile, ProfileRun};
use super::search::{self, Machinery};
use super::{calibrate, PlanOptions};
use crate::cost::stages as costs;
use crate::cost::{Family, PerFamily};

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
    pub(super) fn of(
        rt: &Runtime,
        cfg: &TrainConfig,
        config_path: &Path,
        tp: usize,
    ) -> Result<Sharded> {
        let mut c = cfg.clone();
        c.horizontal_parallel_size = tp;
        let tg = crate::train::graph_of(rt, &c, config_path)?;
        Ok(Sharded::from_graph(tg, tp, cfg.batch_size))
    }

    /// `tg`, the training graph of `tp` shards built at micro-batches of `batch_size`.
    pub(super) fn from_graph(tg: TrainingGraph, tp: usize, batch_size: usize) -> Sharded {
        Sharded {
            tp,
            cut: costs::Cuttable::of(&tg).measured_at(batch_size),
            values: search::node_values(&tg),
            tg,
        }
    }

    /// `whole` and the model split at every shard count above 1 that divides `workers`
    /// and the model allows; the counts it does not, with why.
    pub(super) fn all(
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

    /// The cut positions (in `cut.live`) at which `profile`'s pipeline runs of `stages`
    /// stages were made: its own cut ([`Profile::run_cut`]), else by FLOPs, as a
    /// configuration without a partition cuts them.
    pub(super) fn run_bounds(&self, profile: &Profile, stages: usize) -> Option<Vec<usize>> {
        match profile.run_cut(stages) {
            Some(cut) => Some(cut.bounds.clone()),
            None => self.balanced_bounds(stages, BalanceBy::Flops),
        }
    }

    /// The cut positions (in `cut.live`) of `stages` stages balanced by `by`, as a
    /// configuration's `partition = { balanced = ... }` cuts them.
    pub fn balanced_bounds(&self, stages: usize, by: BalanceBy) -> Option<Vec<usize>> {
        self.cut.balanced_bounds(&self.tg, stages, by)
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
    let Some(cap) = opts.caps.device else {
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
/// first, then their timed runs again in `opts.profile_rounds` rounds (`rounds`); a
/// size whose run fails (one the model cannot train) is left out with why.
fn profile_all(
    run: &ProfileRun<'_>,
    (models, cfg, opts): (&[Sharded], &TrainConfig, &PlanOptions<'_>),
    candidates: &[search::Candidate],
    threads: usize,
) -> (Profiles, Vec<(usize, String)>) {
    let mut profiles = BTreeMap::new();
    let mut first = BTreeMap::new();
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
        let micro_batches = cfg.global_batch() / b;
        if stages > micro_batches {
            let why = format!(
                "one worker cannot hold the model under the cap, and {micro_batches} \
                 micro-batch(es) cannot fill the {stages} pipeline stages that could"
            );
            match tp {
                1 => skipped.push((b, why)),
                _ => tracing::info!("{tp} shards, micro-batches of {b}: {why}"),
            }
            continue;
        }
        let sharded = ProfileRun {
            shards: tp,
            stages,
            pipelines: run.pipelines && tp == 1,
            ..*run
        };
        match profile::measure(&sharded, &model.tg, threads, b) {
            Ok((p, t)) => {
                profiles.insert((tp, b), p);
                first.insert((tp, b), vec![t]);
            }
            Err(e) if tp == 1 => skipped.push((b, e.to_string())),
            Err(e) => tracing::warn!("{e}: layouts of {tp} shards left out"),
        }
    }
    let values = |(tp, _): (usize, usize)| {
        let model = models.iter().find(|m| m.tp == tp);
        model.map_or(0, |m| profile::parameter_values(&m.tg))
    };
    super::rounds::repeat(run, &mut profiles, first, (opts.profile_rounds, &values));
    (profiles, skipped)
}

/// Everything a plan measures: the profiles ([`profile_all`]), then the machine's own
/// runs (`machine::run_machine`); `.1` of `at` is when measuring started.
///
/// # Errors
/// `Plan` when no size could be profiled.
pub(super) fn measure_all(
    run: &ProfileRun<'_>,
    (models, cfg, opts): (&[Sharded], &TrainConfig, &PlanOptions<'_>),
    candidates: &[search::Candidate],
    (threads, started): (usize, std::time::Instant),
) -> Result<Measured> {
    let (profiles, skipped) = profile_all(run, (models, cfg, opts), candidates, threads);
    if profiles.is_empty() {
        // Each reason is a plan error's own text: said once.
        let why: Vec<&str> = skipped
            .iter()
            .map(|(_, e)| e.strip_prefix("plan: ").unwrap_or(e))
            .collect();
        return Err(super::plan_error(
            "profiling",
            format!("no micro-batch size could be profiled: {}", why.join("; ")),
        ));
    }
    let sizes: Vec<&Profile> = profiles.values().filter(|p| p.shards == 1).collect();
    // ZeRO stage 2's run only where some candidate would use it.
    let zero2 = candidates.iter().any(|c| c.zero == 2);
    let shape = (opts.workers, cfg.global_batch());
    let machine = super::machine::run_machine(run, &sizes, shape, (opts.profile_rounds, zero2));
    Ok(Measured {
        made_for: None,
        profiles: profiles.into_values().collect(),
        skipped,
        machine,
        seconds: started.elapsed().as_secs_f64(),
        finished: crate::checkpoint::now_unix_s(),
        process: None,
    })
}

/// Each unsplit profile's node shares set against its one-rank run's two stages
/// (`shares::reshare`), then its stage actions' overheads calibrated against its two-rank
/// runs, a family at a time (a size without a run takes the nearest calibrated size's; a
/// family never calibrated takes its [`Family::stand_ins`]'); a split model's profile
/// takes the unsplit one's at its micro-batch.
pub(super) fn calibrate_stage_overheads(
    profiles: &mut Profiles,
    whole: &Sharded,
    machinery: &Machinery,
    cfg: &TrainConfig,
) {
    super::shares::reshare(profiles, whole);
    let calibrated = PerFamily(Family::ALL.map(|family| {
        profiles
            .iter()
            .filter(|((tp, _), _)| *tp == 1)
            .filter_map(|(&(_, b), p)| {
                Some((
                    b,
                    calibrate::stage_overhead(p, family, whole, machinery, cfg)?,
                ))
            })
            .collect::<BTreeMap<usize, calibrate::Calibrated>>()
    }));
    let part = |read: fn(&calibrate::Calibrated) -> f64| {
        PerFamily(
            calibrated
                .0
                .each_ref()
                .map(|by_size| by_size.iter().map(|(&b, c)| (b, read(c))).collect()),
        )
    };
    let (overheads, last_stages) = (part(|c| c.overhead), part(|c| c.last_stage));
    for (&(_, b), p) in profiles.iter_mut() {
        p.stage_overheads = per_family_at(b, &overheads, 0.0);
        p.last_stage_factors = per_family_at(b, &last_stages, 1.0);
    }
}

/// Each family's calibrated value (a stage overhead, a last stage's factor) at
/// micro-batches of `b`, of those `calibrated` at each size: its own at the nearest size
/// calibrated for it; where it has none, its nearest stand-in's; `none` where no family
/// was calibrated.
fn per_family_at(b: usize, calibrated: &PerFamily<BTreeMap<usize, f64>>, none: f64) -> PerFamily {
    let nearest = |f: Family| {
        let by_distance = calibrated[f].iter().min_by_key(|(&c, _)| c.abs_diff(b));
        by_distance.map(|(_, &overhead)| overhead)
    };
    PerFamily(Family::ALL.map(|f| {
        let mut own_then_stand_ins = std::iter::once(f).chain(f.stand_ins());
        own_then_stand_ins.find_map(nearest).unwrap_or(none)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_size_takes_each_family_s_nearest_calibration_and_a_family_never_run_a_stand_in_s() {
        let unsplit = BTreeMap::from([(1, 30.0), (2, 40.0), (4, 50.0)]);
        // ZB-H1 cannot run a single micro-batch of 4: its cost is 2's.
        let split = BTreeMap::from([(1, 10.0), (2, 20.0)]);
        let v = BTreeMap::from([(1, 5.0), (2, 6.0), (4, 7.0)]);
        let none = BTreeMap::new();
        let at = |b, c| per_family_at(b, c, 0.0).0;
        let all = PerFamily([unsplit, split.clone(), none.clone(), v.clone()]);
        // Interleaved was never run: unsplit's stands in.
        assert_eq!(at(4, &all), [50.0, 20.0, 50.0, 7.0]);
        assert_eq!(at(1, &all), [30.0, 10.0, 30.0, 5.0]);
        // Only the split family run: everyone takes it.
        let only_split = PerFamily([none.clone(), split, none.clone(), none.clone()]);
        assert_eq!(at(8, &only_split), [20.0; 4]);
        // A V run alone stands in for ZB-H1 before the unsplit ones.
        let only_v = PerFamily([none.clone(), none.clone(), none.clone(), v]);
        assert_eq!(at(2, &only_v), [6.0; 4]);
        let nothing = PerFamily([none.clone(), none.clone(), none.clone(), none]);
        assert_eq!(at(8, &nothing), [0.0; 4]);
        assert_eq!(per_family_at(8, &nothing, 1.0).0, [1.0; 4]);
    }
}
