//! The nodes' shares of a pass, set against a cut model's own stages.
//!
//! ONNX Runtime's profile of the whole model gives each node's share of its pass, and
//! the shares are scaled to the pass's time measured without the profiler. A stage
//! of a cut model does not run at its nodes' shares: on the vocabulary GPT (ZB-V, 8
//! micro-batches of 2, cut by parameters) the stage holding the head and the loss ran
//! its forward in 3.53 ms where its shares said 4.25, and the stage of the four layers in
//! 3.55 where they said 3.23. The simulator then rated the cut that gives the head a
//! stage of its own 5% slower than the one by time, and it measured 9% faster.
//!
//! The profile runs the model cut in two where its nodes' times balance (as its
//! two-rank runs are cut: `cost::run_cuts`) with both stages on one rank (ZB-V at one
//! rank), so that no action runs beside another, and records each stage's `F`, `I`
//! and `W`. Each kind's shares are scaled stage by stage to what that run measured, the
//! pass's whole kept: the nodes' shares within a stage still come from the profiler,
//! and the balance between the stages from the run. The backward's two parts are one
//! pass here: the timed run measures the backward whole, and only the profiler splits it
//! into input- and weight-gradient nodes. Kept apart, the input gradient was never set
//! at all, since the first stage has none (hands no gradient back) and a part with a
//! stage without it kept its shares: on the vocabulary GPT cut by parameters (ZB-H1,
//! 8 x 2, traced three times) the second stage's `I` actions, two and a half layers'
//! and the head's, ran 21% over their shares, and those rows came out 9-11% fast. The
//! first stage's empty `I` takes no part. (What is left of that miss is the two ranks
//! beside each other, not the stages' balance: `benches/plan/RESULTS.md`.)
//!
//! Why one rank: read off a two-rank run (ZB-H1), the stages' actions ran beside the
//! other rank's. Every action read, the other rank's slowing came in (on the Llama
//! fixture two stages' actions at once each ran 74-80% slower, and every pipeline layout
//! came out 11-15% slow). Only the actions that ran alone read, the few that did were
//! the odd ones: on the Llama fixture the second stage's forward ran alone in 10 of 388
//! actions, at 371 us where its median was 280, and the factors so set swung from one
//! micro-batch size to the next (the first stage's forward at 1.25 of its shares at one
//! size, 0.82 at the next). On one rank every action is counted and none is slowed.

use pipetrain_actors::RunTrace;
use pipetrain_schedules::ActionKind as K;

use super::measured::Sharded;
use super::Profiles;
use crate::cost::StagePasses;

/// Each stage's `F`, `I` and `W` action in the one-rank run's `trace` of two stages
/// (its first `warmup` steps left out): the median of each, 0 for a kind a stage did not
/// run; `None` where either stage ran no forward.
pub(super) fn stage_passes_in(trace: &RunTrace, warmup: usize) -> Option<StagePasses> {
    let stages = stage_actions_in(trace, warmup);
    let passes = |s: usize| stages.get(s).map(|a| [a[0], a[2], a[3]]);
    let out = [passes(0)?, passes(1)?];
    (out[0][0] > 0.0 && out[1][0] > 0.0).then_some(out)
}

/// Each stage's `F`, `B`, `I` and `W` actions in `trace` (its first `warmup` steps left
/// out, every rank's): the median of each, 0 for a kind a stage did not run.
pub(super) fn stage_actions_in(trace: &RunTrace, warmup: usize) -> Vec<[f64; 4]> {
    let mut times: Vec<[Vec<f64>; 4]> = Vec::new();
    let events = trace
        .steps
        .iter()
        .skip(warmup)
        .filter_map(|replicas| replicas.first())
        .flat_map(|t| t.ranks.iter().flatten());
    for e in events.filter(|e| e.end_ns > e.start_ns) {
        let part = match e.action.kind() {
            K::Forward => 0,
            K::Backward => 1,
            K::BackwardInput => 2,
            K::BackwardWeight => 3,
            _ => continue,
        };
        let stage = e.action.stage();
        if times.len() <= stage {
            times.resize_with(stage + 1, Default::default);
        }
        times[stage][part].push((e.end_ns - e.start_ns) as f64 * 1e-9);
    }
    let median = |v: &Vec<f64>| super::rounds::median(v).unwrap_or(0.0);
    times
        .iter()
        .map(|stage| stage.each_ref().map(median))
        .collect()
}

