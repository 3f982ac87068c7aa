//! Starting the stage actors this process runs, running the scheduler over them, and
//! stopping everything in order: the body of [`crate::run`] and
//! [`crate::run_distributed`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::coordinator::{CoordinatorHandle, CoordinatorSettings, StepResult};
use crate::data::spawn_data_actor;
use crate::engine::{
    eval_actions, lowered, ActorThreads, EngineSettings, Mailboxes, RunTrace, SAVE_GRACE,
};
use crate::error::ActorError;
use crate::messages::Transfer;
use crate::places::Places;
use crate::scheduler::{Member, SchedulerActor};
use crate::stage::{StageActor, Status};
use crate::traits::{Bus, Collective, DataSource, StageCompute};

/// Stage actors started one way or the other.
enum Running<C> {
    Tasks(JoinSet<StageActorResult<C>>),
    Threads(Vec<std::thread::JoinHandle<StageActorResult<C>>>),
}

/// What a stage actor hands back: its index among the scheduler's members, its computes.
type StageActorResult<C> = Result<(usize, HashMap<usize, C>), ActorError>;

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
/// for the rest of a distributed job.
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
    let (stages, ranks, m) = (
        schedule.stages(),
        schedule.num_ranks(),
        schedule.micro_batches(),
    );
    let replicas = settings.replicas;
    let placement = schedule.placement().to_vec();
    // The (replica, rank) members this process runs: those it has every stage of.
    let mut local: Vec<(usize, usize)> = Vec::new();
    for replica in 0..replicas {
        for rank in 0..ranks {
            let owned = (0..stages)
                .filter(|&s| placement[s] == rank)
                .map(|s| computes.contains_key(&(replica, s)))
                .collect::<Vec<_>>();
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
    let expected_local = local.len() == replicas * ranks;
    let distributed = remote.is_some();
    if local.is_empty() || (remote.is_none() && !expected_local) {
        return Err(ActorError::Settings {
            reason: format!(
                "{replicas} replicas x {stages} stages of compute needed, got {} members",
                local.len()
            ),
        });
    }
    let local_stage_count: usize = local
        .iter()
        .map(|&(_, rank)| placement.iter().filter(|&&p| p == rank).count())
        .sum();
    let mut helpers: JoinSet<Result<(), ActorError>> = JoinSet::new();
    let mut actors = match settings.threads {
        ActorThreads::Tasks => Running::Tasks(JoinSet::new()),
        ActorThreads::Dedicated => Running::Threads(Vec::new()),
    };
    let coordinator = CoordinatorHandle::spawn(
        CoordinatorSettings {
            lr_at,
            expected_losses: replicas / settings.shards.max(1) * m,
            replicas,
            shards: settings.shards.max(1),
            stages,
            local_stats: local_stage_count,
            bus: remote.as_ref().map(|r| r.bus.clone()),
            policy: settings.policy,
            scaler: settings
                .scaler
                .unwrap_or_else(|| settings.policy.scaling.initial_state()),
            checkpointer: settings.checkpoint.as_ref().map(|c| c.checkpointer.clone()),
        },
        local.len(),
        &mut helpers,
    );
    let progress = Arc::new(AtomicU64::new(0));
    let origin = Instant::now();
    let placement = schedule.placement().to_vec();
    let eval_k = settings.evaluation.map_or(0, |e| e.micro_batches);
    let mut members = Vec::new();
    // A rank's mailbox holds every transfer one round (a step, or an evaluation) can
    // address to it, so no send ever waits on a full mailbox while its receiver waits on
    // the sender.
    let capacity = |rank: usize| {
        let train = schedule.ranks()[rank]
            .iter()
            .filter(|a| a.kind().is_transfer())
            .count();
        train.max(eval_actions(&placement, rank, eval_k).len()) + 1
    };
    let mut inboxes = HashMap::new();
    let mut peers: HashMap<(usize, usize), flume::Sender<Transfer<C::Payload>>> = HashMap::new();
    for &key in &local {
        let (tx, rx) = flume::bounded(capacity(key.1));
        peers.insert(key, tx);
        inboxes.insert(key, rx);
    }
    let (deliver, bus_peers, places) = match remote {
        Some(r) => (Some(r.deliver), r.peers, r.places),
        None => (None, HashMap::new(), HashMap::new()),
    };
    let places = Arc::new(Places::new(replicas, places));
    if let Some(deliver) = deliver {
        deliver(peers.clone());
    }
    peers.extend(bus_peers);
    for &(replica, rank) in &local {
        let txs: Vec<flume::Sender<Transfer<C::Payload>>> = (0..ranks)
            .map(|r| {
                peers
                    .get(&(replica, r))
                    .cloned()
                    .ok_or_else(|| ActorError::Settings {
                        reason: format!("no mailbox for replica {replica} rank {r}"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let inbox = inboxes
            .remove(&(replica, rank))
            .ok_or_else(|| ActorError::Settings {
                reason: format!("replica {replica} rank {rank} twice"),
            })?;
        let local: HashMap<usize, C> = (0..stages)
            .filter(|&s| placement[s] == rank)
            .filter_map(|s| computes.remove(&(replica, s)).map(|c| (s, c)))
            .collect();
        {
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
                places: places.clone(),
                reducing: HashMap::new(),
                shards: settings.shards.max(1),
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
    // Members' indices follow `local`: the scheduler's order.
    let mut out = Vec::new();
    for (index, map) in returned.into_iter().flatten() {
        let (replica, _) = local[index];
        out.extend(map.into_iter().map(|(stage, c)| ((replica, stage), c)));
    }
    let trace = settings.record_trace.then_some(RunTrace {
        schedule,
        replicas,
        steps: traces,
    });
    Ok((results, trace, out))
}
