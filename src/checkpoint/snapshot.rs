//! A stage's state encoded in memory for a checkpoint: safetensors bytes in pooled,
//! block-aligned buffers, with their CRC-32, ready for [`super::shard::write_shard`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::{Error, Result};

/// A float32 tensor to encode: name, shape, values.
pub type F32Entry<'a> = (String, &'a [usize], &'a [f32]);

/// The unit of direct (page-cache-bypassing) writes: buffers start on it and writes
/// cover whole units. 4096 satisfies every Linux block device's logical block size.
pub(super) const BLOCK: usize = 4096;

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

    /// The file's length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The CRC-32 of the file's content.
    pub(super) fn crc32(&self) -> u32 {
        self.crc32
    }

    /// The content and its zero padding: whole blocks.
    pub(super) fn blocks(&self) -> &[u8] {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::shard::{copy_f32, split_state_key, state_key};
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
}
