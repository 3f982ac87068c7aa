//! What each forward node of a model costs on this machine, and what its backward costs,
//! split into the input-gradient and weight-gradient parts: measured by ONNX Runtime's
//! own profiler (`enable_profiling`) on a few real training steps of the model, one
//! stage, in a `pipetrain train` process of its own (so the profile's memory and threads
//! are not the planner's, and its files land in a folder of their own).
//!
//! A node's kernel events are found by name: the sessions run the training graph's nodes
//! under their own names (the backward's are `grad/<forward node>/...`). Kernel
//! time ONNX Runtime spends in nodes it made itself (its fusions) is spread over the
//! session's named nodes in proportion; [`Profile::unmatched`] says how much that was.
//!
//! The profiler's own bookkeeping slows the run it records, so its times give only each
//! node's share: a second run without it (our trace) gives the passes' true times, a
//! third the one-graph forward and backward that a single stage runs, and up to four
//! more, on two ranks (one for each schedule [`Family`]), the steps a stage's own costs
//! are calibrated against.

use std::path::Path;

use super::ort_profile::{read_profile, Counting};
use super::overlap::stage_contention;
use super::passes::{hand_off_in, pass_seconds, passes_in, read_trace, Passes};
use super::runs::{in_folder, RunKind};

pub use crate::cost::Profile;
use crate::cost::{Family, PerFamily, RunCut, StagePasses};
use crate::graph::TrainingGraph;
use crate::{Error, Result};

/// How to run a profile: the `pipetrain` binary, the user's configuration (its file and
/// its text), and how many steps to run and skip.
pub struct ProfileRun<'a> {
    /// The `pipetrain` executable.
    pub worker: &'a Path,
    /// The configuration file (relative paths in it stay relative to its folder).
    pub config: &'a Path,
    /// Optimizer steps run; the first `warmup` are left out of the averages.
    pub steps: usize,
    /// Steps not counted.
    pub warmup: usize,
    /// The configuration's global batch (kept by every run).
    pub global_batch: usize,
    /// Whether pipeline layouts are planned (and cutting the model needs measuring).
    pub pipelines: bool,
    /// Tensor shards the runs split the model into.
    pub shards: usize,
    /// Pipeline stages the runs cut the model into (1 unless it fits no worker whole).
    pub stages: usize,
    /// Where its pipeline runs cut the model, by stage count (none: by FLOPs).
    pub cuts: &'a [RunCut],
}

/// Seconds of steps a timed run lasts at least.
pub const TIMED_SECONDS: f64 = 1.0;

/// The most steps a lengthened run takes.
const MOST_STEPS: usize = 5000;

/// Steps that make a run of `period`-second steps last `seconds` (at least `steps`).
pub fn steps_lasting(seconds: f64, period: f64, steps: usize) -> usize {
    match period > 0.0 {
        true => ((seconds / period).ceil() as usize).clamp(steps, MOST_STEPS.max(steps)),
        false => steps,
    }
}

impl ProfileRun<'_> {
    /// This run with steps enough to last [`TIMED_SECONDS`] at `period` seconds a step.
    pub fn lengthened(&self, period: f64) -> Self {
        ProfileRun {
            steps: steps_lasting(TIMED_SECONDS, period, self.steps),
            ..*self
        }
    }

    /// This run with as many steps as `profile`'s timed runs took (at least its own).
    pub fn as_long_as(&self, profile: &Profile) -> Self {
        ProfileRun {
            steps: profile.steps.max(self.steps),
            ..*self
        }
    }
}

