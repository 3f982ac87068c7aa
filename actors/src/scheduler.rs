//! The scheduler actor: hands every stage actor its step, waits for all of them, and
//! watches progress. When nothing moves for the watchdog's time it fails the run with a
//! report of who waits on whom.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::Trace;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::coordinator::{CoordinatorHandle, StepResult};
use crate::error::ActorError;
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
enum Round {
    Train(u64),
    /// Evaluation after training step `.0`.
    Eval(u64),
}

/// Drives the run.
pub(crate) struct SchedulerActor<P> {
    pub members: Vec<Member<P>>,
    pub coordinator: CoordinatorHandle,
    pub progress: Arc<AtomicU64>,
    pub watchdog: Duration,
    pub replicas: usize,
    pub ranks: usize,
    pub evaluation: Option<Evaluation<P>>,
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
        let mut rounds = Vec::new();
        for step in steps {
            rounds.push(Round::Train(step));
            if self
                .evaluation
                .as_ref()
                .is_some_and(|e| (step + 1) % e.every == 0)
            {
                rounds.push(Round::Eval(step));
            }
        }
        let mut traces = Vec::new();
        // Each member can have two rounds' answers in flight (see the look-ahead below).
        let (done_tx, done_rx) = flume::bounded(2 * self.members.len());
        let mut early: Vec<Answer> = Vec::new();
        if let Some(&first) = rounds.first() {
            self.hand_out(0, first, &done_tx).await?;
        }
        let mut pending: Option<StepResult> = None;
        for (i, &round) in rounds.iter().enumerate() {
            // Hand out the next round before this one ends: an actor that finishes goes on
            // at once instead of waiting for the round trip through the scheduler and the
            // coordinator. Rounds stay in order: each actor runs its plans one by one, and
            // a step's optimizer update is the last action of its list.
            if let Some(&next) = rounds.get(i + 1) {
                self.hand_out(i as u64 + 1, next, &done_tx).await?;
            }
            let outcomes = self.wait_all(i as u64, &done_rx, &mut early).await?;
            let mut losses = Vec::new();
            let mut events = Vec::with_capacity(outcomes.len());
            for (m, o) in self.members.iter().zip(outcomes) {
                losses.extend(o.losses.into_iter().map(|(mb, l)| (m.replica, mb, l)));
                events.push(o.events);
            }
            match round {
                Round::Train(step) => {
                    let mut per_replica = vec![
                        Trace {
                            ranks: vec![Vec::new(); self.ranks]
                        };
                        self.replicas
                    ];
                    for (m, ev) in self.members.iter().zip(events) {
                        per_replica[m.replica].ranks[m.rank] = ev;
                    }
                    traces.push(per_replica);
                    if let Some(r) = pending.take() {
                        on_step(&r);
                    }
                    pending = Some(self.coordinator.end(step, losses).await?);
                }
                Round::Eval(step) => {
                    let loss = self.coordinator.evaluated(step, losses).await?;
                    if let Some(r) = pending.as_mut() {
                        r.eval_loss = Some(loss);
                    }
                }
            }
        }
        if let Some(r) = pending.take() {
            on_step(&r);
        }
        Ok(traces)
    }

    /// Sends every member its plan for `round` (the `index`-th of the run).
    async fn hand_out(
        &self,
        index: u64,
        round: Round,
        reply: &flume::Sender<Answer>,
    ) -> Result<(), ActorError> {
        let (step, lr) = match round {
            Round::Train(step) => (step, self.coordinator.begin(step).await?),
            Round::Eval(step) => (step, 0.0),
        };
        for (i, m) in self.members.iter().enumerate() {
            let work = match (round, &self.evaluation) {
                (Round::Train(_), _) => Work::Train,
                (Round::Eval(_), Some(e)) => Work::Eval((e.data)(m.replica, m.rank)?),
                (Round::Eval(_), None) => Work::Eval(HashMap::new()),
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
        Ok(())
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
            let who = if m.stages.len() == 1 {
                format!("replica {} stage {}", m.replica, m.stages[0])
            } else {
                format!(
                    "replica {} rank {} (stages {:?})",
                    m.replica, m.rank, m.stages
                )
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
            actor: format!("replica {} rank {}", m.replica, m.rank),
        }
    }
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
