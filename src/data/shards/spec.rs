//! The `[data.shards]` configuration table.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[data.shards]`: training data as ONNX Runtime's TrainingRunner reads it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    /// The folder of `.pb` shards (ORT's `train_data_dir`).
    pub train_data_dir: PathBuf,
    /// The evaluation shards (ORT's `test_data_dir`); default: the training shards.
    #[serde(default)]
    pub test_data_dir: Option<PathBuf>,
    /// Feature name in the files -> model input (or label) name. Empty: every feature
    /// feeds the input of its own name. Otherwise only the features named here are fed,
    /// as in ORT.
    #[serde(default)]
    pub input_name_map: BTreeMap<String, String>,
    /// Shuffle the sample order, differently each epoch, from this seed; default: the
    /// files' order.
    #[serde(default)]
    pub shuffle_seed: Option<u64>,
    /// How the data-parallel replicas share the data; default `samples`.
    #[serde(default)]
    pub split: ShardSplit,
}

/// How the data-parallel replicas share a shard folder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardSplit {
    /// Every step's global batch is the next samples of one order over all files, cut by
    /// rows among the replicas. The samples a step reads do not depend on the layout, so
    /// a checkpoint resumes at any (data, pipeline) layout.
    #[default]
    Samples,
    /// ONNX Runtime's way: replica `r` of `D` owns the files `i` with `i % D == r` and
    /// reads only them: its files in a seeded order each epoch, each file's samples
    /// shuffled within it (with `shuffle_seed`), one file after another, so that a node
    /// reads only its replicas' files and streams through them. A checkpoint resumes
    /// only at the same `data_parallel_size`.
    Files,
}
