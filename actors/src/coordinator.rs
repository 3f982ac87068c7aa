//! The coordinator actor: learning rate per step, the step's loss from the last stage of
//! every replica, and the per-step report (metrics).
//!
//! Its decisions are pure functions (the learning-rate schedule is handed in; the loss is
//! the mean of the micro-batch losses); the actor only gathers and orders.

use std::collections::BTreeMap;

use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::error::ActorError;

/// Requests waiting for the coordinator: only the scheduler sends, one at a time, plus
/// room for the look-ahead step's request.
const MAILBOX: usize = 2;

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
}

enum Msg {
    Eval {
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        reply: oneshot::Sender<Result<f64, ActorError>>,
    },
    Begin {
        step: u64,
        reply: oneshot::Sender<f64>,
    },
    End {
        step: u64,
        losses: Vec<(usize, usize, f64)>,
        reply: oneshot::Sender<Result<StepResult, ActorError>>,
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
    /// Starts the coordinator; `lr_at(step)` is the learning-rate schedule and
    /// `expected` the number of losses each step must report (replicas x micro-batches).
    pub(crate) fn spawn(
        lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
        expected: usize,
        tasks: &mut JoinSet<Result<(), ActorError>>,
    ) -> CoordinatorHandle {
        let (tx, rx) = flume::bounded(MAILBOX);
        tasks.spawn(run(rx, lr_at, expected));
        CoordinatorHandle { tx }
    }

    /// Sends the request `make` builds around a reply channel and waits for the reply.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Result<T, ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send_async(make(reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// The learning rate of `step`.
    ///
    /// # Errors
    /// `ActorGone` when the coordinator has stopped.
    pub(crate) async fn begin(&self, step: u64) -> Result<f64, ActorError> {
        self.ask(|reply| Msg::Begin { step, reply }).await
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

    /// Closes `step` with its micro-batch losses `(replica, mb, loss)` and returns its
    /// result.
    pub(crate) async fn end(
        &self,
        step: u64,
        losses: Vec<(usize, usize, f64)>,
    ) -> Result<StepResult, ActorError> {
        self.ask(|reply| Msg::End {
            step,
            losses,
            reply,
        })
        .await?
    }
}

#[tracing::instrument(skip_all)]
async fn run(
    rx: flume::Receiver<Msg>,
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    expected: usize,
) -> Result<(), ActorError> {
    let mut lrs: BTreeMap<u64, f64> = BTreeMap::new();
    while let Ok(msg) = rx.recv_async().await {
        match msg {
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
            Msg::Begin { step, reply } => {
                let lr = lr_at(step);
                lrs.insert(step, lr);
                let _ = reply.send(lr);
            }
            Msg::End {
                step,
                losses,
                reply,
            } => {
                let (count, mean) = mean_loss(losses);
                let result = if count == expected {
                    Ok(StepResult {
                        step,
                        loss: mean,
                        lr: lrs.remove(&step).unwrap_or(f64::NAN),
                        eval_loss: None,
                    })
                } else {
                    Err(ActorError::Settings {
                        reason: format!(
                            "step {step}: {count} micro-batch losses reported, {expected} expected"
                        ),
                    })
                };
                let _ = reply.send(result);
            }
        }
    }
    Ok(())
}

/// The number of distinct `(replica, mb)` losses and their mean, added in
/// `(replica, mb)` order so the result does not depend on arrival order.
fn mean_loss(losses: Vec<(usize, usize, f64)>) -> (usize, f64) {
    let ordered: BTreeMap<(usize, usize), f64> =
        losses.into_iter().map(|(r, mb, l)| ((r, mb), l)).collect();
    let n = ordered.len();
    (n, ordered.values().sum::<f64>() / n.max(1) as f64)
}
