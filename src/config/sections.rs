//! The sections of a training configuration: data, pipeline, runtime.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::one;
use crate::data::{ShardSpec, SynthSpec};
use crate::graph::Partition;

/// Where batches come from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// An `.npz` archive (or `synth`).
    #[serde(default)]
    pub path: PathBuf,
    /// A synthetic data set made by pipetrain (`kind = "language" | "images" |
    /// "teacher"`) instead of a file.
    #[serde(default)]
    pub synth: Option<SynthSpec>,
    /// An integer array `[steps, global batch]` of row indices: optimizer step `s` uses
    /// rows `batch_order[s]`. Without it, steps take consecutive rows.
    #[serde(default)]
    pub batch_order: Option<String>,
    /// How the arrays feed the model (not used with `shards`).
    #[serde(default)]
    pub layout: DataLayout,
    /// ONNX Runtime `.pb` shard folders instead of a file (`[data.shards]`).
    #[serde(default)]
    pub shards: Option<ShardSpec>,
    /// Check the values before they train (finite floats, labels within the classes,
    /// token ids within their table): a file at the start, shards batch by batch.
    #[serde(default = "checked")]
    pub check: bool,
}

fn checked() -> bool {
    true
}

/// How arrays of the data file become model inputs. The default, no feeds, stands for
/// "not given": data fed by a service, or `shards`; [`crate::data::Batches::open`] refuses
/// it for a file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DataLayout {
    /// Each model input (and the label) is the array of the given name.
    Arrays {
        /// Model input or label name -> array name.
        feeds: BTreeMap<String, String>,
    },
    /// Language modelling: `array` rows of `T + 1` tokens give the input `row[..T]` and
    /// the label `row[1..]`.
    NextToken {
        /// The token array.
        array: String,
        /// The model's token input.
        input: String,
        /// The label name (as in the loss).
        label: String,
    },
}

impl Default for DataLayout {
    fn default() -> DataLayout {
        DataLayout::Arrays {
            feeds: BTreeMap::new(),
        }
    }
}

impl DataLayout {
    /// Whether this is the default (no feeds): the layout was not given.
    pub fn is_unset(&self) -> bool {
        matches!(self, DataLayout::Arrays { feeds } if feeds.is_empty())
    }
}

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (PipeDream-flush).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` stages per rank.
    #[serde(rename = "interleaved_1f1b")]
    Interleaved1f1b,
    /// Zero-bubble ZB-H1: backward split into input and weight gradients.
    ZbH1,
    /// Zero-bubble ZB-V: two stages per rank folded into a V (rank `r` holds stages `r`
    /// and `2p - 1 - r`), backward split as ZB-H1's.
    ZbV,
}

/// Pipeline schedule and partition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// The schedule.
    #[serde(default)]
    pub schedule: ScheduleKind,
    /// Stages per rank (interleaved schedules).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// How to cut the model; default: balanced by FLOPs.
    #[serde(default)]
    pub partition: Option<Partition>,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: ScheduleKind::default(),
            virtual_stages: 1,
            partition: None,
        }
    }
}

/// ONNX Runtime settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Threads per operator; default: the machine's cores shared among the stage actors.
    #[serde(default)]
    pub intra_op_threads: Option<usize>,
    /// Switch off ONNX Runtime's graph optimizations.
    #[serde(default)]
    pub disable_optimizations: bool,
    /// Keep backward graphs to standard ONNX ops (no `com.microsoft.FusedMatMul`).
    #[serde(default)]
    pub standard_ops_only: bool,
    /// Where to compute: `"cpu"` (default), `"cuda"` or `"cuda:N"`.
    #[serde(default)]
    pub device: crate::compute::Device,
    /// Record ONNX Runtime's per-operator profile of every session: a JSON file per
    /// session in the working folder (`pipetrain_<session>_<time>.json`, ONNX Runtime's
    /// `enable_profiling`), written when the run ends.
    #[serde(default)]
    pub profile: bool,
}
