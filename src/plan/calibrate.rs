//! What each action of a pipeline stage pays beside its nodes ([`Profile::stage_run`]),
//! calibrated against a recorded run: the profile's two-stage ZB-H1 run has a measured
//! step; the cost is the one at which the simulator, with everything else as measured,
//! predicts that step.
//!
//! Read off the actions' own durations instead, it counted twice what the simulator adds
//! itself: in a pipeline the two stages' actions run at once, and each slows the other
//! (the measured interference), so their durations already hold that slowdown. On models
//! whose step takes under a millisecond this over-predicted two-stage pipelines by up to
//! twice.

use crate::config::{ScheduleKind, TrainConfig};
use crate::graph::{assign_stages, BalanceBy, Partition, Recompute};

use super::profile::Profile;
use super::search::{simulate_candidate, Candidate, Machinery};
use super::Sharded;

/// The per-action stage cost at which `profile`'s two-stage run (ZB-H1, the stages cut
/// by FLOPs as the run cut them, micro-batches of `profile.micro_batch`) simulates to its
/// measured step; 0 where the simulator predicts it slower even without any; `None`
/// where the run was not made (a micro-batch as large as the global batch).
pub(super) fn stage_run(
    profile: &Profile,
    whole: &Sharded,
    machinery: &Machinery,
    cfg: &TrainConfig,
) -> Option<f64> {
    if profile.pipeline_period <= 0.0 {
        return None;
    }
    let b = profile.micro_batch;
    let c = Candidate {
        dp: 1,
        tp: 1,
        pp: 2,
        schedule: ScheduleKind::ZbH1,
        virtual_stages: 1,
        micro_batches: cfg.global_batch() / b,
        micro_batch: b,
        recompute: Recompute::None,
    };
    let halves = Partition::Balanced {
        stages: 2,
        by: BalanceBy::Flops,
    };
    let a = assign_stages(&whole.tg, &halves).ok()?;
    let live = &whole.cut.live;
    let bounds: Vec<usize> = live
        .iter()
        .position(|&i| a.stage[i] == Some(1))
        .into_iter()
        .collect();
    let step_at = |cost: f64| {
        let p = Profile {
            stage_run: cost,
            ..profile.clone()
        };
        simulate_candidate(&c, &p, whole.costs(), machinery, Some(bounds.clone())).map(|s| s.step)
    };
    let target = profile.pipeline_period;
    match step_at(0.0) {
        Some(t) if t < target => {}
        _ => return Some(0.0),
    }
    // The step grows with the cost: bisect up to a cost as large as a micro-batch's work.
    let (mut lo, mut hi) = (0.0, profile.total().max(1e-6));
    if step_at(hi).is_some_and(|t| t < target) {
        return Some(hi);
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        match step_at(mid) {
            Some(t) if t < target => lo = mid,
            _ => hi = mid,
        }
    }
    Some(0.5 * (lo + hi))
}
