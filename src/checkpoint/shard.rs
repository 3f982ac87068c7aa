//! One stage's files in a checkpoint: its parameters, and its optimizer state, each a
//! safetensors file keyed by the ONNX initializer names (optimizer state as
//! `<state>/<parameter>`, e.g. `exp_avg/fc1.weight`), so any reader of safetensors finds
//! the weights by the model's own names and any pipeline layout can take them back.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use pipetrain_actors::ShardFile;
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;

use crate::{Error, Result};

/// The parameters file of `stage`.
pub fn params_file(stage: usize) -> String {
    format!("stage-{stage:03}.params.safetensors")
}

/// The optimizer-state file of `stage`.
pub fn optimizer_file(stage: usize) -> String {
    format!("stage-{stage:03}.optimizer.safetensors")
}

/// The key of optimizer state `state` (`exp_avg`, ...) of parameter `param`.
pub fn state_key(state: &str, param: &str) -> String {
    format!("{state}/{param}")
}

/// Splits a state key into `(state, parameter)`: state names never hold a `/`, parameter
/// names may.
pub fn split_state_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('/')
}

/// A float32 tensor to encode: name, shape, values.
pub type F32Entry<'a> = (String, &'a [usize], &'a [f32]);

/// Encodes float32 tensors as safetensors bytes (one copy of the values), with
/// `metadata` in the header's `__metadata__`.
///
/// # Errors
/// `Data` (naming `what`) when safetensors refuses the tensors (a name twice).
pub fn encode(
    tensors: &[F32Entry<'_>],
    metadata: HashMap<String, String>,
    what: &Path,
) -> Result<Vec<u8>> {
    let bad = |reason: String| Error::Data {
        path: what.to_path_buf(),
        what: "checkpoint shard".into(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes: &[u8] = bytemuck::cast_slice(values);
            StView::new(Dtype::F32, shape.to_vec(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| bad(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(metadata)).map_err(|e| bad(e.to_string()))
}

/// Writes `bytes` as `dir/file` and syncs it to disk; what the manifest records of it.
/// `slow` spreads the write over 8 pieces with a pause between them: a test aid that
/// widens the window in which a crash lands mid-write.
///
/// # Errors
/// `Io` naming the file.
pub fn write_synced(
    dir: &Path,
    file: &str,
    stage: usize,
    bytes: &[u8],
    slow: Option<Duration>,
) -> Result<ShardFile> {
    let path = dir.join(file);
    let mut f = std::fs::File::create(&path).map_err(Error::io(&path))?;
    // The CRC of each piece is taken right after the piece is written, while it is still
    // in the cache: one pass over memory instead of two.
    let piece = match slow {
        Some(_) => bytes.len().div_ceil(8).max(1),
        None => 1 << 20,
    };
    let mut crc = crc32fast::Hasher::new();
    for chunk in bytes.chunks(piece) {
        f.write_all(chunk).map_err(Error::io(&path))?;
        crc.update(chunk);
        if let Some(pause) = slow {
            std::thread::sleep(pause);
        }
    }
    f.sync_all().map_err(Error::io(&path))?;
    Ok(ShardFile {
        stage,
        file: file.to_string(),
        bytes: bytes.len() as u64,
        crc32: crc.finalize(),
    })
}

/// Copies little-endian float32 bytes into `dst`: a plain memory copy when `src` is
/// aligned for `f32` (safetensors aligns its data; a `Vec<u8>` usually is), element by
/// element otherwise.
pub fn copy_f32(dst: &mut [f32], src: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(src) {
        Ok(values) if cfg!(target_endian = "little") => {
            let n = dst.len().min(values.len());
            dst[..n].copy_from_slice(&values[..n]);
        }
        _ => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_readable_safetensors() {
        let w = [1.0f32, -2.5, 3.25, 0.0, 5.0, 6.0];
        let b = [0.5f32];
        let shape_w = [2usize, 3];
        let shape_b = [1usize];
        let bytes = encode(
            &[
                ("fc.weight".into(), &shape_w, &w),
                (state_key("exp_avg", "fc.bias"), &shape_b, &b),
            ],
            HashMap::from([("kind".to_string(), "test".to_string())]),
            Path::new("x"),
        )
        .unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("fc.weight").unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        let mut back = [0f32; 6];
        copy_f32(&mut back, t.data());
        assert_eq!(back, w);
        assert!(st.tensor("exp_avg/fc.bias").is_ok());
        assert_eq!(split_state_key("exp_avg/a/b"), Some(("exp_avg", "a/b")));
    }

    #[test]
    fn written_files_report_length_and_crc() {
        let dir = std::env::temp_dir().join(format!("pt-shard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = vec![7u8; 1000];
        for slow in [None, Some(Duration::from_millis(1))] {
            let f = write_synced(&dir, "a.bin", 3, &data, slow).unwrap();
            assert_eq!((f.stage, f.bytes), (3, 1000));
            assert_eq!(f.crc32, crc32fast::hash(&data));
            assert_eq!(std::fs::read(dir.join("a.bin")).unwrap(), data);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
