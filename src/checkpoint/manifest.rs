//! The manifest: the JSON file that makes a folder of shards a checkpoint. It is written
//! last, after every shard is on disk, so a folder without one is never loaded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pipetrain_actors::{ScalerState, ShardFile};
use prost::Message;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::onnx::proto::ModelProto;
use crate::optim::{LrSchedule, OptimizerConfig};
use crate::{Error, Result};

/// The manifest's file name inside a checkpoint folder.
pub const MANIFEST: &str = "manifest.json";
/// What the manifest's `format` field says.
pub const FORMAT: &str = "pipetrain-checkpoint";
/// The version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Everything about a checkpoint that its shards do not hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the build that wrote it.
    pub format_version: u32,
    /// The pipetrain version that wrote it.
    pub pipetrain_version: String,
    /// Optimizer steps the checkpoint holds: a resumed run starts at this step.
    pub steps_done: u64,
    /// When it was completed (seconds since the Unix epoch).
    pub created_unix_s: u64,
    /// The parallel layout that wrote it (any layout can resume it).
    pub layout: Layout,
    /// The model it belongs to.
    pub model: ModelInfo,
    /// The optimizer and its step count.
    pub optimizer: OptimizerInfo,
    /// Where the learning-rate schedule stands.
    pub lr_schedule: LrInfo,
    /// Where the data stands.
    pub data: DataPosition,
    /// The loss scaler's state.
    pub loss_scaler: ScalerInfo,
    /// The settings a resumed run must share, and those it may change.
    pub settings: Settings,
    /// Every file of the checkpoint, by stage.
    pub shards: Vec<ShardFile>,
}

/// The parallel layout that wrote a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Data-parallel replicas.
    pub data_parallel_size: usize,
    /// Pipeline ranks.
    pub pipeline_parallel_size: usize,
    /// Stages per rank.
    pub virtual_stages: usize,
    /// Pipeline stages (one file set each).
    pub stages: usize,
    /// The pipeline schedule.
    pub schedule: String,
}

/// The model a checkpoint belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// The model file of the run (for `pipetrain export --checkpoint`); empty for a
    /// built-in model.
    pub path: PathBuf,
    /// The built-in model of the run, which `export --checkpoint` builds again.
    #[serde(default)]
    pub spec: Option<crate::models::ModelSpec>,
    /// SHA-256 of the graph's structure (see [`model_fingerprint`]).
    pub fingerprint: String,
    /// Trainable tensors.
    pub tensors: usize,
    /// Trainable values.
    pub parameters: u64,
}

/// The optimizer of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerInfo {
    /// Its configuration.
    pub config: OptimizerConfig,
    /// The state it keeps per parameter (`exp_avg`, ...); its step count (bias
    /// corrections use it; skipped updates do not count) is in each shard's metadata.
    pub state: Vec<String>,
}

/// Where the learning-rate schedule stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrInfo {
    /// The schedule.
    pub config: LrSchedule,
    /// The next step's index in it.
    pub step: u64,
    /// The run's optimizer steps (the schedule's length).
    pub total_steps: u64,
    /// The learning rate of the next step.
    pub next_lr: f64,
}

/// Where the data stands: what the next step reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataPosition {
    /// The next optimizer step.
    pub next_step: u64,
    /// Samples per step, all replicas.
    pub global_batch: usize,
    /// Samples consumed so far.
    pub sample_offset: u64,
    /// The batch-order array, when steps follow one.
    pub batch_order: Option<String>,
    /// The next step's row of the batch order.
    pub batch_order_row: Option<u64>,
    /// Passes over the data (or over the batch order) completed.
    pub epoch: u64,
    /// The shuffle seed (none: pipetrain's data is not shuffled beyond the batch order).
    pub shuffle_seed: Option<u64>,
}

/// The loss scaler's mode and state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerInfo {
    /// `static` or `dynamic`.
    pub mode: String,
    /// Scale and stable-step counter.
    pub state: ScalerState,
}

/// Settings recorded at save time.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// What must not change on resume, by name.
    pub fixed: BTreeMap<String, serde_json::Value>,
    /// SHA-256 of `fixed`.
    pub fingerprint: String,
    /// What may change (a changed one is reported), by name.
    pub recorded: BTreeMap<String, serde_json::Value>,
}

impl Settings {
    /// Settings with the fingerprint of `fixed` filled in.
    pub fn new(
        fixed: BTreeMap<String, serde_json::Value>,
        recorded: BTreeMap<String, serde_json::Value>,
    ) -> Settings {
        let text = serde_json::to_string(&fixed).unwrap_or_default();
        Settings {
            fingerprint: hex(&Sha256::digest(text.as_bytes())),
            fixed,
            recorded,
        }
    }
}

impl Manifest {
    /// Reads and checks the manifest of the checkpoint in `dir`.
    ///
    /// # Errors
    /// `Checkpoint` naming the manifest when it is missing (an incomplete checkpoint),
    /// not JSON, of another format, or of a format version this build does not know.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let bad = |reason: String| Error::Checkpoint {
            path: path.clone(),
            reason,
        };
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bad(
                    "missing: the checkpoint is incomplete (its manifest is written last)".into(),
                ))
            }
            Err(e) => return Err(Error::io(&path)(e)),
        };
        #[derive(Deserialize)]
        struct Head {
            format: Option<String>,
            format_version: Option<u32>,
        }
        let head: Head = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("not a checkpoint manifest: {e}")))?;
        if head.format.as_deref() != Some(FORMAT) {
            return Err(bad(format!(
                "field `format`: expected \"{FORMAT}\", got {:?}",
                head.format
            )));
        }
        match head.format_version {
            Some(FORMAT_VERSION) => {}
            other => {
                return Err(bad(format!(
                    "field `format_version`: this build reads version {FORMAT_VERSION}, the checkpoint has {}",
                    other.map_or("none".into(), |v| v.to_string())
                )))
            }
        }
        serde_json::from_slice(&text).map_err(|e| bad(format!("malformed manifest: {e}")))
    }

    /// Writes the manifest into `dir` and syncs it.
    ///
    /// # Errors
    /// `Io` naming the file.
    pub fn write_synced(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST);
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::Checkpoint {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        crate::checkpoint::shard::write_synced(dir, MANIFEST, 0, &text, None)?;
        Ok(())
    }
}

/// SHA-256 of a model's structure: its nodes, inputs, outputs and the names, shapes and
/// types of its initializers (not their values, which training changes).
pub fn model_fingerprint(model: &ModelProto) -> String {
    let mut h = Sha256::new();
    for o in &model.opset_import {
        h.update(o.domain.as_bytes());
        h.update(o.version.to_le_bytes());
    }
    if let Some(g) = &model.graph {
        for n in &g.node {
            h.update(n.encode_to_vec());
        }
        for v in g.input.iter().chain(&g.output) {
            h.update(v.encode_to_vec());
        }
        for t in &g.initializer {
            h.update(t.name.as_bytes());
            h.update(t.data_type.to_le_bytes());
            for d in &t.dims {
                h.update(d.to_le_bytes());
            }
        }
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Seconds since the Unix epoch.
pub fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
