//! Data and weight files: NumPy arrays and archives, safetensors; synthetic data sets;
//! where step batches come from (a file, or an embedding service).

mod batches;
mod npy;
mod npz_write;
mod source;
pub mod synth;
mod weights;

pub use batches::Batches;
pub use npy::{parse_npy, read_npz};
pub use npz_write::write_npz;
pub use source::{split_rows, BatchSource, ChannelBatches, FedBatches, StepBatches};
pub use synth::{generate, SynthSpec};
pub use weights::read_safetensors;
