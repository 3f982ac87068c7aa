//! The coordinator actor: the learning rate per step, the step's loss, the update
//! decision (loss scaling, overflow, clipping) from every stage's gradient statistics,
//! and checkpoints (shards written in the background, completed in step order).
//!
//! Its decisions are pure functions (`decide`); the actor gathers what they need,
//! keeps the loss scaler's state, and carries them out.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::checkpoint::{Checkpointer, CommitState, SaveJob, SavedCheckpoint};
use crate::decide::{GradPolicy, GradStats, ScalerState, StepDecision};
use crate::error::ActorError;
use crate::traits::Bus;

mod saving;
mod step;
mod wire;

use saving::{PendingSave, Writing};
use step::{evaluation, merge_end, merge_eval, Gathered};

/// Requests waiting for the coordinator: the scheduler's (one at a time, plus the
/// look-ahead step's) and one decision request per stage actor.
fn mailbox(stage_actors: usize) -> usize {
    2 + stage_actors
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// Step index.
    pub step: u64,
    /// Mean loss over every micro-batch of every replica.
    pub loss: f64,
    /// The learning rate the step used.
    pub lr: f64,
    /// Mean loss over the evaluation set after this step, when one was run.
    pub eval_loss: Option<f64>,
    /// Accuracy over the evaluation set (classification losses), when one was run.
    pub eval_accuracy: Option<f64>,
    /// Global L2 norm of the (unscaled) gradients, before clipping.
    pub grad_norm: f64,
    /// The clip coefficient applied, when clipping is on.
    pub clip_coef: Option<f64>,
    /// The loss scale the step used.
    pub loss_scale: f64,
    /// The update was skipped: a gradient overflowed under dynamic loss scaling.
    pub skipped: bool,
    /// Checkpoints completed since the previous step's result.
    pub saved: Vec<SavedCheckpoint>,
    /// A process of the run was asked to stop by this step's end (a signal): every
    /// process stops after the same rounds.
    pub stop: bool,
    /// When the step ended: the scheduler sets it to when this process's last actor
    /// finished the step (the coordinator's clock at the step's end until then). A result
    /// is handed on only after the next round (an evaluation may add to it), so step
    /// times are differences of this, not of when results arrive.
    pub ended: std::time::Instant,
}

/// How the coordinator decides.
pub(crate) struct CoordinatorSettings {
    pub lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    /// Losses each step must report (replicas x micro-batches).
    pub expected_losses: usize,
    pub replicas: usize,
    /// Tensor shards per data-parallel replica (see `EngineSettings::shards`).
    pub shards: usize,
    /// Every replica's statistics count (see `EngineSettings::partial_stats`).
    pub partial_stats: bool,
    pub stages: usize,
    /// Statistics each step's decision waits for in this process: the stages of its
    /// members.
    pub local_stats: usize,
    /// The other processes of a distributed run.
    pub bus: Option<Arc<dyn Bus>>,
    pub policy: GradPolicy,
    pub scaler: ScalerState,
    pub checkpointer: Option<Arc<dyn Checkpointer>>,
}

/// The reply a stage actor waits on for its step's decision.
type Waiter = oneshot::Sender<Result<StepDecision, ActorError>>;

/// A rank's statistics (`(stage, stats)` of one replica) and the reply it waits on.
type RankStats = (usize, Vec<(usize, GradStats)>, Waiter);

enum Msg {
    Begin {
        step: u64,
        reply: oneshot::Sender<f64>,
    },
    Decide {
        step: u64,
        replica: usize,
        stats: Vec<(usize, GradStats)>,
        reply: Waiter,
    },
    Eval {
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        /// `(correct, counted)` summed over this process's members.
        accuracy: Option<(f64, f64)>,
        reply: oneshot::Sender<Result<(f64, Option<f64>), ActorError>>,
    },
    End {
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        stats: Vec<(usize, usize, GradStats)>,
        /// This process was asked to stop.
        stop: bool,
        reply: oneshot::Sender<Result<StepResult, ActorError>>,
    },
    Save {
        steps_done: u64,
        dir: PathBuf,
        jobs: Vec<SaveJob>,
        /// Answered when the save starts being written (see `CoordinatorHandle::save`).
        started: oneshot::Sender<()>,
        /// Told when the checkpoint is complete.
        notify: Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
    },
    Finish {
        reply: oneshot::Sender<Result<Vec<SavedCheckpoint>, ActorError>>,
    },
}

/// The coordinator's handle.
#[derive(Clone)]
pub struct CoordinatorHandle {
    tx: flume::Sender<Msg>,
}

