//! The scheduler actor: hands every stage actor its step, waits for all of them, and
//! watches progress. When nothing moves for the watchdog's time it fails the run with a
//! report of who waits on whom.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::{Trace, TraceEvent};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::checkpoint::{CheckpointSettings, SaveJob};
use crate::coordinator::{CoordinatorHandle, StepResult};
use crate::decide::{checkpoint_due, evaluation_due, GradStats};
use crate::error::ActorError;
use crate::places::replica_name;
use crate::requests::{RunControl, SaveWaiter};
use crate::stage::{Answer, Status, StepOutcome, StepPlan, Work};

/// One stage actor as the scheduler sees it.
pub(crate) struct Member<P> {
    pub replica: usize,
    pub rank: usize,
    pub stages: Vec<usize>,
    pub control: flume::Sender<StepPlan<P>>,
    pub status: watch::Receiver<Status>,
}

/// The evaluation data of one member (replica, rank): per stage it holds that reads data,
/// the evaluation micro-batches in order.
pub(crate) type EvalData<P> =
    Box<dyn Fn(usize, usize) -> Result<HashMap<usize, VecDeque<P>>, ActorError> + Send + Sync>;

/// When to evaluate, and on what.
pub(crate) struct Evaluation<P> {
    /// After every this many optimizer steps.
    pub every: u64,
    /// The data of a member.
    pub data: EvalData<P>,
}

/// One round of work handed to every member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    Train(u64),
    /// Evaluation after training step `.0`.
    Eval(u64),
    /// A checkpoint after training step `.0`.
    Save(u64),
}

/// What the members answered in one round, put together.
#[derive(Default)]
struct Gathered {
    /// `(replica, micro-batch, loss)`.
    losses: Vec<(usize, usize, f64)>,
    /// `(replica, stage, statistics)` of the gradients.
    grads: Vec<(usize, usize, GradStats)>,
    /// `(correct, counted)` predictions, summed.
    accuracy: Option<(f64, f64)>,
    saves: Vec<SaveJob>,
    /// Each member's trace events.
    events: Vec<Vec<TraceEvent>>,
    /// When this process's last actor finished the round.
    finished: Option<std::time::Instant>,
}

/// Drives the run.
pub(crate) struct SchedulerActor<P> {
    pub members: Vec<Member<P>>,
    pub coordinator: CoordinatorHandle,
    pub progress: Arc<AtomicU64>,
    pub watchdog: Duration,
    pub replicas: usize,
    /// Tensor shards a data-parallel replica (1: none), for naming members.
    pub shards: usize,
    pub ranks: usize,
    pub evaluation: Option<Evaluation<P>>,
    pub checkpoint: Option<CheckpointSettings>,
    /// The run's last optimizer step (a checkpoint follows it).
    pub last_step: u64,
    /// Requests from whoever embeds the run.
    pub control: Option<flume::Receiver<RunControl>>,
    /// Processes share the run: a stop waits for the end of a step, whose gather tells
    /// every process that one of them was asked, so that all stop after the same round.
    pub shared_stop: bool,
}

