//! The coordinator actor: the learning rate per step, the step's loss, the update
//! decision (loss scaling, overflow, clipping) from every stage's gradient statistics,
//! and checkpoints (shards written in the background, completed in step order).
//!
//! Its decisions are pure functions (`decide`); the actor gathers what they need,
//! keeps the loss scaler's state, and carries them out.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::checkpoint::{Checkpointer, CommitState, SaveJob, SavedCheckpoint, ShardFile};
use crate::decide::{GradPolicy, GradStats, LossScaling, ScalerState, StepDecision};
use crate::error::ActorError;

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
}

/// How the coordinator decides.
pub(crate) struct CoordinatorSettings {
    pub lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    /// Losses each step must report (replicas x micro-batches).
    pub expected_losses: usize,
    pub replicas: usize,
    pub stages: usize,
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
        reply: oneshot::Sender<Result<f64, ActorError>>,
    },
    End {
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        stats: Vec<(usize, usize, GradStats)>,
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

    /// The evaluation after `step`: the mean of its micro-batch losses.
    pub(crate) async fn evaluated(
        &self,
        step: u64,
        losses: Vec<(usize, usize, f64)>,
    ) -> Result<f64, ActorError> {
        self.ask(|reply| Msg::Eval {
            step,
            losses,
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
    ) -> Result<StepResult, ActorError> {
        self.ask(|reply| Msg::End {
            step,
            losses,
            stats,
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

/// A checkpoint waiting for (or in) its turn.
struct PendingSave {
    state: CommitState,
    dir: PathBuf,
    jobs: Vec<SaveJob>,
    started: oneshot::Sender<()>,
    notify: Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
}

/// A checkpoint being written, and who is told when it completes.
type Writing = (
    Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
    Result<SavedCheckpoint, ActorError>,
);

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
                reply,
            } => {
                let result = match mean_loss(losses) {
                    (0, _) => Err(ActorError::Settings {
                        reason: format!("the evaluation after step {step} reported no loss"),
                    }),
                    (_, mean) => Ok(mean),
                };
                let _ = reply.send(result);
            }
            Msg::End {
                step,
                losses,
                stats,
                reply,
            } => {
                let result = self.end(step, losses, stats);
                let _ = reply.send(result);
            }
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

    /// Keeps a rank's statistics until every stage of every replica has sent its own,
    /// then decides and answers them all.
    fn gather(&mut self, step: u64, replica: usize, stats: Vec<(usize, GradStats)>, reply: Waiter) {
        let entry = self.waiting.entry(step).or_default();
        entry.push((replica, stats, reply));
        let have: usize = entry.iter().map(|(_, s, _)| s.len()).sum();
        if have < self.s.replicas * self.s.stages {
            return;
        }
        let ranks = self.waiting.remove(&step).unwrap_or_default();
        // Every replica holds the same reduced gradients: count each stage once, from
        // replica 0, in stage order; any replica's overflow counts.
        let mut per_stage: BTreeMap<usize, GradStats> = BTreeMap::new();
        let mut any_bad = false;
        for (replica, list, _) in &ranks {
            for &(stage, s) in list {
                any_bad |= !s.finite();
                if *replica == 0 {
                    per_stage.insert(stage, s);
                }
            }
        }
        let mut counted: Vec<GradStats> = per_stage.into_values().collect();
        if any_bad {
            counted.push(GradStats { sum_sq: f64::NAN });
        }
        let used = self.scaler.scale;
        let (decision, next) = self.s.policy.decide(self.scaler, &counted);
        self.scaler = next;
        self.scales.insert(step, (used, next));
        self.decisions.insert(step, decision);
        for (_, _, reply) in ranks {
            let _ = reply.send(Ok(decision));
        }
    }

    fn end(
        &mut self,
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        stats: Vec<(usize, usize, GradStats)>,
    ) -> Result<StepResult, ActorError> {
        if let Some(e) = self.save_error.take() {
            return Err(e);
        }
        let (count, loss) = mean_loss(losses);
        if count != self.s.expected_losses {
            return Err(ActorError::Settings {
                reason: format!(
                    "step {step}: {count} micro-batch losses reported, {} expected",
                    self.s.expected_losses
                ),
            });
        }
        // Statistics in stage order, replica 0's for the norm; the first stage (lowest
        // index) with a non-finite gradient in any replica is the one reported.
        let mut ordered = stats;
        ordered.sort_by_key(|&(r, s, _)| (s, r));
        let bad_stage = ordered
            .iter()
            .find(|(_, _, s)| !s.finite())
            .map(|&(_, s, _)| s);
        let (used, _) = *self
            .scales
            .entry(step)
            .or_insert((self.scaler.scale, self.scaler));
        // Older steps' scales are no longer needed: a step's checkpoint request comes
        // after its end and before the next step's.
        self.scales = self.scales.split_off(&step);
        let decision = self.decisions.remove(&step);
        let grad_norm = match decision {
            Some(d) => d.grad_norm,
            None => {
                let sum: f64 = ordered
                    .iter()
                    .filter(|(r, _, _)| *r == 0)
                    .map(|(_, _, s)| s.sum_sq)
                    .sum();
                sum.sqrt() / used
            }
        };
        let dynamic = matches!(self.s.policy.scaling, LossScaling::Dynamic(_));
        if !dynamic {
            if let Some(stage) = bad_stage {
                return Err(ActorError::NonFinite {
                    step: step + 1,
                    stage,
                    what: "gradient".into(),
                });
            }
            if !loss.is_finite() {
                return Err(ActorError::NonFinite {
                    step: step + 1,
                    stage: self.s.stages - 1,
                    what: format!("loss ({loss})"),
                });
            }
        }
        let skipped = decision.is_some_and(|d| !d.apply);
        if skipped {
            tracing::warn!(
                step = step + 1,
                stage = bad_stage,
                scale = used,
                "gradient overflow: update skipped, loss scale halved"
            );
        }
        Ok(StepResult {
            step,
            loss,
            lr: self.lrs.remove(&step).unwrap_or(f64::NAN),
            eval_loss: None,
            eval_accuracy: None,
            grad_norm,
            clip_coef: decision.and_then(|d| d.clip_coef),
            loss_scale: used,
            skipped,
            saved: std::mem::take(&mut self.saved),
        })
    }

    /// Starts the oldest waiting checkpoint when none is being written: checkpoints are
    /// completed one at a time, in step order, so the newest complete one is always the
    /// latest written.
    fn start_next_save(&mut self) {
        if !self.saving.is_empty() {
            return;
        }
        let Some(next) = self.queue.pop_front() else {
            return;
        };
        let Some(checkpointer) = self.s.checkpointer.clone() else {
            self.save_error.get_or_insert(ActorError::Settings {
                reason: "a checkpoint was asked for without a checkpointer".into(),
            });
            return;
        };
        let PendingSave {
            state,
            dir,
            jobs,
            started,
            notify,
        } = next;
        let _ = started.send(());
        self.saving.spawn(async move {
            let written = write_checkpoint(state, dir, jobs, checkpointer).await;
            (notify, written)
        });
    }

    fn answer_finish(&mut self) {
        if self.saving.is_empty() && self.queue.is_empty() {
            if let Some(reply) = self.finish.take() {
                let result = match self.save_error.take() {
                    Some(e) => Err(e),
                    None => Ok(std::mem::take(&mut self.saved)),
                };
                let _ = reply.send(result);
            }
        }
    }
}

/// Runs every stage's save job on a blocking thread (in parallel), then the commit.
async fn write_checkpoint(
    state: CommitState,
    dir: PathBuf,
    jobs: Vec<SaveJob>,
    checkpointer: Arc<dyn Checkpointer>,
) -> Result<SavedCheckpoint, ActorError> {
    let start = Instant::now();
    let failed = |source| ActorError::Checkpoint {
        steps_done: state.steps_done,
        source,
    };
    let writers: Vec<_> = jobs.into_iter().map(tokio::task::spawn_blocking).collect();
    let mut files: Vec<ShardFile> = Vec::new();
    for w in writers {
        let written = w.await.map_err(|e| failed(e.to_string().into()))?;
        files.extend(written.map_err(failed)?);
    }
    let bytes = files.iter().map(|f| f.bytes).sum();
    let path = tokio::task::spawn_blocking(move || checkpointer.commit(&dir, state, files))
        .await
        .map_err(|e| failed(e.to_string().into()))?
        .map_err(failed)?;
    Ok(SavedCheckpoint {
        steps_done: state.steps_done,
        path,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The number of distinct `(replica, mb)` losses and their mean, added in
/// `(replica, mb)` order so the result does not depend on arrival order.
fn mean_loss(losses: Vec<(usize, usize, f64)>) -> (usize, f64) {
    let ordered: BTreeMap<(usize, usize), f64> =
        losses.into_iter().map(|(r, mb, l)| ((r, mb), l)).collect();
    let n = ordered.len();
    (n, ordered.values().sum::<f64>() / n.max(1) as f64)
}
