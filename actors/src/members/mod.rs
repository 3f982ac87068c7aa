//! Starting the stage actors this process runs, running the scheduler over them, and
//! stopping everything in order: the body of [`crate::run`] and
//! [`crate::run_distributed`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use pipetrain_schedules::Schedule;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::coordinator::{CoordinatorHandle, CoordinatorSettings, StepResult};
use crate::engine::{
    eval_actions, lowered, ActorThreads, EngineSettings, Mailboxes, RunTrace, SAVE_GRACE,
};
use crate::error::ActorError;
use crate::messages::Transfer;
use crate::places::Places;
use crate::scheduler::SchedulerActor;
use crate::traits::{Bus, Collective, DataSource, StageCompute};

mod start;

use start::{Running, Start};

/// Where the stage actors of other processes are, for a run spread over several.
pub(crate) struct Remote<P> {
    /// Mailboxes of other processes' stage actors, by (replica, rank).
    pub peers: Mailboxes<P>,
    /// Hands this process's mailboxes to the transport, by (replica, rank).
    pub deliver: Box<dyn FnOnce(Mailboxes<P>) + Send>,
    /// The control plane.
    pub bus: Arc<dyn Bus>,
    /// Where the other processes' members run, by (replica, rank).
    pub places: HashMap<(usize, usize), String>,
}

/// What [`run_members`] returns: the per-step results, the trace, and the computes of
/// this process's members by (replica, stage).
pub(crate) type MembersOutput<C> = (Vec<StepResult>, Option<RunTrace>, Vec<((usize, usize), C)>);

/// Runs `steps` with this process's members: `computes` by (replica, stage) (every
/// stage of a rank this process runs), `collective` reducing across replicas, `remote`
/// for the rest of a distributed job. In phases: which members are local, the
/// coordinator, the mailboxes, the stage actors, the scheduler's run, and the stage
/// actors' computes handed back (or everything torn down on failure).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_members<C, D, K>(
    settings: &EngineSettings,
    mut computes: HashMap<(usize, usize), C>,
    data: Arc<D>,
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    steps: std::ops::Range<u64>,
    on_step: impl FnMut(&StepResult) + Send,
    collective: Arc<K>,
    remote: Option<Remote<C::Payload>>,
) -> Result<MembersOutput<C>, ActorError>
where
    C: StageCompute,
    D: DataSource<Payload = C::Payload>,
    K: Collective,
{
    let schedule = lowered(&settings.schedule)?;
    let local = local_members(&schedule, &computes, settings.replicas, remote.is_some())?;
    let distributed = remote.is_some();
    let mut helpers: JoinSet<Result<(), ActorError>> = JoinSet::new();
    let coordinator = spawn_coordinator(settings, &schedule, &local, lr_at, &remote, &mut helpers);
    let (peers, mut inboxes, places) = mailboxes(settings, &schedule, &local, remote);
    let start = Start {
        settings,
        schedule: &schedule,
        data: &data,
        steps: &steps,
        collective: &collective,
        coordinator: &coordinator,
        peers: &peers,
        places: &places,
        progress: Arc::new(AtomicU64::new(0)),
        origin: Instant::now(),
    };
    let mut members = Vec::new();
    let mut actors = match settings.threads {
        ActorThreads::Tasks => Running::Tasks(JoinSet::new()),
        ActorThreads::Dedicated => Running::Threads(start::StageThreads::new()),
    };
    for &(replica, rank) in &local {
        let inbox = inboxes
            .remove(&(replica, rank))
            .ok_or_else(|| ActorError::Settings {
                reason: format!("replica {replica} rank {rank} twice"),
            })?;
        let mine: HashMap<usize, C> = schedule
            .stages_of(rank)
            .filter_map(|s| computes.remove(&(replica, s)).map(|c| (s, c)))
            .collect();
        let (member, actor) = start.member(replica, rank, mine, inbox, &mut helpers)?;
        members.push(member);
        actors.spawn(actor, members.len() - 1)?;
    }
    let progress = start.progress.clone();
    let scheduler = SchedulerActor {
        members,
        coordinator: coordinator.clone(),
        progress,
        watchdog: settings.watchdog,
        replicas: settings.replicas,
        shards: settings.shards.max(1),
        ranks: schedule.num_ranks(),
        evaluation: evaluation(settings, &data, schedule.placement()),
        checkpoint: settings.checkpoint.clone(),
        last_step: steps.end.saturating_sub(1),
        control: settings.control.clone(),
        shared_stop: distributed,
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
        Err(e) => return Err(tear_down(actors, &coordinator, helpers, e).await),
    };
    let returned = actors.join().await?;
    helpers.abort_all();
    // Members' indices follow `local`: the scheduler's order.
    let mut out = Vec::new();
    for (index, map) in returned {
        let (replica, _) = local[index];
        out.extend(map.into_iter().map(|(stage, c)| ((replica, stage), c)));
    }
    let trace = settings.record_trace.then_some(RunTrace {
        schedule,
        replicas: settings.replicas,
        steps: traces,
    });
    Ok((results, trace, out))
}

