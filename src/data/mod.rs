//! Data and weight files: NumPy arrays and archives, safetensors; synthetic data sets.

mod batches;
mod npy;
mod npz_write;
pub mod synth;
mod weights;

pub use batches::Batches;
pub use npy::{parse_npy, read_npz};
pub use npz_write::write_npz;
pub use synth::{generate, SynthSpec};
pub use weights::read_safetensors;
