//! One stage's files in a checkpoint: its parameters, and its optimizer state, each a
//! safetensors file keyed by the ONNX initializer names (optimizer state as
//! `<state>/<parameter>`, e.g. `exp_avg/fc1.weight`), so any reader of safetensors finds
//! the weights by the model's own names and any pipeline layout can take them back.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipetrain_actors::ShardFile;
use safetensors::tensor::{Metadata, TensorInfo};
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

/// The unit of direct (page-cache-bypassing) writes: buffers start on it and writes
/// cover whole units. 4096 satisfies every Linux block device's logical block size.
const BLOCK: usize = 4096;

/// Encoded shard buffers kept for the next checkpoint, so a snapshot copies into memory
/// that is already mapped instead of faulting in fresh pages every time.
#[derive(Clone, Default)]
pub struct SnapshotBuffers(Arc<Mutex<Vec<Vec<u8>>>>);

/// Buffers a pool keeps at most (two files per stage, two checkpoints in flight).
const POOL_BUFFERS: usize = 4;

impl SnapshotBuffers {
    /// A buffer of at least `bytes` usable bytes after its first [`BLOCK`] boundary.
    fn take(&self, bytes: usize) -> Vec<u8> {
        let need = bytes.next_multiple_of(BLOCK) + BLOCK;
        let mut pool = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match pool.iter().position(|b| b.len() >= need) {
            Some(i) => pool.swap_remove(i),
            None => huge_zeroed(need),
        }
    }

    fn give_back(&self, buf: Vec<u8>) {
        let mut pool = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < POOL_BUFFERS {
            pool.push(buf);
        }
    }
}