/// The (replica, rank) members this process runs: those it has every stage of. An error
/// where it has some of a member's stages only, or (not distributed) not all members.
fn local_members<C>(
    schedule: &Schedule,
    computes: &HashMap<(usize, usize), C>,
    replicas: usize,
    distributed: bool,
) -> Result<Vec<(usize, usize)>, ActorError> {
    let (stages, ranks) = (schedule.stages(), schedule.num_ranks());
    let mut local = Vec::new();
    for replica in 0..replicas {
        for rank in 0..ranks {
            let owned: Vec<bool> = schedule
                .stages_of(rank)
                .map(|s| computes.contains_key(&(replica, s)))
                .collect();
            match (owned.iter().all(|&x| x), owned.iter().any(|&x| x)) {
                (true, _) => local.push((replica, rank)),
                (false, false) => {}
                (false, true) => {
                    return Err(ActorError::Settings {
                        reason: format!(
                            "replica {replica} rank {rank}: only some of its stages have a compute"
                        ),
                    })
                }
            }
        }
    }
    if local.is_empty() || (!distributed && local.len() != replicas * ranks) {
        return Err(ActorError::Settings {
            reason: format!(
                "{replicas} replicas x {stages} stages of compute needed, got {} members",
                local.len()
            ),
        });
    }
    Ok(local)
}

/// Starts the coordinator among `helpers`.
fn spawn_coordinator<P>(
    settings: &EngineSettings,
    schedule: &Schedule,
    local: &[(usize, usize)],
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    remote: &Option<Remote<P>>,
    helpers: &mut JoinSet<Result<(), ActorError>>,
) -> CoordinatorHandle {
    let shards = settings.shards.max(1);
    let local_stats = local
        .iter()
        .map(|&(_, rank)| schedule.stages_of(rank).count())
        .sum();
    let settings = CoordinatorSettings {
        lr_at,
        expected_losses: settings.replicas / shards * schedule.micro_batches(),
        replicas: settings.replicas,
        shards,
        partial_stats: settings.partial_stats,
        stages: schedule.stages(),
        local_stats,
        bus: remote.as_ref().map(|r| r.bus.clone()),
        policy: settings.policy,
        scaler: settings
            .scaler
            .unwrap_or_else(|| settings.policy.scaling.initial_state()),
        checkpointer: settings.checkpoint.as_ref().map(|c| c.checkpointer.clone()),
    };
    CoordinatorHandle::spawn(settings, local.len(), helpers)
}

/// This process's mailboxes (handed to the transport of a distributed run) and every
/// member's, by (replica, rank); the local inboxes; where the members run.
fn mailboxes<P: Send + 'static>(
    settings: &EngineSettings,
    schedule: &Schedule,
    local: &[(usize, usize)],
    remote: Option<Remote<P>>,
) -> (Mailboxes<P>, Inboxes<P>, Arc<Places>) {
    // A rank's mailbox holds every transfer one round (a step, or an evaluation) can
    // address to it, so no send ever waits on a full mailbox while its receiver waits on
    // the sender.
    let eval_k = settings.evaluation.map_or(0, |e| e.micro_batches);
    let capacity = |rank: usize| {
        let train = schedule.ranks()[rank]
            .iter()
            .filter(|a| a.kind().is_transfer())
            .count();
        let eval = eval_actions(schedule.placement(), rank, eval_k).len();
        train.max(eval) + 1
    };
    let (mut peers, mut inboxes) = (HashMap::new(), HashMap::new());
    for &key in local {
        let (tx, rx) = flume::bounded(capacity(key.1));
        peers.insert(key, tx);
        inboxes.insert(key, rx);
    }
    let places = match remote {
        Some(r) => {
            (r.deliver)(peers.clone());
            peers.extend(r.peers);
            r.places
        }
        None => HashMap::new(),
    };
    (
        peers,
        inboxes,
        Arc::new(Places::new(
            (settings.replicas, settings.shards.max(1)),
            places,
        )),
    )
}

/// The receiving ends of this process's mailboxes, by (replica, rank).
type Inboxes<P> = HashMap<(usize, usize), flume::Receiver<Transfer<P>>>;

/// After a failed run: stops the stage actors, lets the coordinator complete the
/// checkpoints already snapshotted, stops the helpers; returns `error`.
async fn tear_down<C: StageCompute>(
    actors: Running<C>,
    coordinator: &CoordinatorHandle,
    mut helpers: JoinSet<Result<(), ActorError>>,
    error: ActorError,
) -> ActorError {
    // Every stage actor ends (and drops its computes) before the run reports its end.
    actors.stop().await;
    // Checkpoints of steps before the failure, already snapshotted, are still completed:
    // the last complete checkpoint is the newest good one.
    let wait = tokio::time::timeout(SAVE_GRACE, coordinator.finish()).await;
    if !matches!(wait, Ok(Ok(_))) {
        tracing::warn!("checkpoints in progress when the run failed were not completed");
    }
    helpers.abort_all();
    error
}

/// The scheduler's evaluation (each member's micro-batches of the evaluation set), where
/// the settings ask for one.
fn evaluation<D: DataSource>(
    settings: &EngineSettings,
    data: &Arc<D>,
    placement: &[usize],
) -> Option<crate::scheduler::Evaluation<D::Payload>> {
    let e = settings.evaluation?;
    let (source, placement) = (data.clone(), placement.to_vec());
    let data: crate::scheduler::EvalData<D::Payload> = Box::new(move |replica, rank| {
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
    Some(crate::scheduler::Evaluation {
        every: e.every.max(1),
        data,
    })
}
