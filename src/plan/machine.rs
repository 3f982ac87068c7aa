//! This machine as the planner simulates it, measured: the in-process reduction's adding
//! rate, what a hand-off between two stage actors takes (from the profile's two-stage
//! GPipe run's trace), how much two actions running at once slow each other (and two
//! updates, apart), what keeping two replicas in step costs (from a two-replica run's
//! trace), and what ZeRO stage 2 costs a micro-batch (the same two replicas at stage 2).

use std::time::Instant;

use crate::{Error, Result};

use super::passes::{pass_seconds, Passes};
use super::profile::{Profile, ProfileRun};
use super::runs::{in_folder, RunKind};
use crate::cost::Machinery;

/// The step the simulator gives two replicas at micro-batches of `b` samples, ZeRO
/// stage `zero`, on a machine.
pub(super) type Predict<'a> = dyn Fn(usize, u8, &Machinery) -> Option<f64> + 'a;

/// A one-stage run in two replicas at once, at `alone`'s micro-batch, made `rounds`
/// times, each time just after the same run in one replica: each of its times the
/// median of the rounds, and how much the two replicas' updates slowed each other
/// (each round's update over the one replica's just before, their median; `None` where
/// a run had none).
///
/// The pair's times are kept as measured. Scaled by how much faster the one replica
/// just before ran than the profile's, the vocabulary GPT's two-replica layouts came out
/// 3-12% slow in both of two benches (the one replica ran 0-10% faster than the
/// profile's).
fn pair_passes(
    run: &ProfileRun<'_>,
    alone: &Profile,
    rounds: usize,
) -> Result<(Passes, Option<f64>)> {
    let (run, key) = (&run.as_long_as(alone), (alone.threads, alone.micro_batch));
    let passes = |kind| {
        in_folder(run, key, kind, |dir| {
            pass_seconds(&dir.join("trace.json"), run.warmup)
        })
    };
    let once = || {
        let one = passes(RunKind::Fused)?;
        let pair = passes(RunKind::FusedPair)?;
        tracing::debug!(
            "two replicas at micro-batches of {}: {:.3} ms a step, update {:.3} ms; \
             one alone {:.3} ms, update {:.3} ms",
            key.1,
            pair.period * 1e3,
            pair.step * 1e3,
            one.period * 1e3,
            one.step * 1e3
        );
        let update = (one.step > 0.0 && pair.step > 0.0).then(|| pair.step / one.step - 1.0);
        Ok((pair, update))
    };
    let all = (0..rounds.max(1))
        .map(|_| {
            once().map_err(|reason: String| Error::Plan {
                what: "measuring two replicas at once".into(),
                reason,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let passes: Vec<Passes> = all.iter().map(|r| r.0).collect();
    let updates: Vec<f64> = all.iter().filter_map(|r| r.1).collect();
    Ok((
        super::rounds::median_passes(&passes),
        super::rounds::median(&updates),
    ))
}

/// Seconds to add one float32 into another over buffers larger than the caches: the
/// in-process reduction's cost per value and replica.
pub(super) fn add_seconds_per_value() -> f64 {
    let n = 8 << 20;
    let mut a = vec![1.0f32; n];
    let b = vec![0.5f32; n];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        for (x, y) in a.iter_mut().zip(&b) {
            *x += *y;
        }
        std::hint::black_box(&a);
        best = best.min(t.elapsed().as_secs_f64() / n as f64);
    }
    best
}

/// What this machine's own runs measured, before anything is fitted to them (what a
/// saved profile keeps beside the profiles, `cache`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct MachineRuns {
    /// Seconds to add one float32 into another (the in-process reduction's rate).
    pub add_per_value: f64,
    /// The two-replica run: its micro-batch and its passes (`None`: not made).
    pub pair: Option<(usize, Passes)>,
    /// How much its two updates slowed each other (`None`: not measured).
    #[serde(default)]
    pub update_contention: Option<f64>,
    /// The same two replicas' step at ZeRO stage 2 (`None`: not made).
    pub zero2_period: Option<f64>,
}

/// The machine's own runs for `workers` workers and a global batch of `global`: the
/// adding rate; a two-replica run at the largest micro-batch two replicas can split the
/// global batch into (made `rounds` times, the median taken); where `zero2` (some
/// candidate shards its gradients), the same two replicas at ZeRO stage 2 (as often).
///
/// A run that fails is left out, with a warning in the log: its cost is then left out
/// of the simulation.
pub(super) fn run_machine(
    run: &ProfileRun<'_>,
    profiles: &[&Profile],
    (workers, global): (usize, usize),
    (rounds, zero2): (usize, bool),
) -> MachineRuns {
    let mut runs = MachineRuns {
        add_per_value: add_seconds_per_value(),
        ..MachineRuns::default()
    };
    if workers < 2 {
        return runs;
    }
    // Two replicas of a model no worker holds whole do not fit either.
    let pair = profiles
        .iter()
        .rev()
        .filter(|p| p.stages == 1)
        .find(|p| global % (2 * p.micro_batch) == 0);
    let Some(p) = pair else {
        return runs;
    };
    match pair_passes(run, p, rounds) {
        Ok((passes, update)) => {
            runs.pair = Some((p.micro_batch, passes));
            runs.update_contention = update;
        }
        Err(e) => {
            tracing::warn!("{e}; replicas simulated without interference");
            return runs;
        }
    }
    if zero2 {
        runs.zero2_period = zero2_period(run, p, rounds)
            .map_err(|e| tracing::warn!("{e}; ZeRO stage 2 not searched"))
            .ok();
    }
    runs
}

/// This machine at `threads` threads per session on `cores` cores, for `workers`
/// workers, from its runs and the profiles': the hand-off from the profiles' two-stage
/// GPipe runs (the largest micro-batch's that showed one) and how much their stages'
/// actions slowed each other; how much two actions at once slow each other (the
/// two-replica run's forward and backward over one alone's; their updates', measured
/// apart, as the update reads and writes memory more than it computes), and what
/// keeping two replicas in step costs a step (the cost at which the two-replica run's
/// prediction, `predict(micro_batch, zero, machinery)`, meets its measured step); ZeRO
/// stage 2's cost where its run was made.
pub(super) fn machinery(
    runs: &MachineRuns,
    profiles: &[&Profile],
    (cores, threads, workers): (usize, usize, usize),
    step_overhead: f64,
    predict: &Predict<'_>,
) -> Machinery {
    let mut m = Machinery {
        add_per_value: runs.add_per_value,
        step_overhead,
        ..Machinery::bare(cores, threads)
    };
    if workers < 2 {
        return m;
    }
    // The stages' contention from the GPipe runs that showed it (their median).
    if cores / threads >= 2 {
        let seen: Vec<f64> = profiles.iter().filter_map(|p| p.stage_contention).collect();
        m.stage_contention = super::rounds::median(&seen);
    }
    // The hand-off from the largest micro-batch's two-stage GPipe run (a run that
    // failed leaves it out of the simulation, said).
    match profiles.iter().rev().find(|p| p.hand_off > 0.0) {
        Some(p) => {
            m.hop = p.hand_off;
            m.hop_back = (p.hand_off_back > 0.0).then_some(p.hand_off_back);
        }
        None => tracing::warn!("no two-stage run showed a hand-off; hand-offs simulated as free"),
    }
    let pair = runs.pair.and_then(|(b, passes)| {
        let alone = profiles
            .iter()
            .find(|p| p.stages == 1 && p.micro_batch == b)?;
        Some((alone, passes))
    });
    let Some((p, passes)) = pair else {
        return m;
    };
    if cores / threads >= 2 {
        m.contention = ((passes.forward + passes.backward) / p.fused - 1.0).max(0.0);
        m.update_contention = runs.update_contention.map(|u| u.max(0.0));
    }
    m.replica_sync = replica_sync(&m, passes.period, &|m| predict(p.micro_batch, 0, m));
    m.zero2_per_value = runs
        .zero2_period
        .map(|period| zero2_per_value(period, p.micro_batch, &m, predict));
    m
}

/// What keeping two replicas in step costs a step: the cost at which `predict`, on `m`
/// with it, meets the two-replica run's measured `period`. Solved, not subtracted: the
/// simulator stretches it, as it stretches the reduction it joins, by the replicas
/// running it at once (subtracted, it over-predicted two replicas of the sub-millisecond
/// fixtures by 10-14%).
fn replica_sync(m: &Machinery, period: f64, predict: &dyn Fn(&Machinery) -> Option<f64>) -> f64 {
    let step_at = |sync: f64| {
        predict(&Machinery {
            replica_sync: sync,
            ..*m
        })
    };
    super::calibrate::solve(&step_at, period, (0.0, period))
}

/// The two-replica run at ZeRO stage 2 (at `alone`'s micro-batch), made `rounds` times:
/// its step, their median. (Made once, one profile of the vocabulary GPT fitted stage
/// 2's cost to a step of 72 ms where three runs by hand took 76-79, and its layouts at
/// stage 2 came out 6-11% fast.)
///
/// # Errors
/// `Plan` when a run fails (a configuration with `gradient_bucket_mb = 0`, say).
fn zero2_period(run: &ProfileRun<'_>, alone: &Profile, rounds: usize) -> Result<f64> {
    let (run, key) = (&run.as_long_as(alone), (alone.threads, alone.micro_batch));
    let once = || {
        in_folder(run, key, RunKind::Zero2Pair, |dir| {
            pass_seconds(&dir.join("trace.json"), run.warmup).map(|p| p.period)
        })
        .map_err(|reason| Error::Plan {
            what: "measuring two replicas at ZeRO stage 2".into(),
            reason,
        })
    };
    let periods = (0..rounds.max(1))
        .map(|_| once())
        .collect::<Result<Vec<_>>>()?;
    tracing::debug!(
        "two replicas at ZeRO stage 2, micro-batches of {}: {:.3?} ms a step",
        key.1,
        periods.iter().map(|p| p * 1e3).collect::<Vec<_>>()
    );
    Ok(super::rounds::median(&periods).unwrap_or(0.0))
}

/// ZeRO stage 2's cost a micro-batch per parameter value, beyond its reduce-scatter:
/// the value at which two replicas at stage 2 (micro-batches of `b`) simulate to their
/// measured step `period`, everything else as measured in `m`.
fn zero2_per_value(period: f64, b: usize, m: &Machinery, predict: &Predict<'_>) -> f64 {
    let step_at = |k: f64| {
        let with = Machinery {
            zero2_per_value: Some(k),
            ..*m
        };
        predict(b, 2, &with)
    };
    // A microsecond a value a micro-batch: far more than writing and adding it costs.
    super::calibrate::solve(&step_at, period, (0.0, 1e-6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replicas_sync_is_the_cost_at_which_their_run_simulates_to_its_step() {
        let m = Machinery {
            contention: 0.5,
            ..Machinery::bare(2, 1)
        };
        // A 1 ms step whose sync runs at two replicas' shared speed (1.5 times as long).
        let predict = |m: &Machinery| Some(1e-3 + 1.5 * m.replica_sync);
        let sync = replica_sync(&m, 1.3e-3, &predict);
        assert!((sync - 0.2e-3).abs() < 1e-12, "{sync}");
    }
}