/// Profiles `tg`'s model at `threads` threads and `micro_batch` samples per micro-batch:
/// the nodes' shares from ONNX Runtime's profile, scaled to the passes' times measured
/// without the profiler; and those timed runs' own figures (the first of `rounds`).
///
/// # Errors
/// `Plan` when a profile run fails or its files cannot be read.
pub(super) fn measure(
    run: &ProfileRun<'_>,
    tg: &TrainingGraph,
    threads: usize,
    micro_batch: usize,
) -> Result<(Profile, Timings)> {
    let what = format!(
        "profiling at {threads} thread(s), micro-batches of {micro_batch}, {} shard(s)",
        run.shards
    );
    let fail = |reason: String| Error::Plan {
        what: what.clone(),
        reason,
    };
    let counting = Counting {
        steps: run.steps,
        micro_batches: run.global_batch / micro_batch,
        warmup: run.warmup,
    };
    let (forward, backward, unmatched) =
        in_folder(run, (threads, micro_batch), RunKind::Profiled, |dir| {
            read_profile(dir, tg, counting)
        })
        .map_err(&fail)?;
    let key = (threads, micro_batch);
    let timed = in_folder(run, key, RunKind::Timed, |dir| {
        pass_seconds(&dir.join("trace.json"), run.warmup)
    })
    .map_err(&fail)?;
    // The pipeline runs cut where the nodes' times balance (`cost::run_cuts`).
    let cuts = match run.pipelines && run.stages == 1 {
        true => crate::cost::run_cuts(tg, (&forward, &backward), (timed.forward, timed.backward)),
        false => Vec::new(),
    };
    // The timed runs last long enough for the clock to see their steps (a sub-millisecond
    // step over a few steps is mostly noise): the first run tells how many that takes.
    let long = ProfileRun {
        cuts: &cuts,
        ..run.lengthened(timed.period)
    };
    let first = (long.steps <= counting.steps).then_some(timed);
    let t = timings(&long, key, first).map_err(&fail)?;
    let mut p = Profile {
        shards: run.shards,
        stages: run.stages,
        steps: long.steps,
        threads,
        micro_batch,
        forward,
        backward,
        actions: 2.0 * counting.micro_batches as f64,
        unmatched,
        run_cuts: cuts.clone(),
        ..Profile::default()
    };
    t.apply(&mut p, parameter_values(tg));
    Ok((p, t))
}

/// The parameter values of `tg`.
pub(super) fn parameter_values(tg: &TrainingGraph) -> usize {
    tg.params.iter().map(|p| p.meta.numel()).sum()
}

/// What a profile's timed runs measured at one size: the passes without the profiler
/// and the one-stage runs. Rounds of a profile repeat these (`rounds`).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Timings {
    /// The passes per micro-batch over the stages.
    pub timed: Passes,
    /// The one graph and the two-rank runs.
    pub one: OneStage,
}

impl Timings {
    /// Sets what `p` takes from these runs: its nodes' times scaled to the passes'
    /// (the profiler gave only their shares), the one graph, the update per value (of
    /// `values`), and the two-rank runs.
    pub(super) fn apply(&self, p: &mut Profile, values: usize) {
        p.scale_passes_to(self.timed.forward, self.timed.backward);
        p.fused = self.one.fused.forward + self.one.fused.backward;
        p.step_per_value = self.timed.step / values.max(1) as f64;
        p.idle = self.one.fused.idle;
        p.periods = self.one.periods;
        p.last_stage_ratios = self.one.last_stage_ratios;
        p.hand_off = self.one.hand_off;
        p.hand_off_back = self.one.hand_off_back;
        p.stage_contention = self.one.stage_contention;
        p.stage_passes = self.one.stage_passes;
    }
}

/// The timed runs at `key` (`(threads, micro_batch)`): the passes without the profiler
/// (unless `timed` has them already) and the one-stage runs.
pub(super) fn timings(
    run: &ProfileRun<'_>,
    key: (usize, usize),
    timed: Option<Passes>,
) -> std::result::Result<Timings, String> {
    let timed = match timed {
        Some(t) => t,
        None => in_folder(run, key, RunKind::Timed, |dir| {
            pass_seconds(&dir.join("trace.json"), run.warmup)
        })?,
    };
    // Per micro-batch over the stages (the trace's passes are each stage's).
    let timed = Passes {
        forward: timed.forward * run.stages as f64,
        backward: timed.backward * run.stages as f64,
        ..timed
    };
    let one = match run.stages {
        1 => one_stage_runs(run, key)?,
        // A model no worker holds whole: the timed run is itself a pipeline (the
        // calibration's), and no run has the one graph of a single stage.
        _ => {
            let mut periods = PerFamily::default();
            periods[Family::Split] = timed.period;
            OneStage {
                fused: Passes { idle: 0.0, ..timed },
                periods,
                last_stage_ratios: PerFamily::default(),
                hand_off: 0.0,
                hand_off_back: 0.0,
                stage_contention: None,
                stage_passes: None,
            }
        }
    };
    Ok(Timings { timed, one })
}

