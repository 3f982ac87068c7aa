//! What each action of a pipeline stage pays beside its nodes, as a share of their time
//! ([`Profile::stage_overheads`]), calibrated against recorded runs: the profile's
//! two-rank run of each schedule [`Family`] has a measured step; each family's overhead
//! is the one at which the simulator, with everything else as measured, predicts its
//! run's step.
//!
//! The families differ: where the backward is not split the last stage runs forward
//! and backward as one graph, and a cut model's one graph gains less over its two
//! passes than the whole model's does (on the GPT-2 fixture, calibrated on ZB-H1 alone,
//! GPipe and 1F1B layouts came out 8-22% fast); where a rank holds two stages, each
//! action pays less than a GPipe or ZB-H1 stage's (see [`Family`]).
//!
//! Where the backward is not split, the last stage runs forward and backward as one
//! graph, and that graph pays less beside its nodes than the other stages' passes do
//! (on the Llama fixture +10% against +25% at micro-batches of 4, traced by hand). One
//! period cannot tell the two apart, so the run's trace gives their balance: the last
//! stage's actions over the others', against the nodes' (`last_stage_factor`); the
//! period then sets the level. A balance is a ratio: where the two ranks' actions ran
//! beside each other, the slowing below fell on both and mostly cancels in it.
//!
//! Read off the actions' own durations instead, it counted twice what the simulator adds
//! itself: in a pipeline the two stages' actions run at once, and each slows the other
//! (the measured interference), so their durations already hold that slowdown. On models
//! whose step takes under a millisecond this over-predicted two-stage pipelines by up to
//! twice.

use crate::config::TrainConfig;
use crate::graph::Recompute;

use super::Sharded;
use crate::cost::{simulate_candidate, Candidate, Family, Machinery, PerFamily, Profile};

/// The most a stage's action is taken to pay beside its nodes: four times their time.
const MOST_OVERHEAD: f64 = 4.0;

/// The least: half their time. A stage's actions can run faster than its nodes did in
/// the whole model's profile: a stage holds a part of the weights and activations, and
/// on a model whose working set outgrows a core's cache each part is served from nearer.
/// On the vocabulary GPT (an 8192 x 128 head) the two stages' actions of a 1F1B run at
/// micro-batches of 2 summed to 0.93 of the whole model's one graph (traced, the one
/// graph run in turn on one thread). Held at no overhead, its ZB-H1 layouts were
/// predicted 9-24% slow (its three cuts traced in turn); below it, -3 to +11%.
const LEAST_OVERHEAD: f64 = -0.5;

/// The bounds of the last stage's factor (a trace's medians read wrong, or a stage of
/// almost nothing, cannot set it past them).
const LAST_STAGE_FACTORS: (f64, f64) = (0.5, 2.0);

/// A family's calibration: the share of its nodes' time a stage's action pays beside
/// them, and the factor on `1 +` that share its last stage's one graph pays instead
/// where the backward is not split (1 where not measured).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Calibrated {
    pub overhead: f64,
    pub last_stage: f64,
}

/// The overhead (a share of its nodes' time) a stage's action of schedules of `family`
/// pays beside them, at which `profile`'s run of that family ([`Family::run`]: on two
/// ranks, or in the profile's own stages under ZB-H1 where the model fits no worker
/// whole; cut where the run was cut, [`Profile::run_cut`], else by FLOPs; micro-batches
/// of `profile.micro_batch`)
/// simulates to its measured step (below 0 where its stages ran faster than their
/// nodes, down to [`LEAST_OVERHEAD`]); `None` where the run was not made. Where the
/// backward is not split, the last stage's factor first ([`last_stage_factor`]).
pub(super) fn stage_overhead(
    profile: &Profile,
    family: Family,
    whole: &Sharded,
    machinery: &Machinery,
    cfg: &TrainConfig,
) -> Option<Calibrated> {
    let period = profile.periods[family];
    if period <= 0.0 {
        return None;
    }
    let b = profile.micro_batch;
    let (schedule, virtual_stages) = family.run();
    let c = Candidate {
        dp: 1,
        tp: 1,
        pp: profile.stages.max(2),
        schedule,
        virtual_stages,
        micro_batches: cfg.global_batch() / b,
        micro_batch: b,
        recompute: Recompute::None,
        zero: 0,
    };
    let bounds = whole.run_bounds(profile, c.stages())?;
    let last_stage = match family.splits_backward() {
        true => 1.0,
        false => last_stage_factor(profile, family, &whole.cut.passes(profile, &bounds)),
    };
    let step_at = |overhead: f64| {
        let p = Profile {
            stage_overheads: PerFamily::all(overhead),
            last_stage_factors: PerFamily::all(last_stage),
            ..profile.clone()
        };
        simulate_candidate(&c, &p, whole.costs(), machinery, Some(bounds.clone())).map(|s| s.step)
    };
    let overhead = solve(&step_at, period, (LEAST_OVERHEAD, MOST_OVERHEAD));
    Some(Calibrated {
        overhead,
        last_stage,
    })
}

