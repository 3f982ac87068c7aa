//! The messages of the runtime: between stage actors (transfers), from the scheduler to
//! a stage actor (plans), and back (answers), and what an actor is doing (status).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;

use pipetrain_schedules::{Action, TraceEvent};

use crate::checkpoint::SaveJob;
use crate::decide::GradStats;
use crate::error::ActorError;

/// Which way a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flow {
    /// Activations, stage s -> s + 1.
    Act,
    /// Gradients, stage s -> s - 1.
    Grad,
}

/// A message between stage actors: what `stage` (the receiving stage) gets for `mb`.
/// A transport carrying it between processes sends the four fields.
#[derive(Debug)]
pub struct Transfer<P> {
    /// Activations or gradients.
    pub flow: Flow,
    /// The stage it is for.
    pub stage: usize,
    /// The micro-batch.
    pub mb: usize,
    /// The tensors.
    pub payload: P,
}

/// What a stage actor did in a step.
#[derive(Default)]
pub(crate) struct StepOutcome {
    /// Trace events, when recording.
    pub events: Vec<TraceEvent>,
    /// `(micro-batch, loss)` for the micro-batches whose loss this actor computed. They
    /// travel with the answer rather than as messages of their own: one cross-thread
    /// wake-up per step instead of one per micro-batch.
    pub losses: Vec<(usize, f64)>,
    /// `(correct, counted)` predictions of the evaluation micro-batches this actor
    /// scored, summed.
    pub accuracy: Option<(f64, f64)>,
    /// `(stage, statistics)` of the reduced gradients of the actor's stages.
    pub grads: Vec<(usize, GradStats)>,
    /// Snapshots for a checkpoint round, to be written in the background.
    pub saves: Vec<SaveJob>,
    /// When the actor finished a training step's last action: the step's end as this
    /// actor saw it (the scheduler may read the answer later, when it is busy).
    pub finished: Option<std::time::Instant>,
}

/// A stage actor's answer at the end of a round: its index among the scheduler's
/// members, the round, and what it did or its error.
pub(crate) type Answer = (usize, u64, Result<StepOutcome, ActorError>);

/// What a round of work is.
pub(crate) enum Work<P> {
    /// A training step: the rank's lowered action list.
    Train,
    /// Evaluation: forward only over the micro-batches given per stage that reads data.
    Eval(HashMap<usize, VecDeque<P>>),
    /// A checkpoint: replica 0's actors snapshot their stages for files in the folder.
    Save(PathBuf),
}

/// What the scheduler hands a stage actor each round.
pub(crate) struct StepPlan<P> {
    /// Position of the round in the run (answers are matched by it).
    pub round: u64,
    pub step: u64,
    pub lr: f64,
    pub index: usize,
    pub work: Work<P>,
    pub reply: flume::Sender<Answer>,
}

/// What an actor is doing, for the watchdog's report.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Status {
    Idle,
    Running(Action),
    Waiting { action: Action, from: String },
    Finished,
}
