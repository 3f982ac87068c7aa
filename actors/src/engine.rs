//! Starting a run: the actors, their mailboxes, and the order they stop in.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::{lower, validate, Action, LowerOptions, Schedule, Trace};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::checkpoint::CheckpointSettings;
use crate::collective::LocalCollective;
use crate::coordinator::{CoordinatorHandle, CoordinatorSettings, StepResult};
use crate::data::spawn_data_actor;
use crate::decide::{GradPolicy, ScalerState};
use crate::error::ActorError;
use crate::scheduler::{Member, RunControl, SchedulerActor};
use crate::stage::{StageActor, Status};
use crate::traits::{DataSource, StageCompute};

/// How long a failed run waits for checkpoints already being written to complete.
const SAVE_GRACE: Duration = Duration::from_secs(60);

/// How to run.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The compute-only schedule (F, B, I, W per rank); the engine adds the transfers,
    /// the all-reduce and the optimizer step.
    pub schedule: Schedule,
    /// Data-parallel replicas.
    pub replicas: usize,
    /// Fail the run when no actor makes progress for this long.
    pub watchdog: Duration,
    /// Record what every actor did (see [`RunTrace`]).
    pub record_trace: bool,
    /// Where stage actors run.
    pub threads: ActorThreads,
    /// Evaluate on the data source's evaluation set now and then.
    pub evaluation: Option<EvalSettings>,
    /// Clipping and loss scaling.
    pub policy: GradPolicy,
    /// The loss scaler's state to start from (a resumed run's); `None`: the policy's
    /// initial state.
    pub scaler: Option<ScalerState>,
    /// Save checkpoints now and then.
    pub checkpoint: Option<CheckpointSettings>,
    /// Requests from an embedder: a checkpoint now, a stop after the current step.
    pub control: Option<flume::Receiver<RunControl>>,
    /// How long a stage actor polls its mailboxes before parking its thread: worth it
    /// when every stage actor has a core of its own (zero otherwise: polling would take
    /// the cores others compute on).
    pub spin: Duration,
}

impl EngineSettings {
    /// Runs `schedule` on `replicas` replicas with the defaults: a 300 s watchdog, no
    /// trace, stage actors on their own threads, no evaluation, no clipping or loss
    /// scaling, no checkpoints.
    pub fn new(schedule: Schedule, replicas: usize) -> EngineSettings {
        EngineSettings {
            schedule,
            replicas,
            watchdog: Duration::from_secs(300),
            record_trace: false,
            threads: ActorThreads::Dedicated,
            evaluation: None,
            policy: GradPolicy::default(),
            scaler: None,
            checkpoint: None,
            control: None,
            spin: Duration::ZERO,
        }
    }
}

/// When and how much to evaluate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalSettings {
    /// After every this many optimizer steps.
    pub every: u64,
    /// Evaluation micro-batches per replica.
    pub micro_batches: usize,
}

/// A rank's forward-only list for `k` evaluation micro-batches: micro-batch by
/// micro-batch, its stages in order, receiving from and sending to other ranks.
fn eval_actions(placement: &[usize], rank: usize, k: usize) -> Vec<Action> {
    let last = placement.len() - 1;
    let mut list = Vec::new();
    for mb in 0..k {
        for s in (0..placement.len()).filter(|&s| placement[s] == rank) {
            if s > 0 && placement[s - 1] != rank {
                list.push(Action::recv_act(s, mb));
            }
            list.push(Action::forward(s, mb));
            if s < last && placement[s + 1] != rank {
                list.push(Action::send_act(s, mb));
            }
        }
    }
    list
}

/// Where stage actors run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActorThreads {
    /// As tokio tasks: for computes that only await (simulated stages on a paused clock).
    Tasks,
    /// Each on an OS thread of its own, driving its future with the runtime's handle:
    /// for computes that block while they compute (ONNX Runtime), which would otherwise
    /// stall a tokio worker. An actor's thread wakes directly when a message arrives, with
    /// no task hand-off between workers.
    Dedicated,
}

/// Stage actors started one way or the other.
enum Running<C> {
    Tasks(JoinSet<StageActorResult<C>>),
    Threads(Vec<std::thread::JoinHandle<StageActorResult<C>>>),
}

/// What every actor did, step by step: enough to draw the run and to replay it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunTrace {
    /// The lowered schedule every step ran.
    pub schedule: Schedule,
    /// Data-parallel replicas.
    pub replicas: usize,
    /// `steps[s][r]`: replica `r`'s trace of step `s` (times from the run's start).
    pub steps: Vec<Vec<Trace>>,
}

/// What a stage actor hands back: its index among the scheduler's members, its computes.
type StageActorResult<C> = Result<(usize, HashMap<usize, C>), ActorError>;

