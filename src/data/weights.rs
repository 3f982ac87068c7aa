//! Weights in safetensors files.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// Reads every tensor of a safetensors file (f32, f64, i64, i32, bool), by name.
///
/// # Errors
/// `Io` when the file cannot be read; `Data` naming the tensor for a malformed file or an
/// unsupported element type.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    let bad = |what: &str, reason: String| Error::Data {
        path: path.to_path_buf(),
        what: what.into(),
        reason,
    };
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad("file", format!("not a safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        fn le<T, const N: usize>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            b.chunks_exact(N)
                .map(|c| f(c.try_into().expect("N bytes")))
                .collect()
        }
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(le(raw, f32::from_le_bytes)),
            Dtype::F64 => TensorData::F64(le(raw, f64::from_le_bytes)),
            Dtype::I64 => TensorData::I64(le(raw, i64::from_le_bytes)),
            Dtype::I32 => TensorData::I32(le(raw, i32::from_le_bytes)),
            Dtype::BOOL => TensorData::Bool(raw.iter().map(|&b| b != 0).collect()),
            other => return Err(bad(&name, format!("unsupported element type {other:?}"))),
        };
        let t = Tensor::new(view.shape().to_vec(), data).map_err(|e| bad(&name, e.to_string()))?;
        out.insert(name, t);
    }
    Ok(out)
}
