//! A step's decisions: the update decision from every stage's gradient statistics, the
//! step's result from its losses, the evaluation's mean; in a distributed run, from what
//! every process sent over the bus.

use std::collections::BTreeMap;

use tokio::sync::oneshot;

use super::{wire, Coordinator, StepResult, Waiter};
use crate::decide::{GradStats, LossScaling};
use crate::error::ActorError;

/// `(replica, [(stage, statistics)])` of a step, from every rank that sent them.
pub(super) type ReplicaStats = Vec<(usize, Vec<(usize, GradStats)>)>;

/// A step's micro-batch losses, `(replica, stage, statistics)`, and whether a process
/// was asked to stop.
pub(super) type StepTotals = (wire::Triples, Vec<(usize, usize, GradStats)>, bool);

/// What a gather over the bus brings back, with the replies waiting on it.
pub(super) enum Gathered {
    Decide {
        step: u64,
        ranks: Result<ReplicaStats, ActorError>,
        waiters: Vec<Waiter>,
    },
    End {
        step: u64,
        all: Result<StepTotals, ActorError>,
        reply: oneshot::Sender<Result<StepResult, ActorError>>,
    },
    Eval {
        step: u64,
        all: Result<(wire::Triples, Option<(f64, f64)>), ActorError>,
        reply: oneshot::Sender<Result<(f64, Option<f64>), ActorError>>,
    },
}

impl Coordinator {
    /// Keeps a rank's statistics until every stage of every replica has sent its own,
    /// then decides and answers them all.
    pub(super) fn gather(
        &mut self,
        step: u64,
        replica: usize,
        stats: Vec<(usize, GradStats)>,
        reply: Waiter,
    ) {
        let entry = self.waiting.entry(step).or_default();
        entry.push((replica, stats, reply));
        let have: usize = entry.iter().map(|(_, s, _)| s.len()).sum();
        if have < self.s.local_stats {
            return;
        }
        let local = self.waiting.remove(&step).unwrap_or_default();
        let mut ranks = Vec::with_capacity(local.len());
        let mut waiters = Vec::with_capacity(local.len());
        for (replica, list, reply) in local {
            ranks.push((replica, list));
            waiters.push(reply);
        }
        match self.s.bus.clone() {
            None => self.decide(step, ranks, waiters),
            Some(bus) => {
                // Every process's statistics, so that every process decides the same.
                let flat: wire::Triples = ranks
                    .iter()
                    .flat_map(|(r, list)| list.iter().map(move |&(s, g)| (*r, s, g.sum_sq)))
                    .collect();
                let mut bytes = Vec::new();
                wire::put(&mut bytes, &flat);
                self.gathers.spawn(async move {
                    let ranks = bus
                        .all_gather(format!("decide/{step}"), bytes)
                        .await
                        .and_then(|parts| merge_stats(&parts));
                    Gathered::Decide {
                        step,
                        ranks,
                        waiters,
                    }
                });
            }
        }
    }

    /// A gather over the bus is back: carry on as if everything had been local.
    pub(super) fn gathered(&mut self, g: Gathered) {
        match g {
            Gathered::Decide {
                step,
                ranks,
                waiters,
            } => match ranks {
                Ok(ranks) => self.decide(step, ranks, waiters),
                Err(e) => {
                    for w in waiters {
                        let _ = w.send(Err(ActorError::ActorGone {
                            actor: format!("the decision of step {step}: {e}"),
                        }));
                    }
                }
            },
            Gathered::End { step, all, reply } => {
                let result = all.and_then(|totals| self.end(step, totals));
                let _ = reply.send(result);
            }
            Gathered::Eval { step, all, reply } => {
                let result = all.and_then(|(losses, acc)| evaluation(step, losses, acc));
                let _ = reply.send(result);
            }
        }
    }

