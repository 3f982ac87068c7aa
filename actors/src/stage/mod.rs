//! The stage actor: one per (pipeline rank, data-parallel replica). It owns the compute
//! of the stages its rank holds (one, or several with virtual stages) and runs the rank's
//! action list every step, exchanging activations and gradients with its peers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pipetrain_schedules::{Action, ActionKind, TraceEvent};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::coordinator::CoordinatorHandle;
use crate::data::DataItem;
use crate::decide::{GradPolicy, StepDecision};
use crate::error::ActorError;
pub(crate) use crate::messages::{Answer, Flow, Status, StepOutcome, StepPlan, Transfer, Work};
use crate::places::Places;
use crate::traits::{BackwardPart, Collective, StageCompute};

mod exchange;
mod update;
use exchange::recv_spinning;

/// Everything a stage actor is given at spawn.
pub(crate) struct StageActor<C: StageCompute, K: Collective> {
    pub replica: usize,
    pub rank: usize,
    pub actions: Vec<Action>,
    pub placement: Vec<usize>,
    pub computes: HashMap<usize, C>,
    pub inbox: flume::Receiver<Transfer<C::Payload>>,
    pub peers: Vec<flume::Sender<Transfer<C::Payload>>>,
    pub data: HashMap<usize, flume::Receiver<Vec<DataItem<C::Payload>>>>,
    /// The rest of the step's micro-batches per data-reading stage.
    pub data_ahead: HashMap<usize, std::collections::VecDeque<DataItem<C::Payload>>>,
    pub control: flume::Receiver<StepPlan<C::Payload>>,
    /// The rank's forward-only list for an evaluation round.
    pub eval_actions: Vec<Action>,
    pub collective: Arc<K>,
    pub status: watch::Sender<Status>,
    pub progress: Arc<AtomicU64>,
    pub origin: Instant,
    pub record: bool,
    pub coordinator: CoordinatorHandle,
    pub policy: GradPolicy,
    /// How long to poll a mailbox before parking the thread (see [`recv_spinning`]).
    pub spin: std::time::Duration,
    /// Where other processes' members run, for the watchdog's report.
    pub places: Arc<Places>,
    /// This step's gradient buckets under reduction, by stage.
    pub reducing: HashMap<usize, crate::buckets::Reduction>,
    /// Tensor shards per data-parallel replica (this actor is shard
    /// `replica % shards`); only shard 0 reports losses.
    pub shards: usize,
}

impl<C: StageCompute, K: Collective> StageActor<C, K> {
    /// Runs steps until the scheduler's handle drops.
    #[tracing::instrument(skip(self), fields(replica = self.replica, rank = self.rank))]
    pub async fn run(mut self) -> Result<HashMap<usize, C>, ActorError> {
        while let Ok(plan) = recv_spinning(&self.control, self.spin).await {
            let result = match plan.work {
                Work::Train => self.step(plan.step, plan.lr).await,
                Work::Eval(data) => self.evaluate(data).await,
                Work::Save(dir) => self.snapshot(plan.step, &dir),
            };
            let failed = result.is_err();
            // The scheduler may already have given up (watchdog): nobody to tell then.
            let _ = plan
                .reply
                .send_async((plan.index, plan.round, result))
                .await;
            if failed {
                // The run is over for everyone; the scheduler tears the rest down.
                break;
            }
        }
        self.set(Status::Finished);
        Ok(self.computes)
    }

    pub(crate) fn set(&self, s: Status) {
        self.progress.fetch_add(1, Ordering::Relaxed);
        let _ = self.status.send(s);
    }

    async fn step(&mut self, step: u64, lr: f64) -> Result<StepOutcome, ActorError> {
        let mut outgoing: HashMap<(Flow, usize, usize), C::Payload> = HashMap::new();
        let mut arrived: HashMap<(Flow, usize, usize), C::Payload> = HashMap::new();
        let mut out = StepOutcome::default();
        let mut decision = None;
        self.start_reductions();
        for i in 0..self.actions.len() {
            let action = self.actions[i];
            self.set(Status::Running(action));
            let start = self
                .act(
                    action,
                    (step, lr),
                    &mut outgoing,
                    &mut arrived,
                    &mut out,
                    &mut decision,
                )
                .await?;
            if self.record {
                out.events.push(TraceEvent {
                    action,
                    start_ns: (start - self.origin).as_nanos() as u64,
                    end_ns: (Instant::now() - self.origin).as_nanos() as u64,
                });
            }
        }
        self.set(Status::Idle);
        if let Some(((flow, stage, mb), _)) = arrived.into_iter().next() {
            return Err(self.protocol(format!(
                "{flow:?} for stage {stage} mb {mb} arrived but was never used"
            )));
        }
        out.finished = Some(std::time::Instant::now());
        Ok(out)
    }

