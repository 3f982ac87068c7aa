//! The runtime driven by simulated stages on a virtual clock (`start_paused`): exact and
//! instant, and the same code that trains for real.

use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::schedules::{
    dualpipe_v, interleaved_1f1b, one_f_one_b, simulate, v_half, v_min, zb_h1, zb_v, ActionKind,
    CostModel, Schedule, StageCost,
};
use pipetrain_actors::sim::{CostFn, SimData, SimStage};
use pipetrain_actors::{lowered, replay, run, ActorError, ActorThreads, EngineSettings, RunOutput};

const MS: f64 = 1e-3;

/// F = 1 ms, B = 2 ms (I = W = 1 ms), optimizer step free.
fn costs() -> CostFn {
    Arc::new(|_, _, a| {
        let ms = match a.kind() {
            ActionKind::Forward | ActionKind::BackwardInput | ActionKind::BackwardWeight => 1,
            ActionKind::Backward => 2,
            _ => 0,
        };
        Duration::from_millis(ms)
    })
}

async fn go(
    schedule: Schedule,
    replicas: usize,
    steps: u64,
    record: bool,
) -> Result<RunOutput<SimStage>, ActorError> {
    let stages = schedule.stages();
    let computes = (0..replicas)
        .map(|r| {
            (0..stages)
                .map(|s| SimStage::new(s, stages, r, costs()))
                .collect()
        })
        .collect();
    let settings = EngineSettings {
        watchdog: Duration::from_secs(5),
        record_trace: record,
        threads: ActorThreads::Tasks,
        ..EngineSettings::new(schedule, replicas)
    };
    run(
        &settings,
        computes,
        Arc::new(SimData { stages }),
        Box::new(|s| 0.1 / (1 + s) as f64),
        0..steps,
        |_| {},
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn one_f_one_b_runs_as_simulated() {
    for (p, m) in [(1, 1), (2, 4), (4, 8), (3, 7)] {
        let schedule = one_f_one_b(p, m).unwrap();
        let out = go(schedule.clone(), 1, 2, true).await.unwrap();
        assert_eq!(out.steps.len(), 2);
        // Loss: mean of 1 / (1 + step + mb) over micro-batches; lr from the schedule fn.
        let want: f64 = (0..m).map(|mb| 1.0 / (2.0 + mb as f64)).sum::<f64>() / m as f64;
        assert!((out.steps[1].loss - want).abs() < 1e-12 && out.steps[1].lr == 0.05);
        let trace = out.trace.unwrap();
        // Every rank ran exactly its lowered list, in order.
        for (rank, events) in trace.steps[0][0].ranks.iter().enumerate() {
            let ran: Vec<_> = events.iter().map(|e| e.action).collect();
            assert_eq!(ran, trace.schedule.ranks()[rank], "p={p} m={m} rank {rank}");
        }
        // On a virtual clock with free transfers the run's timeline is the simulator's.
        let measured = trace.steps[0][0].to_timeline(p).unwrap();
        let predicted = simulate(
            &lowered(&schedule).unwrap(),
            &CostModel::uniform(p, StageCost::split(1.0 * MS, 1.0 * MS, 1.0 * MS)),
        )
        .unwrap();
        assert!(
            (measured.makespan() - predicted.makespan()).abs() < 1e-9,
            "p={p} m={m}: {} vs {}",
            measured.makespan(),
            predicted.makespan()
        );
        let closed_form = (p - 1) as f64 / (m + p - 1) as f64;
        assert!((predicted.bubble_fraction() - closed_form).abs() < 1e-9);
        assert!(
            (measured.bubble_fraction() - closed_form).abs() < 1e-9,
            "p={p} m={m}: bubble {} vs {closed_form}, idle {:?} vs {:?}",
            measured.bubble_fraction(),
            measured.idle(),
            predicted.idle()
        );
    }
}

/// The V-placement schedules (two stages per rank) on a virtual clock: each rank idles
/// exactly what the simulator predicts, so the bubble the planner weighs is the runtime's.
#[tokio::test(start_paused = true)]
async fn v_schedules_idle_as_simulated() {
    type Make = fn(usize, usize) -> Result<Schedule, pipetrain_schedules::ScheduleError>;
    let makes: [(&str, Make); 4] = [
        ("zb_v", zb_v),
        ("dualpipe_v", dualpipe_v),
        ("v_half", v_half),
        ("v_min", v_min),
    ];
    for (name, make) in makes {
        for (p, m) in [(2, 4), (3, 6), (4, 8)] {
            let schedule = make(p, m).unwrap();
            let out = go(schedule.clone(), 1, 1, true).await.unwrap();
            let measured = out.trace.unwrap().steps[0][0].to_timeline(p).unwrap();
            let unit = StageCost::split(1.0 * MS, 1.0 * MS, 1.0 * MS);
            let predicted = simulate(
                &lowered(&schedule).unwrap(),
                &CostModel::uniform(2 * p, unit),
            )
            .unwrap();
            assert_eq!((measured.idle().len(), predicted.idle().len()), (p, p));
            for (a, b) in measured.idle().iter().zip(predicted.idle()) {
                assert!(
                    (a - b).abs() < 1e-9,
                    "{name} p={p} m={m}: {:?} vs {:?}",
                    measured.idle(),
                    predicted.idle()
                );
            }
            assert!(
                (measured.makespan() - predicted.makespan()).abs() < 1e-9,
                "{name} p={p} m={m}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn data_parallel_replicas_reduce_and_interleaved_ranks_hold_two_stages() {
    let out = go(one_f_one_b(2, 4).unwrap(), 3, 2, false).await.unwrap();
    assert_eq!(out.computes.len(), 3);
    assert_eq!(out.steps.len(), 2);
    let out = go(interleaved_1f1b(2, 2, 4).unwrap(), 2, 2, true)
        .await
        .unwrap();
    assert_eq!(out.computes[1].len(), 4);
    let zb = go(zb_h1(3, 6).unwrap(), 2, 1, true).await.unwrap();
    assert_eq!(zb.steps.len(), 1);
}

/// A stage that sums its gradients with its replicas' itself (on its device) is asked to,
/// once a step per replica, and never to hand them out (`SimStage` panics then); a single
/// replica too (a one-rank NCCL communicator: `debug.nccl_one_rank`).
#[tokio::test(start_paused = true)]
async fn stages_that_reduce_their_own_gradients_are_left_to_it() {
    for replicas in [3, 1] {
        reduce_own(replicas).await;
    }
}

async fn reduce_own(replicas: usize) {
    let (p, steps) = (2, 4);
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let computes = (0..replicas)
        .map(|r| {
            (0..p)
                .map(|s| SimStage::new(s, p, r, costs()).reducing_its_own(count.clone()))
                .collect()
        })
        .collect();
    let settings = EngineSettings {
        watchdog: Duration::from_secs(5),
        threads: ActorThreads::Tasks,
        ..EngineSettings::new(one_f_one_b(p, 4).unwrap(), replicas)
    };
    let out = run(
        &settings,
        computes,
        Arc::new(SimData { stages: p }),
        Box::new(|_| 0.1),
        0..steps,
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(out.steps.len(), steps as usize);
    let reduced = count.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(reduced, replicas * p * steps as usize);
}

#[tokio::test(start_paused = true)]
async fn a_stage_that_never_sends_fails_the_run_with_who_waits_on_whom() {
    let (p, m) = (4, 8);
    let computes = vec![(0..p)
        .map(|s| {
            let st = SimStage::new(s, p, 0, costs());
            if s == 1 {
                st.hang_in_forward(3)
            } else {
                st
            }
        })
        .collect()];
    let watchdog = Duration::from_secs(2);
    let settings = EngineSettings {
        watchdog,
        threads: ActorThreads::Tasks,
        ..EngineSettings::new(one_f_one_b(p, m).unwrap(), 1)
    };
    let start = tokio::time::Instant::now();
    let err = run(
        &settings,
        computes,
        Arc::new(SimData { stages: p }),
        Box::new(|_| 0.1),
        0..1,
        |_| {},
    )
    .await
    .err()
    .expect("the run must fail");
    let waited = start.elapsed();
    let ActorError::Stalled { report, .. } = &err else {
        panic!("{err}")
    };
    assert!(
        report.contains("replica 0 stage 1 is running F mb 3"),
        "{report}"
    );
    assert!(
        report.contains("replica 0 stage 2 waits for RecvAct mb 3 from stage 1"),
        "{report}"
    );
    assert!(
        report.contains("replica 0 stage 0 waits for RecvGrad mb"),
        "{report}"
    );
    // Within the configured time (plus one watchdog tick and the work before the hang).
    assert!(
        waited <= watchdog + watchdog / 8 + Duration::from_millis(50),
        "{waited:?}"
    );
    assert!(err.to_string().contains("no progress for 2.0s"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn recorded_runs_replay_in_the_same_order() {
    let schedules = [
        one_f_one_b(4, 8).unwrap(),
        zb_h1(4, 8).unwrap(),
        dualpipe_v(2, 6).unwrap(),
        v_half(2, 6).unwrap(),
        v_min(3, 4).unwrap(),
    ];
    for schedule in schedules {
        let out = go(schedule, 2, 2, true).await.unwrap();
        let trace = out.trace.unwrap();
        // Through the file format.
        let text = serde_json::to_string(&trace).unwrap();
        let back: pipetrain_actors::RunTrace = serde_json::from_str(&text).unwrap();
        let (replayed, divergence) = replay(&back).await.unwrap();
        assert_eq!(divergence, None);
        assert_eq!(replayed.steps.len(), 2);
    }
}

#[tokio::test(start_paused = true)]
async fn evaluation_rounds_run_forward_only_between_steps() {
    for schedule in [
        one_f_one_b(3, 4).unwrap(),
        interleaved_1f1b(2, 2, 4).unwrap(),
    ] {
        let stages = schedule.stages();
        let computes = (0..2)
            .map(|r| {
                (0..stages)
                    .map(|s| SimStage::new(s, stages, r, costs()))
                    .collect()
            })
            .collect();
        let settings = EngineSettings {
            watchdog: Duration::from_secs(5),
            threads: ActorThreads::Tasks,
            evaluation: Some(pipetrain_actors::EvalSettings {
                every: 2,
                micro_batches: 3,
            }),
            ..EngineSettings::new(schedule, 2)
        };
        let out = run(
            &settings,
            computes,
            Arc::new(SimData { stages }),
            Box::new(|_| 0.1),
            0..5,
            |_| {},
        )
        .await
        .unwrap();
        let evals: Vec<Option<f64>> = out.steps.iter().map(|s| s.eval_loss).collect();
        // Simulated evaluation losses are 2 + mb: mean over 3 micro-batches = 3.
        assert_eq!(evals, vec![None, Some(3.0), None, Some(3.0), None]);
        assert_eq!(out.steps.len(), 5);
    }
}
