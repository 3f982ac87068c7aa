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

/// One micro-batch from `source`; a source that panics gives an error with its message
/// (the stage reports it as the run's cause).
fn read<D: DataSource>(
    source: &D,
    step: u64,
    replica: usize,
    mb: usize,
    stage: usize,
) -> Result<D::Payload, BoxError> {
    let read = || source.micro_batch(step, replica, mb, stage);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read))
        .unwrap_or_else(|p| Err(format!("the data source panicked: {}", panic_text(&*p)).into()))
}

/// A panic's message, where it has one.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
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
            // A source may block (reading a file, waiting for an embedder's batch): off
            // the runtime's worker, which the scheduler and coordinator share.
            let source = source.clone();
            let made = tokio::task::spawn_blocking(move || {
                (0..micro_batches)
                    .map(|mb| DataItem {
                        step,
                        mb,
                        payload: read(&*source, step, replica, mb, stage),
                    })
                    .collect::<Vec<_>>()
            })
            .await;
            let batch = made.map_err(|e| ActorError::ActorGone {
                actor: format!("the data reader of replica {replica} stage {stage} ({e})"),
            })?;
            if tx.send_async(batch).await.is_err() {
                // The stage stopped (run over or failed): nothing more to prepare.
                return Ok(());
            }
        }
        Ok(())
    });
    rx
}