/// In `trace` (its first `warmup` steps left out), the last stage's actions' time over
/// the other stages' (their medians, a micro-batch's); 0 where either is none.
pub(super) fn last_stage_ratio(trace: &RunTrace, warmup: usize) -> f64 {
    let stages = stage_actions_in(trace, warmup);
    let Some((last, rest)) = stages.split_last() else {
        return 0.0;
    };
    let last: f64 = last.iter().sum();
    let rest: f64 = rest.iter().flatten().sum();
    match last > 0.0 && rest > 0.0 {
        true => last / rest,
        false => 0.0,
    }
}

/// Each stage's actions in `trace` in milliseconds, for the log (`F/B/I/W`, stages
/// apart), to read beside the simulator's.
pub(super) fn stage_actions_text(trace: &RunTrace, warmup: usize) -> String {
    let ms = |a: &[f64; 4]| a.map(|t| format!("{:.3}", t * 1e3)).join("/");
    let stages = stage_actions_in(trace, warmup);
    stages.iter().map(ms).collect::<Vec<_>>().join(" ")
}

/// Per stage, the factor on each kind's node times that brings the `predicted` passes'
/// balance to the `measured` one's, each pass's total kept: the forward's, and the
/// backward's with its input- and weight-gradient parts together (the timed run measured
/// the backward whole; only the profiler split it). A part with no nodes takes no part
/// (the first stage's input gradient); where a part with nodes was not run, its pass
/// keeps factor 1 on every stage.
pub(super) fn factors(predicted: &[(f64, f64, f64)], measured: &StagePasses) -> Vec<[f64; 3]> {
    let mut out = vec![[1.0; 3]; predicted.len()];
    if predicted.len() != measured.len() {
        return out;
    }
    for pass in [&[0][..], &[1, 2]] {
        // (stage, part, predicted, measured) of the parts with nodes.
        let parts: Vec<(usize, usize, f64, f64)> = predicted
            .iter()
            .zip(measured)
            .enumerate()
            .flat_map(|(s, (p, m))| pass.iter().map(move |&k| (s, k, [p.0, p.1, p.2][k], m[k])))
            .filter(|&(_, _, p, _)| p > 0.0)
            .collect();
        if parts.is_empty() || parts.iter().any(|&(_, _, _, m)| m <= 0.0) {
            continue;
        }
        let (p_all, m_all) = parts
            .iter()
            .fold((0.0, 0.0), |a, &(_, _, p, m)| (a.0 + p, a.1 + m));
        for (s, k, p, m) in parts {
            out[s][k] = (m / p) * (p_all / m_all);
        }
    }
    out
}