fn gone() -> ActorError {
    ActorError::ActorGone {
        actor: "the coordinator".into(),
    }
}

impl CoordinatorHandle {
    /// Starts the coordinator in `tasks`.
    pub(crate) fn spawn(
        settings: CoordinatorSettings,
        stage_actors: usize,
        tasks: &mut JoinSet<Result<(), ActorError>>,
    ) -> CoordinatorHandle {
        let (tx, rx) = flume::bounded(mailbox(stage_actors));
        tasks.spawn(Coordinator::new(settings).run(rx));
        CoordinatorHandle { tx }
    }

    /// Sends the request `make` builds around a reply channel and waits for the reply.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Result<T, ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send_async(make(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// The learning rate of `step`.
    pub(crate) async fn begin(&self, step: u64) -> Result<f64, ActorError> {
        self.ask(|reply| Msg::Begin { step, reply }).await
    }

    /// The update decision of `step`, once every stage of every replica has sent its
    /// statistics (`(stage, stats)` for the stages of one rank of `replica`).
    pub(crate) async fn decide(
        &self,
        step: u64,
        replica: usize,
        stats: Vec<(usize, GradStats)>,
    ) -> Result<StepDecision, ActorError> {
        self.ask(|reply| Msg::Decide {
            step,
            replica,
            stats,
            reply,
        })
        .await?
    }

    /// The evaluation after `step`: the mean of its micro-batch losses, and the accuracy
    /// from `(correct, counted)` predictions when the loss classifies.
    pub(crate) async fn evaluated(
        &self,
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        accuracy: Option<(f64, f64)>,
    ) -> Result<(f64, Option<f64>), ActorError> {
        self.ask(|reply| Msg::Eval {
            step,
            losses,
            accuracy,
            reply,
        })
        .await?
    }

    /// Closes `step` with its micro-batch losses `(replica, mb, loss)` and the gradient
    /// statistics `(replica, stage, stats)`; returns its result, or the error that stops
    /// the run (a non-finite loss or gradient without dynamic scaling, a failed save).
    pub(crate) async fn end(
        &self,
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        stats: Vec<(usize, usize, GradStats)>,
        stop: bool,
    ) -> Result<StepResult, ActorError> {
        self.ask(|reply| Msg::End {
            step,
            losses,
            stats,
            stop,
            reply,
        })
        .await?
    }

    /// Writes the stages' snapshots of the checkpoint after `steps_done` steps in the
    /// background, then completes it (after any earlier one). Returns once it starts
    /// being written: a run that saves faster than the disk takes waits here, so at most
    /// one snapshot waits while another is written (as `torch.distributed.checkpoint`'s
    /// async save waits for the previous one).
    pub(crate) async fn save(
        &self,
        steps_done: u64,
        dir: PathBuf,
        jobs: Vec<SaveJob>,
        notify: Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
    ) -> Result<(), ActorError> {
        self.ask(|started| Msg::Save {
            steps_done,
            dir,
            jobs,
            started,
            notify,
        })
        .await
    }

    /// Waits for every checkpoint in progress; the ones completed and not yet reported.
    pub(crate) async fn finish(&self) -> Result<Vec<SavedCheckpoint>, ActorError> {
        self.ask(|reply| Msg::Finish { reply }).await?
    }
}

struct Coordinator {
    s: CoordinatorSettings,
    /// The scale of the next step, and the counter of finite steps.
    scaler: ScalerState,
    lrs: BTreeMap<u64, f64>,
    /// Per step: the scale it used, and the scaler's state after it.
    scales: BTreeMap<u64, (f64, ScalerState)>,
    waiting: BTreeMap<u64, Vec<RankStats>>,
    decisions: BTreeMap<u64, StepDecision>,
    queue: VecDeque<PendingSave>,
    saving: JoinSet<Writing>,
    saved: Vec<SavedCheckpoint>,
    save_error: Option<ActorError>,
    finish: Option<oneshot::Sender<Result<Vec<SavedCheckpoint>, ActorError>>>,
    /// Gathers over the bus in progress.
    gathers: JoinSet<Gathered>,
}

impl Coordinator {
    fn new(s: CoordinatorSettings) -> Coordinator {
        Coordinator {
            scaler: s.scaler,
            s,
            lrs: BTreeMap::new(),
            scales: BTreeMap::new(),
            waiting: BTreeMap::new(),
            decisions: BTreeMap::new(),
            queue: VecDeque::new(),
            saving: JoinSet::new(),
            saved: Vec::new(),
            save_error: None,
            finish: None,
            gathers: JoinSet::new(),
        }
    }

