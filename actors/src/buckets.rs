//! Gradient buckets reduced while the backward still runs: at the start of a step a
//! stage actor hands each of its stages with an all-reduce a channel, and a task that
//! all-reduces whatever arrives on it, bucket after bucket, in the order the step's last
//! backward completes them (the same order on every replica, so the collective pairs
//! the same buckets everywhere). The all-reduce action then only waits for the last
//! bucket and hands the sums back (a compute that took the channel and sent no bucket
//! fails the step: its gradients would go unreduced). A compute without buckets
//! declines the channel, and the all-reduce action reduces all its gradients at once.

use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::error::ActorError;
use crate::traits::{Collective, StageCompute};

/// One stage's buckets being reduced: the sums so far, in bucket order, once every
/// bucket has arrived and the channel closed.
pub(crate) type Reduction = JoinHandle<Result<Vec<Vec<f32>>, ActorError>>;

/// Offers `compute` (stage `stage` of `replica`) a channel for its buckets; when it
/// takes it, starts the task that reduces them.
pub(crate) fn start<C: StageCompute, K: Collective>(
    compute: &mut C,
    collective: &Arc<K>,
    stage: usize,
    replica: usize,
) -> Option<Reduction> {
    let (tx, rx) = flume::unbounded::<Vec<f32>>();
    if !compute.reduce_buckets_into(Some(tx)) {
        return None;
    }
    let collective = collective.clone();
    Some(tokio::spawn(async move {
        let mut sums = Vec::new();
        while let Ok(bucket) = rx.recv_async().await {
            sums.push(collective.all_reduce_sum(stage, replica, bucket).await?);
        }
        Ok(sums)
    }))
}

/// Takes the channel back from `compute` and waits for the last bucket's sum: the sums
/// in bucket order.
pub(crate) async fn finish<C: StageCompute>(
    compute: &mut C,
    reduction: Reduction,
    stage: usize,
) -> Result<Vec<Vec<f32>>, ActorError> {
    compute.reduce_buckets_into(None);
    reduction.await.map_err(|e| ActorError::Peer {
        reason: format!("the gradient reduction of stage {stage} ended abnormally: {e}"),
    })?
}