/// Sets each unsplit profile's node shares to its cut run's stages (see the module),
/// a size without the run taking the nearest size's factors; profiles of a split model
/// are left as they are.
pub(super) fn reshare(profiles: &mut Profiles, whole: &Sharded) {
    type Factors = (usize, Vec<usize>, Vec<[f64; 3]>);
    let measured: Vec<Factors> = profiles
        .iter()
        .filter(|((tp, _), _)| *tp == 1)
        .filter_map(|(&(_, b), p)| {
            let (m, bounds) = (p.stage_passes?, whole.run_bounds(p, 2)?);
            let f = factors(&whole.cut.passes(p, &bounds), &m);
            Some((b, bounds, f))
        })
        .collect();
    for (&(tp, b), p) in profiles.iter_mut() {
        let nearest = measured.iter().min_by_key(|(at, _, _)| at.abs_diff(b));
        if let (1, Some((at, bounds, f))) = (tp, nearest) {
            tracing::debug!("node shares at micro-batches of {b}, from the run at {at}: {f:?}");
            whole.cut.scale_passes(p, bounds, f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipetrain_schedules::{zb_v, Action, Trace, TraceEvent};

    #[test]
    fn each_stage_s_actions_are_their_medians_after_the_warm_up() {
        let (f, i, w) = (
            Action::forward,
            Action::backward_input,
            Action::backward_weight,
        );
        // Microseconds, both stages on one rank. A slow warm-up step (k = 90), then
        // three counted; the first stage's input gradient ran too fast to be timed
        // (a kind not run: 0).
        let step = |k: u64| {
            let ev = |a, from: u64, to: u64| TraceEvent::new(a, from * 1000, to * 1000);
            Trace {
                ranks: vec![vec![
                    ev(f(0, 0), 0, 20 + k),
                    ev(f(1, 0), 200, 240),
                    ev(i(1, 0), 300, 350 + k),
                    ev(w(1, 0), 400, 460),
                    ev(i(0, 0), 500, 500),
                    ev(w(0, 0), 600, 630 - k),
                ]],
            }
        };
        let trace = RunTrace {
            schedule: zb_v(1, 1).unwrap(),
            replicas: 1,
            steps: [90, 1, 2, 3].map(|k| vec![step(k)]).to_vec(),
        };
        let us = |x: f64| (x * 1e6).round();
        let p = stage_passes_in(&trace, 1).unwrap();
        assert_eq!(
            p.map(|s| s.map(us)),
            [[22.0, 0.0, 28.0], [40.0, 52.0, 60.0]]
        );
        // A trace with one stage's forward missing has no balance to read.
        let one_stage = RunTrace {
            steps: vec![vec![Trace {
                ranks: vec![vec![TraceEvent::new(f(0, 0), 0, 1000)]],
            }]],
            ..trace
        };
        assert_eq!(stage_passes_in(&one_stage, 0), None);
    }

    #[test]
    fn every_rank_s_stages_are_read_with_unsplit_backwards_and_written_for_the_log() {
        // Three stages over two ranks, an unsplit backward (`B`), one step, microseconds.
        let ev = |a, from: u64, to: u64| TraceEvent::new(a, from * 1000, to * 1000);
        let (f, b) = (Action::forward, Action::backward);
        let trace = RunTrace {
            schedule: zb_v(1, 1).unwrap(),
            replicas: 1,
            steps: vec![vec![Trace {
                ranks: vec![
                    vec![
                        ev(f(0, 0), 0, 10),
                        ev(f(2, 0), 40, 70),
                        ev(b(0, 0), 200, 230),
                    ],
                    vec![
                        ev(f(1, 0), 10, 30),
                        ev(b(2, 0), 70, 120),
                        ev(b(1, 0), 120, 160),
                    ],
                ],
            }]],
        };
        let us = |x: f64| (x * 1e6).round();
        let stages = stage_actions_in(&trace, 0);
        assert_eq!(
            stages.iter().map(|s| s.map(us)).collect::<Vec<_>>(),
            [
                [10.0, 30.0, 0.0, 0.0],
                [20.0, 40.0, 0.0, 0.0],
                [30.0, 50.0, 0.0, 0.0]
            ]
        );
        assert_eq!(
            stage_actions_text(&trace, 0),
            "0.010/0.030/0.000/0.000 0.020/0.040/0.000/0.000 0.030/0.050/0.000/0.000"
        );
        // The last stage's 80 us against the others' 100.
        assert!((last_stage_ratio(&trace, 0) - 0.8).abs() < 1e-12);
        let empty = RunTrace {
            steps: Vec::new(),
            ..trace
        };
        assert_eq!(last_stage_ratio(&empty, 0), 0.0);
    }

    #[test]
    fn factors_bring_the_stages_to_the_measured_balance_and_keep_each_pass_s_total() {
        // Forward: predicted 4 and 6, measured 3 and 9 (the run's whole 12, the shares'
        // 10): stage 0 at 3/12 of 10, stage 1 at 9/12.
        let predicted = [(4.0, 0.0, 2.0), (6.0, 5.0, 2.0)];
        let measured = [[3.0, 0.001, 2.0], [9.0, 5.0, 6.0]];
        let f = factors(&predicted, &measured);
        assert!((4.0 * f[0][0] - 2.5).abs() < 1e-12);
        assert!((6.0 * f[1][0] - 7.5).abs() < 1e-12);
        // The backward: stage 0 has no input-gradient nodes (its 1 us action takes no
        // part); the others, 2, 5 and 2 against 2, 5 and 6, go to the measured balance
        // with the shares' total 9 kept: the input gradient against the weight
        // gradients too, which the profiler alone had split.
        assert_eq!(f[0][1], 1.0);
        let scaled = [2.0 * f[0][2], 5.0 * f[1][1], 2.0 * f[1][2]];
        for (got, m) in scaled.iter().zip([2.0, 5.0, 6.0]) {
            assert!((got - m * 9.0 / 13.0).abs() < 1e-12, "{scaled:?}");
        }
    }

    #[test]
    fn a_kind_a_stage_did_not_run_keeps_its_shares() {
        let f = factors(
            &[(1.0, 1.0, 1.0), (1.0, 1.0, 1.0)],
            &[[1.0, 0.0, 1.0], [3.0, 1.0, 1.0]],
        );
        // Stage 0's input-gradient nodes did not run: the backward keeps its shares.
        assert_eq!(f[0][1..], [1.0, 1.0]);
        assert_eq!(f[1][1..], [1.0, 1.0]);
        assert!((f[0][0] - 0.5).abs() < 1e-12 && (f[1][0] - 1.5).abs() < 1e-12);
    }
}