/// The factor on the other actions' `1 + overhead` that brings the last stage's one
/// graph (of `family`'s run cut at `passes`, each stage's `F`, `I` and `W`
/// nodes) to its measured balance with them ([`Profile::last_stage_ratios`]): the
/// measured ratio of the last stage's actions to the others' over the nodes' (the last's
/// at the one graph's speed); 1 where not measured.
fn last_stage_factor(profile: &Profile, family: Family, passes: &[(f64, f64, f64)]) -> f64 {
    let measured = profile.last_stage_ratios[family];
    let whole = profile.total();
    let Some(((f, i, w), rest)) = passes.split_last() else {
        return 1.0;
    };
    let rest: f64 = rest.iter().map(|(f, i, w)| f + i + w).sum();
    let last = (f + i + w) * profile.fused / whole.max(f64::MIN_POSITIVE);
    match measured > 0.0 && last > 0.0 && rest > 0.0 {
        true => (measured / (last / rest)).clamp(LAST_STAGE_FACTORS.0, LAST_STAGE_FACTORS.1),
        false => 1.0,
    }
}

/// The cost in `[least, most]` at which `step_at` (growing with the cost) reaches
/// `target`: `least` where it is there already at that, `most` where even that falls
/// short.
pub(super) fn solve(
    step_at: &dyn Fn(f64) -> Option<f64>,
    target: f64,
    (least, most): (f64, f64),
) -> f64 {
    let short = |cost: f64| step_at(cost).is_some_and(|t| t < target);
    if !short(least) {
        return least;
    }
    if short(most) {
        return most;
    }
    let (mut lo, mut hi) = (least, most);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        match short(mid) {
            true => lo = mid,
            false => hi = mid,
        }
    }
    0.5 * (lo + hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_stage_s_factor_is_its_measured_balance_over_its_nodes_one() {
        // Two stages of 3 ms of nodes each; the one graph runs at 0.8 of the passes.
        let profile = |measured: f64| Profile {
            forward: vec![2e-3, 2e-3],
            backward: vec![1e-3, 1e-3],
            fused: 4.8e-3,
            last_stage_ratios: PerFamily([measured, 0.0, 0.0, 0.0]),
            ..Profile::default()
        };
        let passes = [(2e-3, 0.0, 1e-3), (2e-3, 0.5e-3, 0.5e-3)];
        // Nodes say the last stage's one graph is 2.4 ms against 3: measured 0.6, it
        // pays three quarters of what the first stage's actions pay.
        let at = |m: f64, f| last_stage_factor(&profile(m), f, &passes);
        assert!((at(0.6, Family::Unsplit) - 0.75).abs() < 1e-12);
        // Not measured (or another family's): as the others. Past the bounds: held.
        assert_eq!(at(0.0, Family::Unsplit), 1.0);
        assert_eq!(at(0.6, Family::Interleaved), 1.0);
        assert_eq!(at(0.01, Family::Unsplit), LAST_STAGE_FACTORS.0);
        assert_eq!(at(9.0, Family::Unsplit), LAST_STAGE_FACTORS.1);
    }

    #[test]
    fn the_cost_is_where_the_simulated_step_meets_the_measured_one() {
        // Four actions on the critical path over 1 ms of work: a 2 ms step means 0.25 ms
        // an action.
        let step = |cost: f64| Some(1e-3 + 4.0 * cost);
        assert!((solve(&step, 2e-3, (0.0, 1e-3)) - 0.25e-3).abs() < 1e-12);
        // Faster than the work alone: no cost where none is the least, a saving where
        // the range allows one. Slower than the most: the most.
        assert_eq!(solve(&step, 0.5e-3, (0.0, 1e-3)), 0.0);
        assert!((solve(&step, 0.5e-3, (-1e-3, 1e-3)) + 0.125e-3).abs() < 1e-12);
        assert_eq!(solve(&step, 0.1e-3, (-0.2e-3, 1e-3)), -0.2e-3);
        assert_eq!(solve(&step, 9e-3, (0.0, 1e-3)), 1e-3);
        // A step that cannot be simulated calibrates to the least.
        assert_eq!(solve(&|_| None, 2e-3, (0.0, 1e-3)), 0.0);
    }
}
