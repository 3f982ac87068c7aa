//! A profile's timed runs in rounds (`plan --profile-rounds R`): after every size has
//! been profiled once, each size's timed runs (the passes without the profiler, the one
//! graph, the two-rank runs) run again, the sizes in turn each round, and each profile
//! takes the median of its rounds.
//!
//! On a shared machine one run can land in a slow minute: on the vocabulary GPT one
//! profile's one graph at micro-batches of 2 came out 15% slower than the next
//! profile's, and every layout built on it was predicted 20-29% slow. Taken in turn, a
//! slow minute falls on one round of several sizes, not on every round of one.

use std::collections::BTreeMap;

use super::passes::Passes;
use super::profile::{timings, OneStage, Profile, ProfileRun, Timings};
use crate::cost::{Family, PerFamily, StagePasses};

/// The median of `values` (`None` for none).
pub(super) fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (n > 0).then(|| (v[(n - 1) / 2] + v[n / 2]) / 2.0)
}

/// Runs each profile's timed runs `rounds - 1` more times (`seen` holds each one's
/// first), the profiles in turn each round, and sets each to the median of its rounds;
/// `values(key)` are the parameter values of its model. A run that fails is left out
/// of its profile's median, with a warning.
pub(super) fn repeat(
    run: &ProfileRun<'_>,
    profiles: &mut BTreeMap<(usize, usize), Profile>,
    mut seen: BTreeMap<(usize, usize), Vec<Timings>>,
    (rounds, values): (usize, &dyn Fn((usize, usize)) -> usize),
) {
    for round in 1..rounds {
        for (&key, p) in profiles.iter() {
            tracing::info!(
                "profile round {}: {} shard(s), micro-batches of {}",
                round + 1,
                key.0,
                key.1
            );
            let again = ProfileRun {
                shards: p.shards,
                stages: p.stages,
                pipelines: run.pipelines && p.shards == 1,
                cuts: &p.run_cuts,
                ..run.as_long_as(p)
            };
            match timings(&again, (p.threads, p.micro_batch), None) {
                Ok(t) => seen.entry(key).or_default().push(t),
                Err(e) => tracing::warn!("profile round {}: {e}", round + 1),
            }
        }
    }
    for (key, p) in profiles.iter_mut() {
        if let Some(all) = seen.get(key) {
            log_rounds(*key, all);
            middle(all).apply(p, values(*key));
        }
    }
}

/// Each round's times of the profile of `(shards, micro_batch)` in the debug log
/// (`RUST_LOG=pipetrain::plan=debug`): how far apart they came, the noise its median
/// smooths.
fn log_rounds((shards, micro_batch): (usize, usize), all: &[Timings]) {
    let ms = |f: &dyn Fn(&Timings) -> f64| -> Vec<String> {
        all.iter().map(|t| format!("{:.3}", f(t) * 1e3)).collect()
    };
    tracing::debug!(
        "profile rounds, {shards} shard(s), micro-batches of {micro_batch}: one graph {:?} ms, forward {:?}, backward {:?}",
        ms(&|t| t.one.fused.forward + t.one.fused.backward),
        ms(&|t| t.timed.forward),
        ms(&|t| t.timed.backward),
    );
}

/// The median of `all`'s values of `f` above 0 (0, a run not made, left out; 0 where
/// none is above).
fn median_of<T>(all: &[T], f: &dyn Fn(&T) -> f64) -> f64 {
    let v: Vec<f64> = all.iter().map(f).filter(|&x| x > 0.0).collect();
    median(&v).unwrap_or(0.0)
}

/// Each of the runs' times, their median over `all` (see [`median_of`]).
pub(super) fn median_passes(all: &[Passes]) -> Passes {
    Passes {
        forward: median_of(all, &|p| p.forward),
        backward: median_of(all, &|p| p.backward),
        step: median_of(all, &|p| p.step),
        idle: median_of(all, &|p| p.idle),
        period: median_of(all, &|p| p.period),
    }
}

/// Each of `all`'s times their median (a two-rank run not made, 0, left out).
fn middle(all: &[Timings]) -> Timings {
    let passes =
        |f: &dyn Fn(&Timings) -> Passes| median_passes(&all.iter().map(f).collect::<Vec<_>>());
    Timings {
        timed: passes(&|t| t.timed),
        one: OneStage {
            fused: passes(&|t| t.one.fused),
            periods: PerFamily(Family::ALL.map(|f| median_of(all, &|t| t.one.periods[f]))),
            last_stage_ratios: PerFamily(
                Family::ALL.map(|f| median_of(all, &|t| t.one.last_stage_ratios[f])),
            ),
            hand_off: median_of(all, &|t| t.one.hand_off),
            hand_off_back: median_of(all, &|t| t.one.hand_off_back),
            stage_contention: median(
                &all.iter()
                    .filter_map(|t| t.one.stage_contention)
                    .collect::<Vec<_>>(),
            ),
            stage_passes: median_stage_passes(all),
        },
    }
}

/// Each stage's actions' median over the rounds that ran them (`None` where none did).
fn median_stage_passes(all: &[Timings]) -> Option<StagePasses> {
    let runs: Vec<StagePasses> = all.iter().filter_map(|t| t.one.stage_passes).collect();
    let mut out: StagePasses = *runs.first()?;
    for (s, stage) in out.iter_mut().enumerate() {
        for (k, x) in stage.iter_mut().enumerate() {
            *x = median_of(&runs, &|r| r[s][k]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_middle_pair_s_mean() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn each_time_is_its_rounds_median_and_a_run_not_made_is_left_out() {
        let round = |fused: f64, gpipe: f64, contention: Option<f64>| Timings {
            timed: Passes {
                forward: fused / 2.0,
                ..Passes::default()
            },
            one: OneStage {
                fused: Passes {
                    forward: fused,
                    ..Passes::default()
                },
                periods: PerFamily([gpipe, 0.0, 0.0, 0.0]),
                last_stage_ratios: PerFamily([gpipe / 4.0, 0.0, 0.0, 0.0]),
                hand_off: 0.0,
                hand_off_back: 0.0,
                stage_contention: contention,
                stage_passes: contention.map(|c| [[c, 0.0, 1.0], [2.0 * c, 1.0, 0.0]]),
            },
        };
        // One slow round of three: the median is a quiet one.
        let m = middle(&[
            round(1.0, 3.0, Some(0.5)),
            round(1.3, 0.0, None),
            round(1.1, 2.0, Some(0.7)),
        ]);
        assert_eq!(m.one.fused.forward, 1.1);
        assert_eq!(m.timed.forward, 0.55);
        // The GPipe run failed once: the median of the two made.
        assert_eq!(m.one.periods[Family::Unsplit], 2.5);
        assert_eq!(m.one.periods[Family::Split], 0.0);
        // So did its stages' balance.
        assert_eq!(m.one.last_stage_ratios[Family::Unsplit], 0.625);
        // The stages' contention, read where the run overlapped its stages.
        assert_eq!(m.one.stage_contention, Some(0.6));
        // The one-rank run's stages, each action its median where the run was made.
        let p = m.one.stage_passes.unwrap();
        assert!((p[0][0] - 0.6).abs() < 1e-12 && (p[1][0] - 1.2).abs() < 1e-12);
        assert_eq!((p[0][1], p[0][2], p[1][1], p[1][2]), (0.0, 1.0, 1.0, 0.0));
    }
}