/// What the one-stage runs measure beside the passes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct OneStage {
    /// The one graph of forward and backward a single stage runs.
    pub fused: Passes,
    /// Each schedule family's two-rank run's step ([`Family::run`]; 0 where not run).
    pub periods: PerFamily,
    /// Each unsplit family's run's last stage's actions' time over its other stages'
    /// (0 where not run): [`Profile::last_stage_ratios`].
    pub last_stage_ratios: PerFamily,
    /// The GPipe run's hand-off of activations, and of gradients (0 where not run).
    pub hand_off: f64,
    pub hand_off_back: f64,
    /// The GPipe run's contention between its stages (`None` where not read).
    pub stage_contention: Option<f64>,
    /// The one-rank run's two stages' actions (`None` where not run).
    pub stage_passes: Option<StagePasses>,
}

/// The one-stage runs: the one graph of forward and backward a single stage runs, and
/// (where pipelines are planned) the same passes on two ranks under each schedule
/// family's run ([`Family::run`]; ZB-H1 not for a lone micro-batch, which it cannot
/// run in two stages), whose steps each family's stage cost is calibrated against
/// (`calibrate`), and, of the whole model, its two stages on one rank (`shares`).
fn one_stage_runs(
    run: &ProfileRun<'_>,
    key: (usize, usize),
) -> std::result::Result<OneStage, String> {
    let fused = in_folder(run, key, RunKind::Fused, |dir| {
        pass_seconds(&dir.join("trace.json"), run.warmup)
    })?;
    let mut one = OneStage {
        fused,
        ..OneStage::default()
    };
    if !run.pipelines {
        return Ok(one);
    }
    let micro_batches = run.global_batch / key.1.max(1);
    // A pipeline run that fails (a model that cannot be cut in two) leaves its
    // calibration to the nearest size's.
    for family in Family::ALL.into_iter().filter(|f| f.runs(micro_batches)) {
        let made = in_folder(run, key, RunKind::Pipeline(family), |dir| {
            let path = dir.join("trace.json");
            let trace = read_trace(&path)?;
            let in_trace = |e: String| format!("{}: {e}", path.display());
            let period = passes_in(&trace, run.warmup).map_err(in_trace)?.period;
            let last = match family.splits_backward() {
                true => 0.0,
                false => super::shares::last_stage_ratio(&trace, run.warmup),
            };
            // GPipe's hand-offs find the receiver idle: what one takes; and where its
            // micro-batches overlap, how much its stages slow each other.
            let gpipe = match family {
                Family::Unsplit => Some((
                    hand_off_in(&trace, run.warmup)?,
                    stage_contention(&trace, run.warmup),
                )),
                _ => None,
            };
            Ok((period, last, gpipe))
        });
        match made {
            Ok((period, last, gpipe)) => {
                one.periods[family] = period;
                one.last_stage_ratios[family] = last;
                if let Some(((hand_off, back), contention)) = gpipe {
                    (one.hand_off, one.hand_off_back) = (hand_off, back);
                    one.stage_contention = contention;
                }
            }
            Err(e) => tracing::warn!("the two-rank {:?} run failed: {e}", family.run().0),
        }
    }
    // The stages the nodes' shares are set against (`shares`): of the whole model only.
    if run.shards == 1 {
        let stages = in_folder(run, key, RunKind::Stages, |dir| {
            let path = dir.join("trace.json");
            Ok(super::shares::stage_passes_in(
                &read_trace(&path)?,
                run.warmup,
            ))
        });
        match stages {
            Ok(passes) => one.stage_passes = passes,
            Err(e) => tracing::warn!("the one-rank run of two stages failed: {e}"),
        }
    }
    Ok(one)
}

/// What a step costs beside its actions (`.0`: the coordinator's decision, the data) and
/// what each action costs beside its compute (`.1`), fitted by least squares to the
/// profiles' idle time per step, `idle = step + actions * action`; with one profile, all
/// of it is the actions'.
pub fn fit_overheads(profiles: &[&Profile]) -> (f64, f64) {
    let n = profiles.len() as f64;
    let (sx, sy) = profiles
        .iter()
        .fold((0.0, 0.0), |(x, y), p| (x + p.actions, y + p.idle));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = profiles.iter().map(|p| (p.actions - mx).powi(2)).sum();
    let sxy: f64 = profiles
        .iter()
        .map(|p| (p.actions - mx) * (p.idle - my))
        .sum();
    if profiles.len() < 2 || sxx <= 0.0 {
        return (0.0, if mx > 0.0 { my / mx } else { 0.0 });
    }
    let action = (sxy / sxx).max(0.0);
    let step = (my - action * mx).max(0.0);
    (step, action)
}
