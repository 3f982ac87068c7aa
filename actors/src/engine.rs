//! Starting a run: the actors, their mailboxes, and the order they stop in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::{lower, validate, Action, LowerOptions, Schedule, Trace};
use serde::{Deserialize, Serialize};

use crate::checkpoint::CheckpointSettings;
use crate::collective::LocalCollective;
use crate::coordinator::StepResult;
use crate::decide::{GradPolicy, ScalerState};
use crate::error::ActorError;
use crate::members::{run_members, Remote};
use crate::messages::Transfer;
use crate::requests::RunControl;
use crate::traits::{Bus, Collective, DataSource, StageCompute};

/// How long a failed run waits for checkpoints already being written to complete.
pub(crate) const SAVE_GRACE: Duration = Duration::from_secs(60);

/// How to run.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The compute-only schedule (F, B, I, W per rank); the engine adds the transfers,
    /// the all-reduce and the optimizer step.
    pub schedule: Schedule,
    /// Replicas of the pipeline: data-parallel replicas times tensor shards.
    pub replicas: usize,
    /// Tensor shards per data-parallel replica: replica `r` is shard `r % shards` of
    /// data-parallel replica `r / shards`. A replica's shards read the same data, hold
    /// their parts of the split parameters (the same values of the others), report the
    /// loss once (shard 0), and reduce gradients only with the same shard of the other
    /// data-parallel replicas.
    pub shards: usize,
    /// Each data-parallel replica's gradient statistics cover only its part of each
    /// stage (its stages shard the optimizer state and reduce-scatter the gradients,
    /// [`crate::StageCompute::update_parts`]): the coordinator adds every replica's
    /// rather than counting data-parallel replica 0's.
    pub partial_stats: bool,
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
            shards: 1,
            partial_stats: false,
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
pub(crate) fn eval_actions(placement: &[usize], rank: usize, k: usize) -> Vec<Action> {
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
    let stages = settings.schedule.stages();
    let replicas = settings.replicas;
    if replicas == 0 || computes.len() != replicas || computes.iter().any(|c| c.len() != stages) {
        return Err(ActorError::Settings {
            reason: format!(
                "{replicas} replicas x {stages} stages of compute needed, got {:?}",
                computes.iter().map(Vec::len).collect::<Vec<_>>()
            ),
        });
    }
    let by_key: HashMap<(usize, usize), C> = computes
        .into_iter()
        .enumerate()
        .flat_map(|(r, list)| list.into_iter().enumerate().map(move |(s, c)| ((r, s), c)))
        .collect();
    let collective = Arc::new(LocalCollective::sharded(stages, replicas, settings.shards)?);
    let (steps, trace, mut out) = run_members(
        settings, by_key, data, lr_at, steps, on_step, collective, None,
    )
    .await?;
    out.sort_by_key(|(k, _)| *k);
    let mut computes: Vec<Vec<C>> = (0..replicas).map(|_| Vec::with_capacity(stages)).collect();
    for ((replica, _), c) in out {
        computes[replica].push(c);
    }
    if computes.iter().any(|c| c.len() != stages) {
        return Err(ActorError::ActorGone {
            actor: "a stage compute".into(),
        });
    }
    Ok(RunOutput {
        steps,
        trace,
        computes,
    })
}

/// Stage actors' mailboxes by (replica, rank).
pub type Mailboxes<P> = HashMap<(usize, usize), flume::Sender<Transfer<P>>>;

/// This process's share of a run spread over several processes (see
/// [`run_distributed`]).
pub struct Distribution<P, K> {
    /// Mailboxes of the stage actors in other processes (a transport's senders), by
    /// (replica, rank).
    pub peers: Mailboxes<P>,
    /// Called once with this process's mailboxes, by (replica, rank), so the transport
    /// delivers what arrives for them.
    pub deliver: Box<dyn FnOnce(Mailboxes<P>) + Send>,
    /// Gradient reduction across the replicas, some of them in other processes.
    pub collective: Arc<K>,
    /// The control plane between the processes.
    pub bus: Arc<dyn Bus>,
    /// Where the other processes' (replica, rank) members run (e.g. `node c`), for the
    /// watchdog's report; members missing here are named by replica and rank only.
    pub places: HashMap<(usize, usize), String>,
}

/// What [`run_distributed`] returns: this process's part of the run.
pub struct DistributedOutput<C> {
    /// One result per step (the same in every process).
    pub steps: Vec<StepResult>,
    /// This process's actors' trace, when recorded.
    pub trace: Option<RunTrace>,
    /// This process's computes, by (replica, stage).
    pub computes: Vec<((usize, usize), C)>,
}

/// [`run`] for one process of a job spread over several (SPMD, as
/// `torch.distributed` runs): every process runs the same schedule for the
/// (replica, rank) members whose computes it holds (`computes` by (replica, stage));
/// transfers to other processes' members go through `dist.peers`, gradient reductions
/// through `dist.collective`, and the decisions that need the whole job (step losses,
/// overflow and clipping, evaluation, checkpoint commits) through `dist.bus`, so that
/// every process reaches the same ones.
///
/// # Errors
/// As [`run`]; the bus's errors when another process fails.
///
/// # Cancel safety
/// Dropping the future aborts every actor of this process.
pub async fn run_distributed<C, D, K>(
    settings: &EngineSettings,
    computes: HashMap<(usize, usize), C>,
    data: Arc<D>,
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    steps: std::ops::Range<u64>,
    on_step: impl FnMut(&StepResult) + Send,
    dist: Distribution<C::Payload, K>,
) -> Result<DistributedOutput<C>, ActorError>
where
    C: StageCompute,
    D: DataSource<Payload = C::Payload>,
    K: Collective,
{
    let remote = Remote {
        peers: dist.peers,
        deliver: dist.deliver,
        bus: dist.bus,
        places: dist.places,
    };
    let (steps, trace, computes) = run_members(
        settings,
        computes,
        data,
        lr_at,
        steps,
        on_step,
        dist.collective,
        Some(remote),
    )
    .await?;
    Ok(DistributedOutput {
        steps,
        trace,
        computes,
    })
}
