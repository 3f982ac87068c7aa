//! One stage's files in a checkpoint: its parameters, and its optimizer state, each a
//! safetensors file keyed by the ONNX initializer names (optimizer state as
//! `<state>/<parameter>`, e.g. `exp_avg/fc1.weight`), so any reader of safetensors finds
//! the weights by the model's own names and any pipeline layout can take them back.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use super::snapshot::{ShardBytes, BLOCK};
use crate::{Error, Result};
use pipetrain_actors::ShardFile;

/// The parameters file of `stage`.
pub fn params_file(stage: usize) -> String {
    format!("stage-{stage:03}.params.safetensors")
}

/// The optimizer-state file of `stage`.
pub fn optimizer_file(stage: usize) -> String {
    format!("stage-{stage:03}.optimizer.safetensors")
}

/// The buffers file (running statistics) of `stage`.
pub fn buffers_file(stage: usize) -> String {
    format!("stage-{stage:03}.buffers.safetensors")
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

/// Writes a shard as `dir/file` and syncs it to disk; what the manifest records of it.
/// On Linux the write bypasses the page cache (`O_DIRECT`, from the block-aligned
/// buffer): the copy into the cache, and freeing those pages when the checkpoint is
/// deleted, would take CPU time from the training beside it. Where the file system
/// refuses direct writes (tmpfs), it is written as [`write_synced`] does.
///
/// # Errors
/// `Io` naming the file.
pub fn write_shard(
    dir: &Path,
    file: &str,
    stage: usize,
    shard: &ShardBytes,
    slow: Option<Duration>,
) -> Result<ShardFile> {
    #[cfg(target_os = "linux")]
    {
        let path = dir.join(file);
        match write_direct(&path, shard, slow) {
            Ok(()) => {
                return Ok(ShardFile {
                    stage,
                    file: file.to_string(),
                    bytes: shard.len() as u64,
                    crc32: shard.crc32(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {}
            Err(e) => return Err(Error::io(&path)(e)),
        }
    }
    write_synced(dir, file, stage, shard.bytes(), slow)
}

/// The direct write of [`write_shard`]: whole blocks in one write (the device gets few,
/// large requests), then the file cut to its length, then synced.
#[cfg(target_os = "linux")]
fn write_direct(path: &Path, shard: &ShardBytes, slow: Option<Duration>) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let blocks = shard.blocks();
    let piece = match slow {
        Some(_) => blocks.len().div_ceil(8).next_multiple_of(BLOCK),
        None => blocks.len(),
    };
    for chunk in blocks.chunks(piece.max(BLOCK)) {
        f.write_all(chunk)?;
        if let Some(pause) = slow {
            std::thread::sleep(pause);
        }
    }
    f.set_len(shard.len() as u64)?;
    f.sync_all()
}

/// Writes `bytes` as `dir/file` through the page cache and syncs it to disk; what the
/// manifest records of it. `slow` spreads the write over 8 pieces with a pause between
/// them: a test aid that widens the window in which a crash lands mid-write.
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
    use super::super::snapshot::{encode, SnapshotBuffers};
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn shards_are_written_whole_with_their_crc() {
        let dir = std::env::temp_dir().join(format!("pt-shard-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = SnapshotBuffers::default();
        for n in [1usize, 1023, 1024, 300_000] {
            let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let shape = [n];
            let shard = encode(&[("v".into(), &shape, &v)], HashMap::new(), &dir, &pool).unwrap();
            for slow in [None, Some(Duration::from_millis(1))] {
                let f = write_shard(&dir, "s.safetensors", 1, &shard, slow).unwrap();
                let on_disk = std::fs::read(dir.join("s.safetensors")).unwrap();
                assert_eq!(on_disk, shard.bytes(), "{n} values");
                assert_eq!((f.stage, f.bytes), (1, on_disk.len() as u64));
                assert_eq!(f.crc32, crc32fast::hash(&on_disk));
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
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
