//! Host buffers for the values stage actions copy out of ONNX Runtime, recycled from one
//! micro-batch to the next instead of allocated anew.
//!
//! A stage action copies its outputs into fresh host tensors (the activations it sends,
//! the values its backward reads), and they are freed a few actions later. glibc serves
//! blocks of 128 KiB and more from `mmap` (or trims them from its heaps) and hands them
//! back on `free`, so each micro-batch faulted its megabytes in again, a page fault per
//! 4 KiB. Measured on the peers' tiny GPT in four V-Min stages on 2 cores: a forward of
//! 1.3 ms in ONNX Runtime spent 2.5 ms more copying its 5 MB of outputs out. Raising
//! glibc's thresholds for the whole process did as well for that run, but cost GPT-2
//! small 16% more peak memory; a pool of the stages' own buffers keeps only what the
//! stages made and freed.
//!
//! The pool keeps only buffers of lengths it handed out, no more of each than are out:
//! a stage also frees tensors the pool never made (a launched job's activations and
//! gradients decoded from the wire), and kept whole, those filled the pool to its bound
//! in a pipeline across nodes, 38-85 KB a step, never taken again.
//!
//! Written here, not taken from a crate: the pools on crates.io hand out objects of one
//! type or fixed sizes; these are float vectors of the lengths a stage's outputs have,
//! shared by the stages of a process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Value;
use crate::tensor::{Tensor, TensorData};

/// Float32 buffers by length, shared by a process's stages (a handle: clones share it).
#[derive(Debug, Clone, Default)]
pub struct HostPool(Arc<Mutex<Shelves>>);

#[derive(Debug, Default)]
struct Shelves {
    by_len: HashMap<usize, Vec<Vec<f32>>>,
    /// Buffers handed out of each length and not yet back.
    out: HashMap<usize, usize>,
    bytes: usize,
    most: usize,
}

impl HostPool {
    /// A pool holding at most `most_bytes` of buffers waiting for reuse.
    pub fn new(most_bytes: usize) -> HostPool {
        HostPool(Arc::new(Mutex::new(Shelves {
            most: most_bytes,
            ..Shelves::default()
        })))
    }

    /// `values` in a buffer of the pool's, or a new one.
    pub fn copy_of(&self, values: &[f32]) -> Vec<f32> {
        let kept = self.0.lock().ok().and_then(|mut s| {
            *s.out.entry(values.len()).or_default() += 1;
            s.take(values.len())
        });
        match kept {
            Some(mut v) => {
                v.copy_from_slice(values);
                v
            }
            None => values.to_vec(),
        }
    }

    /// Takes back the float32 host tensors of `values` nothing else holds.
    pub fn recycle(&self, values: impl IntoIterator<Item = Arc<Value>>) {
        let Ok(mut shelves) = self.0.lock() else {
            return;
        };
        for t in values {
            if let Ok(Value::Host(Tensor {
                data: TensorData::F32(v),
                ..
            })) = Arc::try_unwrap(t)
            {
                shelves.put(v);
            }
        }
    }

    /// Bytes waiting for reuse.
    pub fn bytes(&self) -> usize {
        self.0.lock().map_or(0, |s| s.bytes)
    }
}

impl Shelves {
    fn take(&mut self, len: usize) -> Option<Vec<f32>> {
        let v = self.by_len.get_mut(&len)?.pop()?;
        self.bytes -= 4 * len;
        Some(v)
    }

    fn put(&mut self, v: Vec<f32>) {
        let bytes = 4 * v.len();
        // A length never handed out, or none of it out: not one the stages take again.
        match self.out.get_mut(&v.len()) {
            Some(out) if *out > 0 => *out -= 1,
            _ => return,
        }
        if v.is_empty() || self.bytes + bytes > self.most {
            return;
        }
        self.bytes += bytes;
        self.by_len.entry(v.len()).or_default().push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_is_reused_for_the_same_length_and_the_pool_stays_bounded() {
        let pool = HostPool::new(64);
        let a = pool.copy_of(&[1.0; 8]);
        let at = a.as_ptr();
        let t: Arc<Value> = Arc::new(Tensor::f32(vec![8], a).unwrap().into());
        let held = t.clone();
        pool.recycle([t]);
        assert_eq!(
            pool.bytes(),
            0,
            "a tensor still held elsewhere is not taken"
        );
        pool.recycle([held]);
        assert_eq!(pool.bytes(), 32);
        let b = pool.copy_of(&[2.0; 8]);
        assert_eq!((b.as_ptr(), b[7], pool.bytes()), (at, 2.0, 0));
        // More than the bound is let go.
        let big = Arc::new(
            Tensor::f32(vec![32], pool.copy_of(&[0.0; 32]))
                .unwrap()
                .into(),
        );
        pool.recycle([big]);
        assert_eq!(pool.bytes(), 0);
    }

    #[test]
    fn a_buffer_the_pool_did_not_hand_out_is_kept_only_in_place_of_one_that_went_elsewhere() {
        let pool = HostPool::new(1 << 20);
        let foreign = |n: usize| Arc::new(Tensor::f32(vec![n], vec![0.0; n]).unwrap().into());
        // Of a length never handed out: let go.
        pool.recycle([foreign(8)]);
        assert_eq!(pool.bytes(), 0);
        // A stage that sends what it makes elsewhere (it never comes back) and frees what
        // arrives from elsewhere, a thousand times: the pool holds what is out, no more.
        for _ in 0..1000 {
            let sent = pool.copy_of(&[1.0; 8]);
            drop(sent);
            pool.recycle([foreign(8), foreign(8)]);
        }
        assert_eq!(pool.bytes(), 4 * 8, "one buffer, in place of the one out");
    }
}
