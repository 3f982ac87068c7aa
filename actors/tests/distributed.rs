//! One run spread over two "processes" (two engines in this test process, each with its
//! own members, scheduler and coordinator), joined by forwarding mailboxes, a shared
//! in-memory bus and the in-process collective: the same steps, losses and decisions as
//! the run in one engine, and each checkpoint completed once, by process 0.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipetrain_actors::schedules::{one_f_one_b, ActionKind};
use pipetrain_actors::sim::{CostFn, SimData, SimStage};
use pipetrain_actors::{
    run, run_distributed, ActorError, ActorThreads, BoxError, Bus, CheckpointSettings,
    Checkpointer, CommitState, DistributedOutput, Distribution, EngineSettings, EvalSettings,
    Gathered, GradPolicy, LocalCollective, ShardFile, StepResult, Transfer,
};
use tokio::sync::Notify;

fn costs() -> CostFn {
    Arc::new(|_, _, a| match a.kind() {
        ActionKind::AllReduce | ActionKind::OptimizerStep => Duration::ZERO,
        _ => Duration::from_millis(1),
    })
}

/// Each key's contributions so far, by process.
type Pending = HashMap<String, Vec<Option<Vec<u8>>>>;

/// Forwarding channels by (replica, rank).
type Links<T> = HashMap<(usize, usize), T>;

/// All-gathers between engines in one process.
struct MemBus {
    node: usize,
    shared: Arc<(Mutex<Pending>, Notify)>,
}

impl Bus for MemBus {
    fn node(&self) -> usize {
        self.node
    }
    fn nodes(&self) -> usize {
        2
    }
    fn all_gather(&self, key: String, data: Vec<u8>) -> Gathered<'_> {
        Box::pin(async move {
            {
                let mut map = self.shared.0.lock().unwrap();
                map.entry(key.clone()).or_insert_with(|| vec![None, None])[self.node] = Some(data);
            }
            self.shared.1.notify_waiters();
            loop {
                let notified = self.shared.1.notified();
                {
                    let map = self.shared.0.lock().unwrap();
                    if let Some(parts) = map.get(&key).filter(|p| p.iter().all(Option::is_some)) {
                        return Ok(parts.iter().flatten().cloned().collect());
                    }
                }
                notified.await;
            }
        })
    }
}

#[derive(Default)]
struct Recorder {
    committed: Mutex<Vec<(u64, usize)>>,
}

impl Checkpointer for Recorder {
    fn prepare(&self, steps_done: u64) -> Result<PathBuf, BoxError> {
        Ok(PathBuf::from(format!("ckpt-{steps_done}")))
    }
    fn commit(
        &self,
        dir: &Path,
        state: CommitState,
        shards: Vec<ShardFile>,
    ) -> Result<PathBuf, BoxError> {
        self.committed
            .lock()
            .unwrap()
            .push((state.steps_done, shards.len()));
        Ok(dir.to_path_buf())
    }
}

fn settings(recorder: &Arc<Recorder>) -> EngineSettings {
    EngineSettings {
        threads: ActorThreads::Tasks,
        evaluation: Some(EvalSettings {
            every: 2,
            micro_batches: 2,
        }),
        policy: GradPolicy {
            max_norm: Some(1.0),
            ..GradPolicy::default()
        },
        checkpoint: Some(CheckpointSettings {
            every: 3,
            checkpointer: recorder.clone(),
        }),
        ..EngineSettings::new(one_f_one_b(2, 4).unwrap(), 2)
    }
}

type Outcome = Result<DistributedOutput<SimStage>, ActorError>;

