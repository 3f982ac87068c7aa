//! The crate's one error type.

use pipetrain_schedules::{Action, ScheduleError};

use crate::places::replica_name;

/// A boxed error from the compute or data source a caller plugs in.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What can stop a run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ActorError {
    /// The schedule is not one the runtime can execute (boxed: schedule errors carry
    /// the whole grid, and every `Result` here would otherwise be that large).
    #[error(transparent)]
    Schedule(Box<ScheduleError>),
    /// The run's settings are inconsistent.
    #[error("engine settings: {reason}")]
    Settings {
        /// What is wrong.
        reason: String,
    },
    /// A stage's compute failed.
    #[error("{} stage {stage}: {action} failed: {source}", replica_name(*.replica, *.shards))]
    Compute {
        /// The engine's replica: tensor shard `replica % shards` of data-parallel replica
        /// `replica / shards`.
        replica: usize,
        /// Tensor shards a data-parallel replica (1: none).
        shards: usize,
        /// Pipeline stage.
        stage: usize,
        /// The action that failed.
        action: Action,
        /// The compute's error.
        source: BoxError,
    },
    /// The data source failed.
    #[error("replica {replica}: data for step {step} micro-batch {micro_batch}: {source}")]
    Data {
        /// Data-parallel replica.
        replica: usize,
        /// Optimizer step.
        step: u64,
        /// Micro-batch.
        micro_batch: usize,
        /// The source's error.
        source: BoxError,
    },
    /// No actor made progress for the watchdog's time.
    #[error("no progress for {seconds:.1}s; who waits on whom:\n{report}")]
    Stalled {
        /// The watchdog's limit.
        seconds: f64,
        /// One line per actor: what it is doing or waiting for.
        report: String,
    },
    /// An actor ended (or panicked) while others still needed it.
    #[error("{actor} is gone")]
    ActorGone {
        /// Which actor.
        actor: String,
    },
    /// A loss or gradient was not finite, without dynamic loss scaling to skip the step.
    #[error(
        "optimizer step {step}: non-finite {what}, first in stage {stage}; the run stops here (checkpoints already complete are kept)"
    )]
    NonFinite {
        /// Optimizer step, counting from 1.
        step: u64,
        /// The lowest-numbered stage where it appeared.
        stage: usize,
        /// What was not finite.
        what: String,
    },
    /// A checkpoint could not be written or completed.
    #[error("checkpoint after {steps_done} steps: {source}")]
    Checkpoint {
        /// The steps it was to hold.
        steps_done: u64,
        /// What went wrong.
        source: BoxError,
    },
    /// Another process of a distributed run failed, or the transport to it broke.
    #[error("{reason}")]
    Peer {
        /// Which process, and what happened.
        reason: String,
    },
    /// A message arrived that the schedule did not call for.
    #[error("replica {replica} rank {rank}: {reason}")]
    Protocol {
        /// Data-parallel replica.
        replica: usize,
        /// Pipeline rank.
        rank: usize,
        /// What arrived and what was expected.
        reason: String,
    },
}

impl From<ScheduleError> for ActorError {
    fn from(e: ScheduleError) -> Self {
        ActorError::Schedule(Box::new(e))
    }
}
