//! pipetrain's actor runtime: pipeline stages and data-parallel replicas as tokio tasks
//! exchanging micro-batch activations and gradients through bounded flume mailboxes,
//! under a schedule from `pipetrain-schedules`.
//!
//! # Layout
//! - `traits`: what the runtime is generic over: [`StageCompute`] (one stage of one
//!   replica), [`DataSource`] (micro-batches), [`Collective`] (gradient reduction).
//! - `stage`: the stage actor, one per (pipeline rank, replica); runs its rank's actions.
//! - `buckets`: the stage actor's all-reduce, with gradient buckets reduced while the
//!   step's last backward still runs.
//! - `messages`: transfers between stage actors, plans and answers, actor status.
//! - `places`: where other processes' members run, as the watchdog's report names them.
//! - `scheduler`: the scheduler actor; hands out steps and runs the watchdog, whose
//!   report names who waits on whom.
//! - `coordinator`: learning rate per step, the step's loss, the update decision
//!   (clipping, loss scaling, overflow), checkpoints completed in step order, per-step
//!   results.
//! - `decide`: the coordinator's decisions as pure functions ([`GradPolicy::decide`],
//!   the loss scaler, when to evaluate and save).
//! - `checkpoint`: what saving needs from the world ([`Checkpointer`], [`SaveJob`]).
//! - `data`: the data actors, one per (replica, stage that reads data), prefetching.
//! - `collective`: in-process AllReduce ([`LocalCollective`]), one group per stage.
//! - `engine`: [`run`] starts all of them for a run and stops them in order;
//!   [`run_distributed`] runs one process's share of a job spread over several (SPMD).
//! - `members`: starting the stage actors a process runs, and the run's body.
//! - `sim`: simulated stages sleeping modelled costs, for schedule tests and replays on
//!   a virtual clock (`tokio::time::pause`); [`replay`] re-drives a recorded run.
//! - `error`: [`ActorError`], the crate's one error type.
#![deny(missing_docs)]

mod buckets;
pub mod checkpoint;
mod collective;
mod coordinator;
mod data;
pub mod decide;
mod engine;
mod error;
mod grad_stats;
mod members;
mod messages;
mod places;
mod requests;
mod scheduler;
pub mod sim;
mod stage;
mod traits;

pub use checkpoint::{
    CheckpointSettings, Checkpointer, CommitState, SaveJob, SavedCheckpoint, ShardFile,
};
pub use collective::LocalCollective;
pub use coordinator::StepResult;
pub use data::{panic_text, PREFETCH};
pub use decide::{DynamicScaling, GradPolicy, GradStats, LossScaling, ScalerState, StepDecision};
pub use engine::{
    lowered, run, run_distributed, ActorThreads, DistributedOutput, Distribution, EngineSettings,
    EvalSettings, Mailboxes, RunOutput, RunTrace,
};
pub use error::{ActorError, BoxError};
pub use grad_stats::SumSq;
pub use messages::{Flow, Transfer};
pub use pipetrain_schedules as schedules;
pub use requests::RunControl;
pub use sim::{replay, ReplayDivergence};
pub use traits::{
    BackwardPart, Bus, Collective, DataSource, ForwardOut, Gathered, GradBucket, StageCompute,
};
