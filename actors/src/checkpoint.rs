//! What the runtime needs to save a checkpoint, without knowing its format: each stage
//! compute snapshots its own state into a [`SaveJob`] (run on a blocking thread while
//! training goes on), and a [`Checkpointer`] makes the folder the shards go to and,
//! once every shard is on disk, writes what completes the checkpoint (the root crate:
//! a manifest, written last, then an atomic rename).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::decide::ScalerState;
use crate::error::BoxError;

/// One file a stage wrote into a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardFile {
    /// The stage whose state it holds.
    pub stage: usize,
    /// Its name inside the checkpoint folder.
    pub file: String,
    /// Its length.
    pub bytes: u64,
    /// CRC-32 of its bytes, so a torn or altered file is refused when loaded.
    pub crc32: u32,
}

/// A stage's snapshot, ready to be written and synced: it owns copies of everything it
/// writes, so the stage trains on while the job runs.
pub type SaveJob = Box<dyn FnOnce() -> Result<Vec<ShardFile>, BoxError> + Send>;

/// The run's state at a checkpoint that the coordinator holds (stages hold the rest).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommitState {
    /// Optimizer steps completed: the step a resumed run starts at.
    pub steps_done: u64,
    /// The loss scaler after those steps.
    pub scaler: ScalerState,
}

/// A complete checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedCheckpoint {
    /// Optimizer steps it holds.
    pub steps_done: u64,
    /// Its folder.
    pub path: PathBuf,
    /// Bytes of its shards.
    pub bytes: u64,
    /// From the snapshot to the completed commit.
    pub seconds: f64,
}

/// Makes checkpoint folders and completes them.
pub trait Checkpointer: Send + Sync + 'static {
    /// A folder for the shards of the checkpoint after `steps_done` steps (several
    /// processes of one job may prepare the same step: each gets the same folder).
    ///
    /// # Errors
    /// When the folder cannot be made.
    fn prepare(&self, steps_done: u64) -> Result<PathBuf, BoxError>;

    /// Completes the checkpoint in `dir` once every shard is written and synced; returns
    /// where it now is. Called in step order, one at a time.
    ///
    /// # Errors
    /// When it cannot be completed; the folder is then never taken for a checkpoint.
    fn commit(
        &self,
        dir: &Path,
        state: CommitState,
        shards: Vec<ShardFile>,
    ) -> Result<PathBuf, BoxError>;
}

/// When and where to save.
#[derive(Clone)]
pub struct CheckpointSettings {
    /// After every this many optimizer steps (and after the last one).
    pub every: u64,
    /// Makes and completes the folders.
    pub checkpointer: std::sync::Arc<dyn Checkpointer>,
}

impl std::fmt::Debug for CheckpointSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointSettings")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}
