//! Data and weight files: NumPy arrays and archives, safetensors; where step batches
//! come from (a file, or an embedding service).

mod batches;
mod npy;
mod source;
mod weights;

pub use batches::Batches;
pub use npy::{parse_npy, read_npz};
pub use source::{split_rows, BatchSource, ChannelBatches, FedBatches, StepBatches};
pub use weights::read_safetensors;
