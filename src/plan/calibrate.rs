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
//! Read off the actions' own durations instead, it counted twice what the simulator adds
//! itself: in a pipeline the two stages' actions run at once, and each slows the other
//! (the measured interference), so their durations already hold that slowdown. On models
//! whose step takes under a millisecond this over-predicted two-stage pipelines by up to
//! twice.

use crate::config::TrainConfig;
use crate::graph::{BalanceBy, Recompute};

use super::Sharded;
use crate::cost::{simulate_candidate, Candidate, Family, Machinery, PerFamily, Profile};

/// The most a stage's action is taken to pay beside its nodes: four times their time.
const MOST_OVERHEAD: f64 = 4.0;

/// The overhead (a share of its nodes' time) a stage's action of schedules of `family`
/// pays beside them, at which `profile`'s run of that family ([`Family::run`]: on two
/// ranks, or in the profile's own stages under ZB-H1 where the model fits no worker
/// whole; cut by FLOPs as the run cut them, micro-batches of `profile.micro_batch`)
/// simulates to its measured step; 0 where the simulator predicts it slower even without
/// any; `None` where the run was not made.
pub(super) fn stage_overhead(
    profile: &Profile,
    family: Family,
    whole: &Sharded,
    machinery: &Machinery,
    cfg: &TrainConfig,
) -> Option<f64> {
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
    let bounds = whole.balanced_bounds(c.stages(), BalanceBy::Flops)?;
    let step_at = |overhead: f64| {
        let p = Profile {
            stage_overheads: PerFamily::all(overhead),
            ..profile.clone()
        };
        simulate_candidate(&c, &p, whole.costs(), machinery, Some(bounds.clone())).map(|s| s.step)
    };
    Some(solve(&step_at, period, MOST_OVERHEAD))
}

/// The cost in `[0, most]` at which `step_at` (growing with the cost) reaches `target`:
/// 0 where it is there already without any, `most` where even that falls short.
pub(super) fn solve(step_at: &dyn Fn(f64) -> Option<f64>, target: f64, most: f64) -> f64 {
    let short = |cost: f64| step_at(cost).is_some_and(|t| t < target);
    if !short(0.0) {
        return 0.0;
    }
    if short(most) {
        return most;
    }
    let (mut lo, mut hi) = (0.0, most);
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
    fn the_cost_is_where_the_simulated_step_meets_the_measured_one() {
        // Four actions on the critical path over 1 ms of work: a 2 ms step means 0.25 ms
        // an action.
        let step = |cost: f64| Some(1e-3 + 4.0 * cost);
        assert!((solve(&step, 2e-3, 1e-3) - 0.25e-3).abs() < 1e-12);
        // Faster than the work alone: no cost. Slower than the most: the most.
        assert_eq!(solve(&step, 0.5e-3, 1e-3), 0.0);
        assert_eq!(solve(&step, 9e-3, 1e-3), 1e-3);
        // A step that cannot be simulated calibrates to nothing.
        assert_eq!(solve(&|_| None, 2e-3, 1e-3), 0.0);
    }
}