/// The outcome of [`run`].
pub struct RunOutput<C> {
    /// One result per step.
    pub steps: Vec<StepResult>,
    /// The trace, when recorded.
    pub trace: Option<RunTrace>,
    /// The stage computes, handed back (`[replica][stage]`), e.g. to export parameters.
    pub computes: Vec<Vec<C>>,
}

/// The lowered schedule the engine runs: transfers, then all-reduce and optimizer step.
///
/// # Errors
/// What lowering or validation refuse.
pub fn lowered(schedule: &Schedule) -> Result<Schedule, ActorError> {
    let l = lower(
        schedule,
        LowerOptions {
            all_reduce: true,
            optimizer_step: true,
        },
    )?;
    validate(&l)?;
    Ok(l)
}

/// Runs `steps` optimizer steps: `computes[replica][stage]` does the work, `data` feeds
/// it, `lr_at` gives each step's learning rate, `on_step` sees each step's result.
///
/// # Errors
/// `Settings` when the computes do not match the schedule; any actor's error; `Stalled`
/// with the who-waits-on-whom report when nothing moves for `settings.watchdog`.
///
/// # Cancel safety
/// Dropping the future aborts every actor of the run.
pub async fn run<C, D>(
    settings: &EngineSettings,
    computes: Vec<Vec<C>>,
    data: Arc<D>,
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    steps: std::ops::Range<u64>,
    on_step: impl FnMut(&StepResult) + Send,
) -> Result<RunOutput<C>, ActorError>
where
    C: StageCompute,
    D: DataSource<Payload = C::Payload>,
{
    let schedule = lowered(&settings.schedule)?;
    let (stages, ranks, m) = (
        schedule.stages(),
        schedule.num_ranks(),
        schedule.micro_batches(),
    );
    let replicas = settings.replicas;
    if replicas == 0 || computes.len() != replicas || computes.iter().any(|c| c.len() != stages) {
        return Err(ActorError::Settings {
            reason: format!(
                "{replicas} replicas x {stages} stages of compute needed, got {:?}",
                computes.iter().map(Vec::len).collect::<Vec<_>>()
            ),
        });
    }
    let mut helpers: JoinSet<Result<(), ActorError>> = JoinSet::new();
    let mut actors = match settings.threads {
        ActorThreads::Tasks => Running::Tasks(JoinSet::new()),
        ActorThreads::Dedicated => Running::Threads(Vec::new()),
    };
    let coordinator = CoordinatorHandle::spawn(
        CoordinatorSettings {
            lr_at,
            expected_losses: replicas * m,
            replicas,
            stages,
            policy: settings.policy,
            scaler: settings
                .scaler
                .unwrap_or_else(|| settings.policy.scaling.initial_state()),
            checkpointer: settings.checkpoint.as_ref().map(|c| c.checkpointer.clone()),
        },
        replicas * ranks,
        &mut helpers,
    );
    let collective = Arc::new(LocalCollective::spawn(stages, replicas, &mut helpers));
    let progress = Arc::new(AtomicU64::new(0));
    let origin = Instant::now();
    let placement = schedule.placement().to_vec();
    let eval_k = settings.evaluation.map_or(0, |e| e.micro_batches);
    let mut members = Vec::new();
    for (replica, replica_computes) in computes.into_iter().enumerate() {
        // A rank's mailbox holds every transfer one round (a step, or an evaluation) can
        // address to it, so no send ever waits on a full mailbox while its receiver
        // waits on the sender.
        let capacity = |rank: usize| {
            let train = schedule.ranks()[rank]
                .iter()
                .filter(|a| a.kind().is_transfer())
                .count();
            train.max(eval_actions(&placement, rank, eval_k).len()) + 1
        };
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..ranks).map(|r| flume::bounded(capacity(r))).unzip();
        let mut by_rank: Vec<HashMap<usize, C>> = (0..ranks).map(|_| HashMap::new()).collect();
        for (stage, c) in replica_computes.into_iter().enumerate() {
            by_rank[placement[stage]].insert(stage, c);
        }
        for (rank, (inbox, local)) in rxs.into_iter().zip(by_rank).enumerate() {
            let mut feeds = HashMap::new();
            for &stage in local.keys() {
                if data.feeds(stage) {
                    let rx = spawn_data_actor(
                        data.clone(),
                        replica,
                        stage,
                        m,
                        steps.clone(),
                        &mut helpers,
                    );
                    feeds.insert(stage, rx);
                }
            }
            let (control_tx, control_rx) = flume::bounded(1);
            let (status_tx, status_rx) = watch::channel(Status::Idle);
            let mut stage_ids: Vec<usize> = local.keys().copied().collect();
            stage_ids.sort_unstable();
            members.push(Member {
                replica,
                rank,
                stages: stage_ids,
                control: control_tx,
                status: status_rx,
            });
            let actor = StageActor {
                replica,
                rank,
                actions: schedule.ranks()[rank].clone(),
                placement: placement.clone(),
                computes: local,
                inbox,
                peers: txs.clone(),
                data: feeds,
                data_ahead: HashMap::new(),
                control: control_rx,
                eval_actions: eval_actions(&placement, rank, eval_k),
                collective: collective.clone(),
                status: status_tx,
                progress: progress.clone(),
                origin,
                record: settings.record_trace,
                coordinator: coordinator.clone(),
                policy: settings.policy,
                spin: settings.spin,
            };
            let index = members.len() - 1;
            let body = async move { actor.run().await.map(|c| (index, c)) };
            match &mut actors {
                Running::Tasks(set) => {
                    set.spawn(body);
                }
                Running::Threads(threads) => {
                    let handle = tokio::runtime::Handle::current();
                    let thread = std::thread::Builder::new()
                        .name(format!("stage-actor-r{replica}-k{rank}"))
                        .spawn(move || handle.block_on(body))
                        .map_err(|e| ActorError::Settings {
                            reason: format!("cannot start a stage actor thread: {e}"),
                        })?;
                    threads.push(thread);
                }
            }
        }
    }
    let evaluation = settings.evaluation.map(|e| {
        let source = data.clone();
        let placement = placement.clone();
        let data: crate::scheduler::EvalData<C::Payload> = Box::new(move |replica, rank| {
            let mut per_stage = HashMap::new();
            for stage in (0..placement.len()).filter(|&s| placement[s] == rank && source.feeds(s)) {
                let batches = (0..e.micro_batches)
                    .map(|mb| {
                        source
                            .eval_micro_batch(replica, mb, stage)
                            .map_err(|source| ActorError::Data {
                                replica,
                                step: u64::MAX,
                                micro_batch: mb,
                                source,
                            })
                    })
                    .collect::<Result<std::collections::VecDeque<_>, _>>()?;
                per_stage.insert(stage, batches);
            }
            Ok(per_stage)
        });
        crate::scheduler::Evaluation {
            every: e.every.max(1),
            data,
        }
    });
    let survivor = coordinator.clone();
    let scheduler = SchedulerActor {
        members,
        coordinator,
        progress,
        watchdog: settings.watchdog,
        replicas,
        ranks,
        evaluation,
        checkpoint: settings.checkpoint.clone(),
        last_step: steps.end.saturating_sub(1),
        control: settings.control.clone(),
    };
    let mut results = Vec::new();
    let mut on_step = on_step;
    let traces = scheduler
        .run(steps, |r| {
            results.push(r.clone());
            on_step(r);
        })
        .await;
    // The scheduler's control handles are gone: stage actors finish and hand back their
    // computes. On failure, tear everything down instead.
    let traces = match traces {
        Ok(t) => t,
        Err(e) => {
            // Threads cannot be aborted: they end when their channels close, and one
            // stuck in a compute that never returns stays until the process exits.
            if let Running::Tasks(set) = &mut actors {
                set.abort_all();
            }
            // Checkpoints of steps before the failure, already snapshotted, are still
            // completed: the last complete checkpoint is the newest good one.
            let wait = tokio::time::timeout(SAVE_GRACE, survivor.finish()).await;
            if !matches!(wait, Ok(Ok(_))) {
                tracing::warn!("checkpoints in progress when the run failed were not completed");
            }
            helpers.abort_all();
            return Err(e);
        }
    };
    let mut returned: Vec<Option<(usize, HashMap<usize, C>)>> = Vec::new();
    match actors {
        Running::Tasks(mut set) => {
            while let Some(joined) = set.join_next().await {
                let (index, c) = joined.map_err(|e| ActorError::ActorGone {
                    actor: format!("a stage actor ({e})"),
                })??;
                returned.push(Some((index, c)));
            }
        }
        Running::Threads(threads) => {
            for t in threads {
                let joined = tokio::task::spawn_blocking(move || t.join())
                    .await
                    .map_err(|e| ActorError::ActorGone {
                        actor: format!("a stage actor thread ({e})"),
                    })?;
                let (index, c) = joined.map_err(|_| ActorError::ActorGone {
                    actor: "a stage actor thread (it panicked)".into(),
                })??;
                returned.push(Some((index, c)));
            }
        }
    }
    helpers.abort_all();
    let mut computes: Vec<Vec<Option<C>>> = (0..replicas)
        .map(|_| (0..stages).map(|_| None).collect())
        .collect();
    let per_replica = ranks;
    for (index, map) in returned.into_iter().flatten() {
        let replica = index / per_replica;
        for (stage, c) in map {
            computes[replica][stage] = Some(c);
        }
    }
    let computes = computes
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|c| {
                    c.ok_or_else(|| ActorError::ActorGone {
                        actor: "a stage compute".into(),
                    })
                })
                .collect()
        })
        .collect::<Result<Vec<Vec<C>>, ActorError>>()?;
    Ok(RunOutput {
        steps: results,
        trace: settings.record_trace.then_some(RunTrace {
            schedule,
            replicas,
            steps: traces,
        }),
        computes,
    })
}
