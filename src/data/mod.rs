//! Data and weight files: NumPy arrays and archives, safetensors; synthetic data sets;
//! ONNX Runtime's `.pb` training shards; where step batches come from (a file, a shard
//! folder, or an embedding service).

use std::path::Path;

use crate::{Error, Result};

mod batches;
mod check;
mod npy;
#[cfg(feature = "cli")]
mod npz_write;
pub mod shards;
mod source;
mod spec;
pub mod synth;
mod weights;

pub use batches::Batches;
pub use check::{first_bad_value, CheckedBatches, FeedRule, IndexRule};
pub use npy::{parse_npy, read_npz};
#[cfg(feature = "cli")]
pub use npz_write::write_npz;
pub use shards::{ShardDataset, ShardSpec, ShardSplit};
pub use source::{split_rows, BatchSource, ChannelBatches, FedBatches, StepBatches};
pub use spec::{DataConfig, DataLayout};
pub use synth::{generate, SynthSpec};
pub use weights::read_safetensors;

/// The step batches of `data` for global batches of `global_batch` samples shared by
/// `replicas` data-parallel replicas, with what [`Batches::order_len`] and
/// [`Batches::rows`] say of them: a [`ShardDataset`] over `data.shards.train_data_dir`
/// when `[data.shards]` is set (no batch order; rows = its samples), else
/// [`Batches::open`]. Paths are used as given: [`crate::config::TrainConfig::load`] has
/// already resolved relative ones against the configuration's folder.
///
/// # Errors
/// As [`Batches::open`] or [`ShardDataset::open_spec`]; a shard data set's batch size or
/// split error becomes a `Config` error on `batch_size` or `data.shards.split` of
/// `config_path`.
pub fn open_step_batches(
    data: &DataConfig,
    global_batch: usize,
    replicas: usize,
    config_path: &Path,
) -> Result<(Box<dyn StepBatches>, Option<usize>, usize)> {
    match &data.shards {
        Some(spec) => {
            let set = ShardDataset::open_spec(spec, global_batch, replicas).map_err(|e| match e {
                Error::Data { what, reason, .. } if what == "batch size" => Error::Config {
                    path: config_path.to_path_buf(),
                    field: "batch_size".into(),
                    rule: format!(
                        "batch_size x gradient_accumulation_steps x data_parallel_size: {reason} in {}",
                        spec.train_data_dir.display()
                    ),
                },
                Error::Data { what, reason, .. } if what == "split" => Error::Config {
                    path: config_path.to_path_buf(),
                    field: "data.shards.split".into(),
                    rule: format!("{reason} in {}", spec.train_data_dir.display()),
                },
                other => other,
            })?;
            let rows = set.samples();
            Ok((Box::new(set), None, rows))
        }
        None => {
            let b = Batches::open(data, global_batch, config_path)?;
            let (order_len, rows) = (b.order_len(), b.rows());
            Ok((Box::new(b), order_len, rows))
        }
    }
}
