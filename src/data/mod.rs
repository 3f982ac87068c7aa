//! Data and weight files: NumPy arrays and archives, safetensors.

mod batches;
mod npy;
mod weights;

pub use batches::Batches;
pub use npy::{parse_npy, read_npz};
pub use weights::read_safetensors;
