//! A stage actor's all-reduce, with gradient buckets reduced while the backward still
//! runs: at the start of a step the actor hands each of its stages that all-reduces a
//! channel, and a task all-reduces (or reduce-scatters, for a stage whose gradients are
//! sharded) whatever arrives on it, bucket after bucket, in the
//! order the backward completes them (the same order on every replica, so
//! the collective pairs the same buckets everywhere). The all-reduce action then only
//! waits for the last bucket and hands the sums back; a compute that took the channel
//! and sent no bucket fails the step (its gradients would go unreduced). A compute
//! without buckets declines the channel, and the all-reduce action reduces all its
//! gradients at once.

use pipetrain_schedules::{Action, ActionKind};
use tokio::task::JoinHandle;

use crate::error::ActorError;
use crate::stage::{StageActor, Status};
use crate::traits::{Collective, GradBucket, StageCompute};

/// One stage's buckets being reduced: the sums, in bucket order, once every bucket has
/// arrived and the channel closed.
pub(crate) type Reduction = JoinHandle<Result<Vec<Vec<f32>>, ActorError>>;

impl<C: StageCompute, K: Collective> StageActor<C, K> {
    /// Starts reducing the buckets of each stage that all-reduces this step, where its
    /// compute takes the channel; a reduction left from a failed step is dropped.
    pub(crate) fn start_reductions(&mut self) {
        for (_, stale) in self.reducing.drain() {
            stale.abort();
        }
        for a in &self.actions {
            if a.kind() != ActionKind::AllReduce {
                continue;
            }
            let s = a.stage();
            let Some(compute) = self.computes.get_mut(&s) else {
                continue;
            };
            let (tx, rx) = flume::unbounded::<GradBucket>();
            if !compute.reduce_buckets_into(Some(tx)) {
                continue;
            }
            let (collective, replica) = (self.collective.clone(), self.replica);
            let reduction = tokio::spawn(async move {
                let mut sums = Vec::new();
                while let Ok(bucket) = rx.recv_async().await {
                    let sum = match &bucket.parts {
                        Some(parts) => {
                            (collective.reduce_scatter(s, replica, bucket.values, parts)).await?
                        }
                        None => collective.all_reduce_sum(s, replica, bucket.values).await?,
                    };
                    match bucket.back {
                        // The compute may be gone (a failed step): nothing to hand back.
                        Some(back) => drop(back.send(sum)),
                        None => sums.push(sum),
                    }
                }
                Ok(sums)
            });
            self.reducing.insert(s, reduction);
        }
    }

    /// The all-reduce of stage `action.stage()`'s gradients across the replicas: the
    /// buckets' sums once the last arrives, or the whole gradients reduced now.
    pub(crate) async fn all_reduce(&mut self, action: Action) -> Result<(), ActorError> {
        let s = action.stage();
        self.set(Status::Waiting {
            action,
            from: format!(
                "the other replicas of stage {s}{}",
                self.places.other_replicas(
                    self.replica,
                    self.placement.get(s).copied().unwrap_or(usize::MAX)
                )
            ),
        });
        if let Some(reduction) = self.reducing.remove(&s) {
            self.compute(s)?.reduce_buckets_into(None);
            let sums = reduction.await.map_err(|e| ActorError::Peer {
                reason: format!("the gradient reduction of stage {s} ended abnormally: {e}"),
            })??;
            return self
                .compute(s)?
                .put_buckets(sums)
                .map_err(|source| self.failed(action, source));
        }
        if self.compute(s)?.reduces_own_grads() {
            let summed = self.compute(s)?.all_reduce_own().await;
            return summed.map_err(|source| self.failed(action, source));
        }
        if self.places.replicas() == 1 {
            // A sum over one replica is its own gradients: nothing to take or put back
            // (a stage keeping them on a device would copy them out and in for nothing).
            return Ok(());
        }
        let grads = self.compute(s)?.take_grads();
        // A replica updating its part of the stage needs only that part summed.
        let sum = match self.compute(s)?.update_parts() {
            Some(parts) => {
                (self.collective)
                    .reduce_scatter(s, self.replica, grads, &parts)
                    .await?
            }
            None => {
                (self.collective)
                    .all_reduce_sum(s, self.replica, grads)
                    .await?
            }
        };
        self.compute(s)?.put_grads(sum);
        Ok(())
    }
}