    async fn act(
        &mut self,
        action: Action,
        (step, lr): (u64, f64),
        outgoing: &mut HashMap<(Flow, usize, usize), C::Payload>,
        arrived: &mut HashMap<(Flow, usize, usize), C::Payload>,
        out: &mut StepOutcome,
        decision: &mut Option<StepDecision>,
    ) -> Result<Instant, ActorError> {
        // Traces time the work itself: waiting for an input is idle time, not work.
        let mut start = Instant::now();
        let s = action.stage();
        let mb = action.micro_batch().unwrap_or(0);
        let last = self.placement.len() - 1;
        match action.kind() {
            ActionKind::Forward => {
                let input = self.forward_input(s, mb, outgoing, arrived).await?;
                if s > 0 && input.is_none() {
                    return Err(
                        self.protocol(format!("{action} has no input from stage {}", s - 1))
                    );
                }
                let data = self.forward_data(action, step).await?;
                start = Instant::now();
                let result = self
                    .compute(s)?
                    .forward(mb, input, data)
                    .await
                    .map_err(|source| self.failed(action, source))?;
                if let Some(loss) = result.loss.filter(|_| self.reports_losses()) {
                    out.losses.push((mb, loss));
                }
                if let Some(p) = result.output.filter(|_| s < last) {
                    outgoing.insert((Flow::Act, s, mb), p);
                }
            }
            ActionKind::Backward | ActionKind::BackwardInput | ActionKind::BackwardWeight => {
                let part = match action.kind() {
                    ActionKind::Backward => BackwardPart::Full,
                    ActionKind::BackwardInput => BackwardPart::Input,
                    _ => BackwardPart::Weight,
                };
                let grad = if s == last || part == BackwardPart::Weight {
                    None
                } else {
                    match outgoing.remove(&(Flow::Grad, s + 1, mb)) {
                        Some(local) => Some(local),
                        None => Some(self.receive(Action::recv_grad(s, mb), arrived).await?),
                    }
                };
                start = Instant::now();
                let result = self
                    .compute(s)?
                    .backward(mb, part, grad)
                    .await
                    .map_err(|source| self.failed(action, source))?;
                if let Some(p) = result.filter(|_| s > 0) {
                    outgoing.insert((Flow::Grad, s, mb), p);
                }
            }
            ActionKind::SendAct | ActionKind::SendGrad => {
                let flow = if action.kind() == ActionKind::SendAct {
                    Flow::Act
                } else {
                    Flow::Grad
                };
                let payload = outgoing
                    .remove(&(flow, s, mb))
                    .ok_or_else(|| self.protocol(format!("{action} has nothing to send")))?;
                self.send(action, payload).await?;
            }
            // A receive is posted here and waited for by the compute that reads it (as
            // MPI's irecv and wait): sends never block (mailboxes hold a whole step), so
            // only true data dependencies make an actor wait, as the simulator models.
            ActionKind::RecvAct | ActionKind::RecvGrad => {}
            ActionKind::AllReduce => self.all_reduce(action).await?,
            ActionKind::OptimizerStep => {
                self.optimizer_step(action, (step, lr), out, decision)
                    .await?
            }
        }
        Ok(start)
    }

    /// The data a forward (`action`) of `step` reads, where its stage reads data.
    async fn forward_data(
        &mut self,
        action: Action,
        step: u64,
    ) -> Result<Option<C::Payload>, ActorError> {
        let (s, mb) = (action.stage(), action.micro_batch().unwrap_or(0));
        if !self.data.contains_key(&s) {
            return Ok(None);
        }
        let item = self.next_data(s, step, action).await?;
        if (item.step, item.mb) != (step, mb) {
            return Err(self.protocol(format!(
                "{action} of step {step} got data of step {} mb {}",
                item.step, item.mb
            )));
        }
        let payload = item.payload.map_err(|source| ActorError::Data {
            replica: self.replica,
            step,
            micro_batch: mb,
            source,
        })?;
        Ok(Some(payload))
    }