impl<P: Send + 'static> SchedulerActor<P> {
    /// Runs steps `first..first + count` (with evaluations between them when asked),
    /// calling `on_step` after each; returns the per-step traces ([step][replica]) when
    /// the stage actors record them.
    pub async fn run(
        mut self,
        steps: std::ops::Range<u64>,
        mut on_step: impl FnMut(&StepResult) + Send,
    ) -> Result<Vec<Vec<Trace>>, ActorError> {
        let mut rounds = self.rounds(steps);
        let mut traces = Vec::new();
        // Each member can have two rounds' answers in flight (see the look-ahead below).
        let (done_tx, done_rx) = flume::bounded(2 * self.members.len());
        let mut early: Vec<Answer> = Vec::new();
        let mut save_dirs = HashMap::new();
        if let Some(&first) = rounds.first() {
            let handed = self.hand_out(0, first, &done_tx).await;
            if let Some(dir) = handed.map_err(|e| root_cause(e, &done_rx, &mut early))? {
                save_dirs.insert(0, dir);
            }
        }
        let mut pending: Option<StepResult> = None;
        let mut waiters: HashMap<usize, SaveWaiter> = HashMap::new();
        // This process was asked to stop (shared runs); the run is stopping.
        let (mut stop_asked, mut stopping) = (false, false);
        let mut i = 0;
        while i < rounds.len() {
            let round = rounds[i];
            stop_asked |= self.take_requests(&mut rounds, i, &mut waiters);
            // Hand out the next round before this one ends: an actor that finishes goes on
            // at once instead of waiting for the round trip through the scheduler and the
            // coordinator. Rounds stay in order: each actor runs its plans one by one, and
            // a step's optimizer update is the last action of its list.
            if let Some(&next) = rounds.get(i + 1) {
                let handed = self.hand_out(i as u64 + 1, next, &done_tx).await;
                if let Some(dir) = handed.map_err(|e| root_cause(e, &done_rx, &mut early))? {
                    save_dirs.insert(i + 1, dir);
                }
            }
            let outcomes = self.wait_all(i as u64, &done_rx, &mut early).await?;
            let got = self.gather(outcomes);
            match round {
                Round::Train(step) => {
                    traces.push(self.traces(got.events));
                    if let Some(r) = pending.take() {
                        on_step(&r);
                    }
                    let mut result = self
                        .coordinator
                        .end(step, got.losses, got.grads, stop_asked)
                        .await?;
                    // The step ended when this process's last actor finished it, not
                    // when the scheduler got round to it (answers may wait while it
                    // works on the round before).
                    result.ended = got.finished.unwrap_or(result.ended);
                    if result.stop && !stopping {
                        // Every process learns it at this same step: all stop after the
                        // round already handed out.
                        self.stop_after(&mut rounds, i + 2, &mut waiters);
                        stopping = true;
                    }
                    pending = Some(result);
                }
                Round::Eval(step) => {
                    let (loss, acc) = self
                        .coordinator
                        .evaluated(step, got.losses, got.accuracy)
                        .await?;
                    if let Some(r) = pending.as_mut() {
                        r.eval_loss = Some(loss);
                        r.eval_accuracy = acc;
                    }
                }
                Round::Save(step) => {
                    let dir = save_dirs.remove(&i).ok_or_else(|| ActorError::Settings {
                        reason: format!("no folder for the checkpoint after step {step}"),
                    })?;
                    let notify = waiters.remove(&i).flatten();
                    self.coordinator
                        .save(step + 1, dir, got.saves, notify)
                        .await?;
                }
            }
            // The step is reported now, unless its evaluation comes next (its result
            // joins the report) or no step follows (the run's last checkpoints join it).
            let eval_next = matches!(rounds.get(i + 1), Some(Round::Eval(_)));
            let later = rounds[i + 1..].iter().any(|r| matches!(r, Round::Train(_)));
            if !eval_next && later {
                if let Some(r) = pending.take() {
                    on_step(&r);
                }
            }
            i += 1;
        }
        // Checkpoints still being written complete before the run is over.
        let saved = self.coordinator.finish().await?;
        if let Some(mut r) = pending.take() {
            r.saved.extend(saved);
            on_step(&r);
        }
        Ok(traces)
    }

    /// The rounds of steps `steps`: each step's training, then its evaluation and its
    /// checkpoint where due.
    fn rounds(&self, steps: std::ops::Range<u64>) -> Vec<Round> {
        let mut rounds = Vec::new();
        let eval_every = self.evaluation.as_ref().map(|e| e.every);
        let save_every = self.checkpoint.as_ref().map(|c| c.every);
        for step in steps {
            rounds.push(Round::Train(step));
            if evaluation_due(step, eval_every) {
                rounds.push(Round::Eval(step));
            }
            if checkpoint_due(step, save_every, self.last_step) {
                rounds.push(Round::Save(step));
            }
        }
        rounds
    }

    /// The members' answers to one round, put together.
    fn gather(&self, outcomes: Vec<StepOutcome>) -> Gathered {
        let mut got = Gathered {
            finished: outcomes.iter().filter_map(|o| o.finished).max(),
            ..Gathered::default()
        };
        for (m, o) in self.members.iter().zip(outcomes) {
            if let Some((c, n)) = o.accuracy {
                let (sc, sn) = got.accuracy.unwrap_or((0.0, 0.0));
                got.accuracy = Some((sc + c, sn + n));
            }
            got.losses
                .extend(o.losses.into_iter().map(|(mb, l)| (m.replica, mb, l)));
            got.grads
                .extend(o.grads.into_iter().map(|(s, g)| (m.replica, s, g)));
            got.saves.extend(o.saves);
            got.events.push(o.events);
        }
        got
    }

    /// Each replica's trace of a step from its members' events (in member order).
    fn traces(&self, events: Vec<Vec<TraceEvent>>) -> Vec<Trace> {
        let ranks = vec![Vec::new(); self.ranks];
        let mut per_replica = vec![Trace { ranks }; self.replicas];
        for (m, ev) in self.members.iter().zip(events) {
            per_replica[m.replica].ranks[m.rank] = ev;
        }
        per_replica
    }

    /// Sends every member its plan for `round` (the `index`-th of the run); for a
    /// checkpoint, the folder made for its files.
    async fn hand_out(
        &self,
        index: u64,
        round: Round,
        reply: &flume::Sender<Answer>,
    ) -> Result<Option<std::path::PathBuf>, ActorError> {
        let mut dir = None;
        let (step, lr) = match round {
            Round::Train(step) => (step, self.coordinator.begin(step).await?),
            Round::Eval(step) => (step, 0.0),
            Round::Save(step) => {
                let c = self
                    .checkpoint
                    .as_ref()
                    .ok_or_else(|| ActorError::Settings {
                        reason: "a checkpoint round without checkpoint settings".into(),
                    })?;
                let made =
                    c.checkpointer
                        .prepare(step + 1)
                        .map_err(|source| ActorError::Checkpoint {
                            steps_done: step + 1,
                            source,
                        })?;
                dir = Some(made);
                (step + 1, 0.0)
            }
        };
        for (i, m) in self.members.iter().enumerate() {
            let work = match (round, &self.evaluation, &dir) {
                (Round::Train(_), _, _) => Work::Train,
                (Round::Eval(_), Some(e), _) => Work::Eval((e.data)(m.replica, m.rank)?),
                (Round::Eval(_), None, _) => Work::Eval(HashMap::new()),
                (Round::Save(_), _, Some(d)) => Work::Save(d.clone()),
                (Round::Save(_), _, None) => Work::Save(Default::default()),
            };
            let plan = StepPlan {
                round: index,
                step,
                lr,
                index: i,
                work,
                reply: reply.clone(),
            };
            m.control.send_async(plan).await.map_err(|_| self.gone(m))?;
        }
        Ok(dir)
    }

    /// Waits for every member's answer; fails with the who-waits-on-whom report when no
    /// actor changes what it does for the watchdog's time.
    async fn wait_all(
        &mut self,
        round: u64,
        done: &flume::Receiver<Answer>,
        early: &mut Vec<Answer>,
    ) -> Result<Vec<StepOutcome>, ActorError> {
        let mut events: Vec<Option<StepOutcome>> = (0..self.members.len()).map(|_| None).collect();
        // Answers for the next step may come before this one's last: keep them.
        let take = |(i, s, result): Answer,
                    events: &mut Vec<Option<StepOutcome>>,
                    early: &mut Vec<Answer>|
         -> Result<(), ActorError> {
            if s == round {
                events[i] = Some(result?);
            } else {
                early.push((i, s, result));
            }
            Ok(())
        };
        for a in std::mem::take(early) {
            take(a, &mut events, early)?;
        }
        // The watchdog looks at the progress counter this often.
        let tick = (self.watchdog / 8).max(Duration::from_millis(1));
        let mut seen = self.progress.load(Ordering::Relaxed);
        let mut last_change = Instant::now();
        while events.iter().any(Option::is_none) {
            tokio::select! {
                answer = done.recv_async() => {
                    let a = answer.map_err(|_| ActorError::ActorGone { actor: "every stage actor".into() })?;
                    take(a, &mut events, early)?;
                }
                _ = tokio::time::sleep(tick) => {
                    let now = self.progress.load(Ordering::Relaxed);
                    if now != seen {
                        seen = now;
                        last_change = Instant::now();
                    } else if last_change.elapsed() >= self.watchdog {
                        return Err(ActorError::Stalled {
                            seconds: self.watchdog.as_secs_f64(),
                            report: self.report(),
                        });
                    }
                }
            }
        }
        Ok(events.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// One line per stage actor: what it is doing or waiting for.
    fn report(&self) -> String {
        let mut lines = Vec::new();
        for m in &self.members {
            let replica = replica_name(m.replica, self.shards);
            let who = match m.stages.as_slice() {
                [stage] => format!("{replica} stage {stage}"),
                stages => format!("{replica} rank {} (stages {stages:?})", m.rank),
            };
            let what = match &*m.status.borrow() {
                Status::Idle => "is idle (its step is done)".to_string(),
                Status::Finished => "has stopped".to_string(),
                Status::Running(a) => format!("is running {}", describe(a)),
                Status::Waiting { action, from } => {
                    format!("waits for {} from {from}", describe(action))
                }
            };
            lines.push(format!("{who} {what}"));
        }
        lines.join("\n")
    }

    fn gone(&self, m: &Member<P>) -> ActorError {
        ActorError::ActorGone {
            actor: format!("{} rank {}", replica_name(m.replica, self.shards), m.rank),
        }
    }
}

/// The error a member reported, where `e` only says that a member is gone: a member that
/// fails sends its answer before it ends, so the answer is already waiting, and the run
/// reports the same cause however the scheduler's look-ahead and the failure interleave.
fn root_cause(
    e: ActorError,
    done: &flume::Receiver<Answer>,
    early: &mut Vec<Answer>,
) -> ActorError {
    if !matches!(e, ActorError::ActorGone { .. }) {
        return e;
    }
    let waiting = std::mem::take(early).into_iter().chain(done.try_iter());
    waiting
        .filter_map(|(_, _, r)| r.err())
        .find(|f| !matches!(f, ActorError::ActorGone { .. }))
        .unwrap_or(e)
}

/// "RecvGrad mb 5", "F mb 2", "AllReduce".
fn describe(a: &pipetrain_schedules::Action) -> String {
    use pipetrain_schedules::ActionKind as K;
    let name = match a.kind() {
        K::Forward => "F",
        K::Backward => "B",
        K::BackwardInput => "I",
        K::BackwardWeight => "W",
        K::SendAct => "SendAct",
        K::RecvAct => "RecvAct",
        K::SendGrad => "SendGrad",
        K::RecvGrad => "RecvGrad",
        K::AllReduce => "AllReduce",
        K::OptimizerStep => "OptimizerStep",
    };
    match a.micro_batch() {
        Some(mb) => format!("{name} mb {mb}"),
        None => name.to_string(),
    }
}
