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
}