    /// Decides `step` from every stage's statistics and answers the stage actors of this
    /// process.
    pub(super) fn decide(&mut self, step: u64, ranks: ReplicaStats, waiters: Vec<Waiter>) {
        let have: usize = ranks.iter().map(|(_, s)| s.len()).sum();
        if have != self.s.replicas * self.s.stages {
            for w in waiters {
                let _ = w.send(Err(ActorError::Settings {
                    reason: format!(
                        "step {step}: {have} stages' statistics, {} expected",
                        self.s.replicas * self.s.stages
                    ),
                }));
            }
            return;
        }
        // Every data-parallel replica holds the same reduced gradients: count each stage
        // once, from replica 0's shards (whose statistics count the replicated
        // parameters once between them), in stage order; any replica's overflow counts.
        // Where each replica holds only its part of them, every replica's count.
        let mut per_stage: BTreeMap<(usize, usize), GradStats> = BTreeMap::new();
        let mut any_bad = false;
        for (replica, list) in &ranks {
            for &(stage, s) in list {
                any_bad |= !s.finite();
                if self.counts(*replica) {
                    per_stage.insert((stage, *replica), s);
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
        for reply in waiters {
            let _ = reply.send(Ok(decision));
        }
    }

    /// Whether `replica`'s gradient statistics count towards the step's norm.
    fn counts(&self, replica: usize) -> bool {
        replica < self.s.shards || self.s.partial_stats
    }

    pub(super) fn end(
        &mut self,
        step: u64,
        (losses, stats, stop): StepTotals,
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
                    .filter(|(r, _, _)| self.counts(*r))
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
            stop,
            ended: std::time::Instant::now(),
        })
    }
}

/// The evaluation's mean loss and accuracy.
pub(super) fn evaluation(
    step: u64,
    losses: Vec<(usize, usize, f64)>,
    accuracy: Option<(f64, f64)>,
) -> Result<(f64, Option<f64>), ActorError> {
    match mean_loss(losses) {
        (0, _) => Err(ActorError::Settings {
            reason: format!("the evaluation after step {step} reported no loss"),
        }),
        (_, mean) => Ok((mean, accuracy.filter(|&(_, n)| n > 0.0).map(|(c, n)| c / n))),
    }
}

/// Every process's statistics of a decision gather.
pub(super) fn merge_stats(parts: &[Vec<u8>]) -> Result<ReplicaStats, ActorError> {
    let mut by_replica: BTreeMap<usize, Vec<(usize, GradStats)>> = BTreeMap::new();
    for p in parts {
        for (r, s, sum_sq) in wire::take(p, &mut 0)? {
            by_replica
                .entry(r)
                .or_default()
                .push((s, GradStats { sum_sq }));
        }
    }
    Ok(by_replica.into_iter().collect())
}

/// Every process's losses and statistics of a step.
pub(super) fn merge_end(parts: &[Vec<u8>]) -> Result<StepTotals, ActorError> {
    let (mut losses, mut stats, mut stop) = (Vec::new(), Vec::new(), false);
    for p in parts {
        let mut at = 0;
        losses.extend(wire::take(p, &mut at)?);
        stats.extend(
            wire::take(p, &mut at)?
                .into_iter()
                .map(|(r, s, sum_sq)| (r, s, GradStats { sum_sq })),
        );
        stop |= !wire::take(p, &mut at)?.is_empty();
    }
    Ok((losses, stats, stop))
}

/// Every process's evaluation losses and accuracy counts.
pub(super) fn merge_eval(
    parts: &[Vec<u8>],
) -> Result<(wire::Triples, Option<(f64, f64)>), ActorError> {
    let mut losses = Vec::new();
    let mut acc: Option<(f64, f64)> = None;
    for p in parts {
        let mut at = 0;
        losses.extend(wire::take(p, &mut at)?);
        let a = wire::take(p, &mut at)?;
        if let [(_, _, c), (_, _, n)] = a[..] {
            let (sc, sn) = acc.unwrap_or((0.0, 0.0));
            acc = Some((sc + c, sn + n));
        }
    }
    Ok((losses, acc))
}

/// The number of distinct `(replica, mb)` losses and their mean, added in
/// `(replica, mb)` order so the result does not depend on arrival order.
pub(super) fn mean_loss(losses: Vec<(usize, usize, f64)>) -> (usize, f64) {
    let ordered: BTreeMap<(usize, usize), f64> =
        losses.into_iter().map(|(r, mb, l)| ((r, mb), l)).collect();
    let n = ordered.len();
    (n, ordered.values().sum::<f64>() / n.max(1) as f64)
}
