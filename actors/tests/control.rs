//! An embedder's requests to a running run, on simulated stages and a virtual clock: a
//! checkpoint now (saved after the step in progress or the next one, which is already
//! handed out; answered once complete) and a stop (the steps handed out finish, a last
//! checkpoint is saved, the run ends normally); the update decision waits for every stage
//! of every replica meanwhile (clipping is on).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipetrain_actors::schedules::{one_f_one_b, ActionKind};
use pipetrain_actors::sim::{CostFn, SimData, SimStage};
use pipetrain_actors::{
    run, ActorThreads, BoxError, CheckpointSettings, Checkpointer, CommitState, EngineSettings,
    GradPolicy, RunControl, ShardFile,
};

/// Every action takes 1 ms.
fn costs() -> CostFn {
    Arc::new(|_, _, a| match a.kind() {
        ActionKind::AllReduce | ActionKind::OptimizerStep => Duration::ZERO,
        _ => Duration::from_millis(1),
    })
}

/// Records which checkpoints were completed, in order.
#[derive(Default)]
struct Recorder {
    committed: Mutex<Vec<u64>>,
}

impl Checkpointer for Recorder {
    fn prepare(&self, steps_done: u64) -> Result<PathBuf, BoxError> {
        Ok(PathBuf::from(format!("ckpt-{steps_done}")))
    }

    fn commit(
        &self,
        dir: &Path,
        state: CommitState,
        _: Vec<ShardFile>,
    ) -> Result<PathBuf, BoxError> {
        self.committed.lock().unwrap().push(state.steps_done);
        Ok(dir.to_path_buf())
    }
}

fn settings(recorder: &Arc<Recorder>, every: u64) -> (EngineSettings, flume::Sender<RunControl>) {
    let (tx, rx) = flume::unbounded();
    let s = EngineSettings {
        threads: ActorThreads::Tasks,
        checkpoint: Some(CheckpointSettings {
            every,
            checkpointer: recorder.clone(),
        }),
        control: Some(rx),
        // Clipping: every optimizer step waits for all stages' statistics.
        policy: GradPolicy {
            max_norm: Some(1.0),
            ..GradPolicy::default()
        },
        ..EngineSettings::new(one_f_one_b(2, 4).unwrap(), 2)
    };
    (s, tx)
}

fn computes() -> Vec<Vec<SimStage>> {
    (0..2)
        .map(|r| (0..2).map(|s| SimStage::new(s, 2, r, costs())).collect())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn checkpoint_now_saves_after_the_step_in_progress() {
    let recorder = Arc::new(Recorder::default());
    let (settings, control) = settings(&recorder, 1000);
    let asker = tokio::spawn(async move {
        // A step takes 10 ms (1F1B, p = 2, m = 4, F = B = 1 ms): ask during step 3.
        tokio::time::sleep(Duration::from_micros(32_500)).await;
        let (reply, rx) = tokio::sync::oneshot::channel();
        control.send(RunControl::CheckpointNow(reply)).unwrap();
        rx.await.unwrap()
    });
    let out = run(
        &settings,
        computes(),
        Arc::new(SimData { stages: 2 }),
        Box::new(|_| 0.1),
        0..10,
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(out.steps.len(), 10);
    let saved = asker.await.unwrap().unwrap();
    let committed = recorder.committed.lock().unwrap().clone();
    assert_eq!(
        committed.len(),
        2,
        "the one asked for, and the last: {committed:?}"
    );
    // Asked during step 4 (steps overlap: ~6.5 ms each); one step is always handed out
    // ahead, so the checkpoint follows step 4 or 5 at the latest... or 6 at a boundary.
    assert!(
        (4..=6).contains(&saved.steps_done),
        "saved after {} steps",
        saved.steps_done
    );
    assert_eq!(committed, vec![saved.steps_done, 10]);
}

#[tokio::test(start_paused = true)]
async fn stop_finishes_the_step_saves_and_ends() {
    let recorder = Arc::new(Recorder::default());
    let (settings, control) = settings(&recorder, 4);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_micros(52_500)).await;
        control.send(RunControl::Stop).unwrap();
    });
    let out = run(
        &settings,
        computes(),
        Arc::new(SimData { stages: 2 }),
        Box::new(|_| 0.1),
        0..100,
        |_| {},
    )
    .await
    .unwrap();
    let n = out.steps.len() as u64;
    assert!((5..=8).contains(&n), "stopped after {n} steps");
    let committed = recorder.committed.lock().unwrap().clone();
    assert_eq!(committed, vec![4, n], "the periodic one, then the stop's");
    assert!(out
        .steps
        .iter()
        .enumerate()
        .all(|(i, s)| s.step == i as u64));
}
