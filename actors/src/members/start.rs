//! Starting one stage actor: its member entry for the scheduler, its mailboxes and data
//! actors, and its task or thread; and waiting for the stage actors to hand back their
//! computes.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use pipetrain_schedules::Schedule;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::coordinator::CoordinatorHandle;
use crate::data::spawn_data_actor;
use crate::engine::{eval_actions, EngineSettings, Mailboxes};
use crate::error::ActorError;
use crate::messages::Transfer;
use crate::places::Places;
use crate::scheduler::Member;
use crate::stage::{StageActor, Status};
use crate::traits::{Collective, DataSource, StageCompute};

/// Stage actors started one way or the other.
pub(super) enum Running<C> {
    Tasks(JoinSet<StageActorResult<C>>),
    Threads(StageThreads<C>),
}

/// Stage actors on threads of their own, and the signal that stops them. Threads cannot
/// be aborted as tasks are: each drives its actor in a `select!` with the stop signal,
/// so a stopped actor drops its future (and its computes) at its next await. Dropping
/// this stops and joins every thread still running: a run that fails, is cancelled or
/// whose future is dropped leaves none behind (an actor inside a compute ends when the
/// compute returns).
pub(super) struct StageThreads<C> {
    threads: Vec<std::thread::JoinHandle<Option<StageActorResult<C>>>>,
    stop: watch::Sender<bool>,
}

impl<C> StageThreads<C> {
    pub(super) fn new() -> StageThreads<C> {
        StageThreads {
            threads: Vec::new(),
            stop: watch::channel(false).0,
        }
    }