/// Starts the two processes: process p runs replica p (both its ranks). Mailboxes of the
/// other process are forwarding channels, connected once that process hands its
/// mailboxes out. `hang`: process 1's stage 0 never finishes the forward of this
/// micro-batch; `places`: each process knows the other as `node a` / `node b`.
fn start_two(
    settings: &EngineSettings,
    hang: Option<usize>,
    places: bool,
) -> Vec<tokio::task::JoinHandle<Outcome>> {
    let bus_shared = Arc::new((Mutex::new(HashMap::new()), Notify::new()));
    let collective = Arc::new(LocalCollective::spawn(
        2,
        2,
        &mut tokio::task::JoinSet::new(),
    ));
    let mut forward_rx: Vec<Links<flume::Receiver<Transfer<usize>>>> =
        vec![HashMap::new(), HashMap::new()];
    let mut peers: Vec<Links<flume::Sender<Transfer<usize>>>> =
        vec![HashMap::new(), HashMap::new()];
    for p in 0..2 {
        for rank in 0..2 {
            let (tx, rx) = flume::unbounded();
            peers[1 - p].insert((p, rank), tx);
            forward_rx[p].insert((p, rank), rx);
        }
    }
    let mut runs = Vec::new();
    for p in 0..2 {
        let fwd = std::mem::take(&mut forward_rx[p]);
        let other = 1 - p;
        let names = ["node a", "node b"];
        let dist = Distribution {
            peers: std::mem::take(&mut peers[p]),
            deliver: Box::new(
                move |mine: HashMap<(usize, usize), flume::Sender<Transfer<usize>>>| {
                    for (key, rx) in fwd {
                        let to = mine[&key].clone();
                        tokio::spawn(async move {
                            while let Ok(t) = rx.recv_async().await {
                                if to.send_async(t).await.is_err() {
                                    break;
                                }
                            }
                        });
                    }
                },
            ),
            collective: collective.clone(),
            bus: Arc::new(MemBus {
                node: p,
                shared: bus_shared.clone(),
            }),
            places: match places {
                true => (0..2)
                    .map(|rank| ((other, rank), names[other].to_string()))
                    .collect(),
                false => HashMap::new(),
            },
        };
        let computes: HashMap<(usize, usize), SimStage> = (0..2)
            .map(|s| {
                let st = SimStage::new(s, 2, p, costs());
                let st = match hang {
                    Some(mb) if p == 1 && s == 0 => st.hang_in_forward(mb),
                    _ => st,
                };
                ((p, s), st)
            })
            .collect();
        let settings = settings.clone();
        runs.push(tokio::spawn(async move {
            run_distributed(
                &settings,
                computes,
                Arc::new(SimData { stages: 2 }),
                Box::new(|_| 0.1),
                0..6,
                |_| {},
                dist,
            )
            .await
        }));
    }
    runs
}

/// A member of the other process that stays silent (its forward never ends) trips this
/// process's watchdog, whose report names the member and where it runs.
#[tokio::test(start_paused = true)]
async fn the_watchdog_names_a_silent_member_of_another_process() {
    let settings = EngineSettings {
        watchdog: Duration::from_secs(2),
        checkpoint: None,
        ..settings(&Arc::new(Recorder::default()))
    };
    let mut runs = start_two(&settings, Some(1), true);
    let _p1 = runs.pop().unwrap();
    let Err(ActorError::Stalled { report, .. }) = runs.pop().unwrap().await.unwrap() else {
        panic!("process 0 ran on past a silent member");
    };
    assert!(
        report.contains("from the other replicas of stage 0 (replica 1 rank 0 on node b)"),
        "{report}"
    );
}

fn losses(steps: &[StepResult]) -> Vec<(u64, f64, Option<f64>, f64)> {
    steps
        .iter()
        .map(|s| (s.step, s.loss, s.eval_loss, s.grad_norm))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn two_processes_run_as_one() {
    let whole_recorder = Arc::new(Recorder::default());
    let computes: Vec<Vec<SimStage>> = (0..2)
        .map(|r| (0..2).map(|s| SimStage::new(s, 2, r, costs())).collect())
        .collect();
    let whole = run(
        &settings(&whole_recorder),
        computes,
        Arc::new(SimData { stages: 2 }),
        Box::new(|_| 0.1),
        0..6,
        |_| {},
    )
    .await
    .unwrap();

    let recorder = Arc::new(Recorder::default());
    let mut runs = start_two(&settings(&recorder), None, false);
    let p1 = runs.pop().unwrap().await.unwrap().unwrap();
    let p0 = runs.pop().unwrap().await.unwrap().unwrap();
    assert_eq!(
        losses(&p0.steps),
        losses(&whole.steps),
        "process 0 reports the whole run"
    );
    assert_eq!(
        losses(&p1.steps),
        losses(&whole.steps),
        "and so does process 1"
    );
    assert_eq!(p0.computes.len(), 2);
    let committed = recorder.committed.lock().unwrap().clone();
    let once: Vec<u64> = committed.iter().map(|c| c.0).collect();
    assert_eq!(
        once,
        vec![3, 6],
        "each checkpoint completed once: {committed:?}"
    );
    assert_eq!(
        whole_recorder
            .committed
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>(),
        vec![3, 6]
    );
}