    /// A checkpoint round: replica 0's actors snapshot their stages (every replica holds
    /// the same state; with a sharded optimizer, each replica its part); the jobs go
    /// back to the coordinator, which writes them.
    fn snapshot(
        &mut self,
        steps_done: u64,
        dir: &std::path::Path,
    ) -> Result<StepOutcome, ActorError> {
        let mut out = StepOutcome::default();
        let mut stages: Vec<usize> = self.computes.keys().copied().collect();
        stages.sort_unstable();
        for s in stages {
            // Data-parallel replica 0's tensor shards: each saves its part; every
            // replica holding a part of a sharded optimizer state saves that part.
            if self.replica >= self.shards && self.compute(s)?.update_parts().is_none() {
                continue;
            }
            let job = self
                .compute(s)?
                .save(s, dir)
                .map_err(|source| ActorError::Checkpoint { steps_done, source })?;
            out.saves.push(job);
        }
        Ok(out)
    }

    /// An evaluation round: forward only, no stash, no gradients.
    async fn evaluate(
        &mut self,
        mut data: HashMap<usize, std::collections::VecDeque<C::Payload>>,
    ) -> Result<StepOutcome, ActorError> {
        let mut outgoing: HashMap<(Flow, usize, usize), C::Payload> = HashMap::new();
        let mut arrived: HashMap<(Flow, usize, usize), C::Payload> = HashMap::new();
        let mut out = StepOutcome::default();
        let last = self.placement.len() - 1;
        for i in 0..self.eval_actions.len() {
            let action = self.eval_actions[i];
            self.set(Status::Running(action));
            let (s, mb) = (action.stage(), action.micro_batch().unwrap_or(0));
            match action.kind() {
                ActionKind::Forward => {
                    let input = self
                        .forward_input(s, mb, &mut outgoing, &mut arrived)
                        .await?;
                    let batch = data.get_mut(&s).and_then(|q| q.pop_front());
                    let result = self
                        .compute(s)?
                        .evaluate(mb, input, batch)
                        .await
                        .map_err(|source| self.failed(action, source))?;
                    if let Some(loss) = result.loss.filter(|_| self.reports_losses()) {
                        out.losses.push((mb, loss));
                    }
                    if let Some((c, n)) = result.accuracy.filter(|_| self.reports_losses()) {
                        let (sc, sn) = out.accuracy.unwrap_or((0.0, 0.0));
                        out.accuracy = Some((sc + c, sn + n));
                    }
                    if let Some(p) = result.output.filter(|_| s < last) {
                        outgoing.insert((Flow::Act, s, mb), p);
                    }
                }
                ActionKind::SendAct => {
                    let payload = outgoing
                        .remove(&(Flow::Act, s, mb))
                        .ok_or_else(|| self.protocol(format!("{action} has nothing to send")))?;
                    self.send(action, payload).await?;
                }
                _ => {}
            }
        }
        self.set(Status::Idle);
        Ok(out)
    }

    pub(crate) fn compute(&mut self, stage: usize) -> Result<&mut C, ActorError> {
        let (replica, rank) = (self.replica, self.rank);
        self.computes
            .get_mut(&stage)
            .ok_or_else(|| ActorError::Protocol {
                replica,
                rank,
                reason: format!("stage {stage} is not on this rank"),
            })
    }

    pub(crate) fn failed(&self, action: Action, source: crate::error::BoxError) -> ActorError {
        ActorError::Compute {
            replica: self.replica,
            shards: self.shards,
            stage: action.stage(),
            action,
            source,
        }
    }

    /// Whether this actor reports its losses (tensor shard 0 of its replica: the
    /// other shards compute the same ones).
    fn reports_losses(&self) -> bool {
        self.replica % self.shards == 0
    }

    fn protocol(&self, reason: String) -> ActorError {
        ActorError::Protocol {
            replica: self.replica,
            rank: self.rank,
            reason,
        }
    }
}
