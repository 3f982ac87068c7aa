//! Where a run's batches come from, as the training configuration's `[data]` (and
//! `[eval_data]`) table gives it: a file, a synthetic set or shards, and how their arrays
//! feed the model. Defined here, beside what reads it, so that `data` does not depend on
//! `config` (which re-exports these).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ShardSpec, SynthSpec};

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