    /// Tells every actor to stop and waits for their threads to end.
    fn stop_and_join(&mut self) {
        self.stop.send_replace(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<C> Drop for StageThreads<C> {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// What a stage actor hands back: its index among the scheduler's members, its computes.
type StageActorResult<C> = Result<(usize, HashMap<usize, C>), ActorError>;

/// A member for the scheduler and its stage actor, not started yet.
type Started<C, K> = (Member<<C as StageCompute>::Payload>, StageActor<C, K>);

/// What every stage actor of this process starts with.
pub(super) struct Start<'a, D, K, P> {
    pub(super) settings: &'a EngineSettings,
    pub(super) schedule: &'a Schedule,
    pub(super) data: &'a Arc<D>,
    pub(super) steps: &'a std::ops::Range<u64>,
    pub(super) collective: &'a Arc<K>,
    pub(super) coordinator: &'a CoordinatorHandle,
    pub(super) peers: &'a Mailboxes<P>,
    pub(super) places: &'a Arc<Places>,
    /// Steps done, which the stage actors advance and the scheduler's watchdog reads.
    pub(super) progress: Arc<AtomicU64>,
    pub(super) origin: Instant,
}

impl<D, K> Start<'_, D, K, D::Payload>
where
    D: DataSource,
    K: Collective,
{
    /// Member (`replica`, `rank`) for the scheduler, and its stage actor (not started):
    /// its computes by stage, its inbox, a data actor (among `helpers`) per stage that
    /// reads data.
    pub(super) fn member<C: StageCompute<Payload = D::Payload>>(
        &self,
        replica: usize,
        rank: usize,
        computes: HashMap<usize, C>,
        inbox: flume::Receiver<Transfer<D::Payload>>,
        helpers: &mut JoinSet<Result<(), ActorError>>,
    ) -> Result<Started<C, K>, ActorError> {
        let (settings, schedule) = (self.settings, self.schedule);
        let peers: Vec<flume::Sender<Transfer<D::Payload>>> = (0..schedule.num_ranks())
            .map(|r| {
                self.peers
                    .get(&(replica, r))
                    .cloned()
                    .ok_or_else(|| ActorError::Settings {
                        reason: format!("no mailbox for replica {replica} rank {r}"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let m = schedule.micro_batches();
        let mut feeds = HashMap::new();
        for &stage in computes.keys().filter(|&&s| self.data.feeds(s)) {
            let data = self.data.clone();
            let steps = self.steps.clone();
            let rx = spawn_data_actor(data, replica, stage, m, steps, helpers);
            feeds.insert(stage, rx);
        }
        let (control_tx, control_rx) = flume::bounded(1);
        let (status_tx, status_rx) = watch::channel(Status::Idle);
        let mut stages: Vec<usize> = computes.keys().copied().collect();
        stages.sort_unstable();
        let member = Member {
            replica,
            rank,
            stages,
            control: control_tx,
            status: status_rx,
        };
        let placement = schedule.placement().to_vec();
        let eval_k = settings.evaluation.map_or(0, |e| e.micro_batches);
        let actor = StageActor {
            replica,
            rank,
            actions: schedule.ranks()[rank].clone(),
            eval_actions: eval_actions(&placement, rank, eval_k),
            placement,
            computes,
            inbox,
            peers,
            data: feeds,
            data_ahead: HashMap::new(),
            control: control_rx,
            collective: self.collective.clone(),
            status: status_tx,
            progress: self.progress.clone(),
            origin: self.origin,
            record: settings.record_trace,
            coordinator: self.coordinator.clone(),
            policy: settings.policy,
            spin: settings.spin,
            places: self.places.clone(),
            reducing: HashMap::new(),
            shards: settings.shards.max(1),
        };
        Ok((member, actor))
    }
}

impl<C: StageCompute> Running<C> {
    /// Starts `actor`, the scheduler's member `index`, as a task or on a thread of its own.
    pub(super) fn spawn<K: Collective>(
        &mut self,
        actor: StageActor<C, K>,
        index: usize,
    ) -> Result<(), ActorError> {
        let (replica, rank) = (actor.replica, actor.rank);
        let body = async move { actor.run().await.map(|c| (index, c)) };
        match self {
            Running::Tasks(set) => {
                set.spawn(body);
            }
            Running::Threads(threads) => {
                let handle = tokio::runtime::Handle::current();
                let mut stop = threads.stop.subscribe();
                let stopped = async move {
                    tokio::select! {
                        biased;
                        _ = stop.wait_for(|s| *s) => None,
                        r = body => Some(r),
                    }
                };
                // "pt-" names every thread of pipetrain's (Linux keeps 15 bytes of a name).
                let thread = std::thread::Builder::new()
                    .name(format!("pt-stage-r{replica}-k{rank}"))
                    .spawn(move || handle.block_on(stopped))
                    .map_err(|e| ActorError::Settings {
                        reason: format!("cannot start a stage actor thread: {e}"),
                    })?;
                threads.threads.push(thread);
            }
        }
        Ok(())
    }

    /// Waits for every stage actor to finish; their computes by member index.
    pub(super) async fn join(self) -> Result<Vec<(usize, HashMap<usize, C>)>, ActorError> {
        let mut returned = Vec::new();
        match self {
            Running::Tasks(mut set) => {
                while let Some(joined) = set.join_next().await {
                    returned.push(joined.map_err(|e| ActorError::ActorGone {
                        actor: format!("a stage actor ({e})"),
                    })??);
                }
            }
            Running::Threads(mut threads) => {
                for t in std::mem::take(&mut threads.threads) {
                    let joined = tokio::task::spawn_blocking(move || t.join())
                        .await
                        .map_err(|e| ActorError::ActorGone {
                            actor: format!("a stage actor thread ({e})"),
                        })?;
                    let ended = joined.map_err(|_| ActorError::ActorGone {
                        actor: "a stage actor thread (it panicked)".into(),
                    })?;
                    returned.push(ended.ok_or_else(|| ActorError::ActorGone {
                        actor: "a stage actor thread (stopped)".into(),
                    })??);
                }
            }
        }
        Ok(returned)
    }

    /// Stops every stage actor and waits until all of them have ended (their computes
    /// dropped), without holding up the runtime's workers.
    pub(super) async fn stop(self) {
        match self {
            Running::Tasks(mut set) => {
                set.abort_all();
                while set.join_next().await.is_some() {}
            }
            Running::Threads(mut threads) => {
                let _ = tokio::task::spawn_blocking(move || threads.stop_and_join()).await;
            }
        }
    }
}
