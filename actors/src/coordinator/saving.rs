//! The coordinator's checkpoints: stage snapshots written on blocking threads while
//! training goes on, completed one at a time in step order; in a distributed run, every
//! process writes its own stages' files and process 0 completes the checkpoint once all
//! of them are on disk.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use super::Coordinator;
use crate::checkpoint::{Checkpointer, CommitState, SaveJob, SavedCheckpoint, ShardFile};
use crate::error::ActorError;
use crate::traits::Bus;

/// A checkpoint waiting for (or in) its turn.
pub(super) struct PendingSave {
    pub state: CommitState,
    pub dir: PathBuf,
    pub jobs: Vec<SaveJob>,
    pub started: oneshot::Sender<()>,
    pub notify: Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
}

/// A checkpoint being written, and who is told when it completes.
pub(super) type Writing = (
    Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>,
    Result<SavedCheckpoint, ActorError>,
);

impl Coordinator {
    /// Starts the oldest waiting checkpoint when none is being written: checkpoints are
    /// completed one at a time, in step order, so the newest complete one is always the
    /// latest written.
    pub(super) fn start_next_save(&mut self) {
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
        let bus = self.s.bus.clone();
        let PendingSave {
            state,
            dir,
            jobs,
            started,
            notify,
        } = next;
        let _ = started.send(());
        self.saving.spawn(async move {
            let written = write_checkpoint(state, dir, jobs, checkpointer, bus).await;
            (notify, written)
        });
    }

    pub(super) fn answer_finish(&mut self) {
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
    bus: Option<Arc<dyn Bus>>,
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
    if let Some(bus) = bus {
        // Every process's files are on disk once the gather returns; process 0 completes
        // the checkpoint with all of them, the others go on.
        let mine = serde_json::to_vec(&files).map_err(|e| failed(e.to_string().into()))?;
        let all = bus
            .all_gather(format!("saved/{}", state.steps_done), mine)
            .await?;
        if bus.node() != 0 {
            return Ok(SavedCheckpoint {
                steps_done: state.steps_done,
                path: dir,
                bytes: files.iter().map(|f| f.bytes).sum(),
                seconds: start.elapsed().as_secs_f64(),
            });
        }
        files = Vec::new();
        for part in all {
            let theirs: Vec<ShardFile> =
                serde_json::from_slice(&part).map_err(|e| failed(e.to_string().into()))?;
            files.extend(theirs);
        }
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