/// `len` zero bytes, in transparent huge pages where the kernel has them: a direct write
/// pins the pages it reads, and pinning 8 MiB as 4 KiB pages took more of the writer's
/// time than the write itself.
fn huge_zeroed(len: usize) -> Vec<u8> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_ptr().align_offset(HUGE);
        if start + HUGE <= len {
            let span = (len - start) / HUGE * HUGE;
            // SAFETY: the range lies inside `buf`'s allocation, not yet touched; the
            // advice changes only how the kernel backs it (an error is ignored).
            unsafe {
                libc::madvise(
                    buf.as_mut_ptr().add(start).cast(),
                    span,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    buf.resize(len, 0);
    buf
}

/// One shard file's bytes, at a [`BLOCK`]-aligned place in a pooled buffer and followed
/// by zeros up to a whole block, as direct writes need.
pub struct ShardBytes {
    buf: Vec<u8>,
    start: usize,
    len: usize,
    crc32: u32,
    pool: SnapshotBuffers,
}

/// Bytes copied before their CRC is taken: well inside a core's L2 cache.
const CRC_PIECE: usize = 64 << 10;

impl ShardBytes {
    /// The file's content.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The content and its zero padding: whole blocks.
    fn blocks(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len.next_multiple_of(BLOCK)]
    }
}

impl Drop for ShardBytes {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

/// Encodes float32 tensors as safetensors bytes (one copy of the values, into a buffer
/// of `pool`), with `metadata` in the header's `__metadata__`. The bytes are those of
/// `safetensors::serialize`: the header is the crate's own `Metadata` serialized, with
/// the tensors in name order; only the buffer differs.
///
/// # Errors
/// `Data` (naming `what`) when safetensors refuses the tensors (a name twice).
pub fn encode(
    tensors: &[F32Entry<'_>],
    metadata: HashMap<String, String>,
    what: &Path,
    pool: &SnapshotBuffers,
) -> Result<ShardBytes> {
    let bad = |reason: String| Error::Data {
        path: what.to_path_buf(),
        what: "checkpoint shard".into(),
        reason,
    };
    let mut order: Vec<&F32Entry<'_>> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = order.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("tensor `{}` twice", w[0].0)));
    }
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for (name, shape, values) in &order {
        if shape.iter().product::<usize>() != values.len() {
            return Err(bad(format!(
                "tensor `{name}`: shape {shape:?} but {} values",
                values.len()
            )));
        }
        let n = std::mem::size_of_val(*values);
        let info = TensorInfo {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data_offsets: (offset, offset + n),
        };
        infos.push((name.clone(), info));
        offset += n;
    }
    let header = Metadata::new(Some(metadata), infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_string(&header)
        .map_err(|e| bad(e.to_string()))?
        .into_bytes();
    // As the crate does: the header is padded with spaces to a multiple of 8 bytes.
    header.resize(header.len().next_multiple_of(8), b' ');
    let len = 8 + header.len() + offset;
    let mut buf = pool.take(len);
    let start = buf.as_ptr().align_offset(BLOCK);
    let out = &mut buf[start..start + len.next_multiple_of(BLOCK)];
    out[..8].copy_from_slice(&(header.len() as u64).to_le_bytes());
    out[8..8 + header.len()].copy_from_slice(&header);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[..8 + header.len()]);
    let mut at = 8 + header.len();
    for (_, _, values) in &order {
        // The CRC of each piece is taken right after it is copied, while it is still in
        // the cache: the writer thread then only waits for the disk, and takes no CPU
        // time from the training beside it.
        for piece in bytemuck::cast_slice::<f32, u8>(values).chunks(CRC_PIECE) {
            let dst = &mut out[at..at + piece.len()];
            dst.copy_from_slice(piece);
            crc.update(dst);
            at += piece.len();
        }
    }
    out[at..].fill(0);
    Ok(ShardBytes {
        buf,
        start,
        len,
        crc32: crc.finalize(),
        pool: pool.clone(),
    })
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
                    bytes: shard.len as u64,
                    crc32: shard.crc32,
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
    f.set_len(shard.len as u64)?;
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
    use super::*;
    use safetensors::tensor::TensorView as StView;

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
            &SnapshotBuffers::default(),
        )
        .unwrap();
        let st = safetensors::SafeTensors::deserialize(bytes.bytes()).unwrap();
        let t = st.tensor("fc.weight").unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        let mut back = [0f32; 6];
        copy_f32(&mut back, t.data());
        assert_eq!(back, w);
        assert!(st.tensor("exp_avg/fc.bias").is_ok());
        assert_eq!(split_state_key("exp_avg/a/b"), Some(("exp_avg", "a/b")));
    }

    #[test]
    fn encoding_gives_the_bytes_of_safetensors_serialize() {
        let a: Vec<f32> = (0..3000).map(|i| i as f32 * 0.5).collect();
        let b = [1.5f32, -2.0];
        let (sa, sb) = ([30usize, 100], [2usize]);
        let meta = HashMap::from([("pipetrain".to_string(), "{}".to_string())]);
        let pool = SnapshotBuffers::default();
        for round in 0..3 {
            // Names out of order; later rounds reuse the pooled buffer.
            let ours = encode(
                &[("z.w".into(), &sa, &a), ("a.b".into(), &sb, &b)],
                meta.clone(),
                Path::new("x"),
                &pool,
            )
            .unwrap();
            let views = [
                (
                    "z.w",
                    StView::new(Dtype::F32, sa.to_vec(), bytemuck::cast_slice(&a)).unwrap(),
                ),
                (
                    "a.b",
                    StView::new(Dtype::F32, sb.to_vec(), bytemuck::cast_slice(&b)).unwrap(),
                ),
            ];
            let theirs = safetensors::serialize(views, Some(meta.clone())).unwrap();
            assert_eq!(ours.bytes(), theirs.as_slice(), "round {round}");
            assert_eq!(ours.crc32, crc32fast::hash(&theirs));
            assert_eq!(ours.blocks().len() % BLOCK, 0);
            assert_eq!(ours.blocks().as_ptr() as usize % BLOCK, 0);
            assert!(ours.blocks()[ours.len..].iter().all(|&x| x == 0));
        }
        assert!(encode(
            &[("w".into(), &sa, &b)],
            meta.clone(),
            Path::new("x"),
            &pool
        )
        .is_err());
        let twice = [("w".into(), &sb[..], &b[..]), ("w".into(), &sb[..], &b[..])];
        let err = encode(&twice, meta, Path::new("x"), &pool).err().unwrap();
        assert!(err.to_string().contains("`w` twice"), "{err}");
    }

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