    #[tracing::instrument(skip_all)]
    async fn run(mut self, rx: flume::Receiver<Msg>) -> Result<(), ActorError> {
        loop {
            tokio::select! {
                msg = rx.recv_async() => match msg {
                    Ok(m) => self.handle(m),
                    Err(_) => break,
                },
                Some(done) = self.gathers.join_next(), if !self.gathers.is_empty() => {
                    match done {
                        Ok(g) => self.gathered(g),
                        Err(e) => {
                            self.save_error.get_or_insert(ActorError::ActorGone {
                                actor: format!("a control-bus gather ({e})"),
                            });
                        }
                    }
                }
                Some(done) = self.saving.join_next(), if !self.saving.is_empty() => {
                    match done {
                        Ok((notify, Ok(saved))) => {
                            tracing::info!(path = %saved.path.display(), "checkpoint saved");
                            if let Some(n) = notify {
                                let _ = n.send(Ok(saved.clone()));
                            }
                            self.saved.push(saved);
                        }
                        Ok((notify, Err(e))) => {
                            if let Some(n) = notify {
                                // The run fails with the error; the waiter gets its words.
                                let copy = match &e {
                                    ActorError::Checkpoint { steps_done, source } => ActorError::Checkpoint {
                                        steps_done: *steps_done,
                                        source: source.to_string().into(),
                                    },
                                    other => ActorError::ActorGone { actor: other.to_string() },
                                };
                                let _ = n.send(Err(copy));
                            }
                            self.save_error.get_or_insert(e);
                        }
                        Err(e) => {
                            self.save_error.get_or_insert(ActorError::ActorGone {
                                actor: format!("a checkpoint writer ({e})"),
                            });
                        }
                    }
                    self.start_next_save();
                }
            }
            self.answer_finish();
        }
        Ok(())
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Begin { step, reply } => {
                let lr = (self.s.lr_at)(step);
                self.lrs.insert(step, lr);
                let _ = reply.send(lr);
            }
            Msg::Decide {
                step,
                replica,
                stats,
                reply,
            } => self.gather(step, replica, stats, reply),
            Msg::Eval {
                step,
                losses,
                accuracy,
                reply,
            } => match self.s.bus.clone() {
                None => {
                    let _ = reply.send(evaluation(step, losses, accuracy));
                }
                Some(bus) => {
                    let mut bytes = Vec::new();
                    wire::put(&mut bytes, &losses);
                    let acc = accuracy.map_or(Vec::new(), |(c, n)| vec![(0, 0, c), (0, 1, n)]);
                    wire::put(&mut bytes, &acc);
                    self.gathers.spawn(async move {
                        let all = bus
                            .all_gather(format!("eval/{step}"), bytes)
                            .await
                            .and_then(|parts| merge_eval(&parts));
                        Gathered::Eval { step, all, reply }
                    });
                }
            },
            Msg::End {
                step,
                losses,
                stats,
                stop,
                reply,
            } => match self.s.bus.clone() {
                None => {
                    let result = self.end(step, (losses, stats, stop));
                    let _ = reply.send(result);
                }
                Some(bus) => {
                    let mut bytes = Vec::new();
                    wire::put(&mut bytes, &losses);
                    let s: wire::Triples =
                        stats.iter().map(|&(r, st, g)| (r, st, g.sum_sq)).collect();
                    wire::put(&mut bytes, &s);
                    let asked: wire::Triples = stop.then_some((0, 0, 1.0)).into_iter().collect();
                    wire::put(&mut bytes, &asked);
                    self.gathers.spawn(async move {
                        let all = bus
                            .all_gather(format!("end/{step}"), bytes)
                            .await
                            .and_then(|parts| merge_end(&parts));
                        Gathered::End { step, all, reply }
                    });
                }
            },
            Msg::Save {
                steps_done,
                dir,
                jobs,
                started,
                notify,
            } => {
                // The scaler as it was after the checkpoint's last step (later steps may
                // already have moved it).
                let scaler = self
                    .scales
                    .get(&steps_done.saturating_sub(1))
                    .map_or(self.scaler, |&(_, after)| after);
                let state = CommitState { steps_done, scaler };
                self.queue.push_back(PendingSave {
                    state,
                    dir,
                    jobs,
                    started,
                    notify,
                });
                self.start_next_save();
            }
            Msg::Finish { reply } => self.finish = Some(reply),
        }
    }
}
