//! The data actor: one per (replica, stage that reads data), producing that stage's
//! micro-batches ahead of time.

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::error::{ActorError, BoxError};
use crate::traits::DataSource;

/// Steps of micro-batches prepared ahead of the stage that reads them: two keep the
/// stage from waiting on batch assembly without holding much memory. A step's
/// micro-batches travel as one message, so the stage's thread and the data actor wake
/// each other once a step, not once a micro-batch.
pub const PREFETCH: usize = 2;

/// One prepared micro-batch (or the source's error for it, which the stage reports).
pub(crate) struct DataItem<P> {
    pub step: u64,
    pub mb: usize,
    pub payload: Result<P, BoxError>,
}

/// Starts the data actor of `stage` of `replica` for steps `first..first + steps`.
pub(crate) fn spawn_data_actor<D: DataSource>(
    source: Arc<D>,
    replica: usize,
    stage: usize,
    micro_batches: usize,
    steps: std::ops::Range<u64>,
    tasks: &mut JoinSet<Result<(), ActorError>>,
) -> flume::Receiver<Vec<DataItem<D::Payload>>> {
    let (tx, rx) = flume::bounded(PREFETCH);
    tasks.spawn(async move {
        for step in steps {
            let batch = (0..micro_batches)
                .map(|mb| DataItem {
                    step,
                    mb,
                    payload: source.micro_batch(step, replica, mb, stage),
                })
                .collect();
            if tx.send_async(batch).await.is_err() {
                // The stage stopped (run over or failed): nothing more to prepare.
                return Ok(());
            }
        }
        Ok(())
    });
    rx
}
