//! How one parameter is split across tensor shards, and the slicing and placing that
//! follow from it.
//!
//! A split axis may hold several equal sections (a fused QKV weight's columns are the
//! query, key and value sections); each shard takes its chunk of every section, so that
//! its query, key and value columns belong to the same heads (Megatron-LM's layout).

use serde::{Deserialize, Serialize};

/// How a parameter is split: along `axis`, each of `sections` equal sections cut into
/// `shards` equal chunks, chunk `k` of every section going to shard `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSpec {
    /// The split axis.
    pub axis: usize,
    /// Equal sections along the axis.
    pub sections: usize,
    /// Tensor shards.
    pub shards: usize,
}

/// A shape as (outer elements, split dimension, inner elements) around `axis`.
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}

impl ShardSpec {
    /// Whether `full` (the whole parameter's shape) can be split this way.
    pub fn fits(&self, full: &[usize]) -> bool {
        self.axis < full.len() && full[self.axis] % (self.sections * self.shards) == 0
    }

    /// The shape of one shard of a parameter shaped `full`.
    pub fn shard_shape(&self, full: &[usize]) -> Vec<usize> {
        let mut s = full.to_vec();
        s[self.axis] /= self.shards;
        s
    }

    /// The runs of shard `rank` in a parameter shaped `full`, in the shard's order:
    /// `(offset in the full tensor, length)`.
    fn runs(&self, full: &[usize], rank: usize) -> impl Iterator<Item = (usize, usize)> {
        let (outer, dim, inner) = around(full, self.axis);
        let section = dim / self.sections;
        let chunk = section / self.shards;
        let sections = self.sections;
        (0..outer).flat_map(move |o| {
            (0..sections).map(move |s| {
                let start = (o * dim + s * section + rank * chunk) * inner;
                (start, chunk * inner)
            })
        })
    }

    /// Shard `rank`'s part of `full_values` (shaped `full`).
    pub fn slice(&self, full_values: &[f32], full: &[usize], rank: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(full_values.len() / self.shards);
        for (at, len) in self.runs(full, rank) {
            out.extend_from_slice(&full_values[at..at + len]);
        }
        out
    }

    /// Writes shard `rank`'s `part` into its place in `full_values` (shaped `full`).
    pub fn place(&self, part: &[f32], full: &[usize], rank: usize, full_values: &mut [f32]) {
        let mut from = 0;
        for (at, len) in self.runs(full, rank) {
            full_values[at..at + len].copy_from_slice(&part[from..from + len]);
            from += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_of_a_sectioned_axis_take_their_chunk_of_every_section() {
        // [2, 6]: columns are three sections of two; two shards.
        let full: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let spec = ShardSpec {
            axis: 1,
            sections: 3,
            shards: 2,
        };
        assert!(spec.fits(&[2, 6]));
        assert_eq!(spec.shard_shape(&[2, 6]), vec![2, 3]);
        assert_eq!(spec.slice(&full, &[2, 6], 0), vec![0., 2., 4., 6., 8., 10.]);
        assert_eq!(spec.slice(&full, &[2, 6], 1), vec![1., 3., 5., 7., 9., 11.]);
        let mut back = vec![0.0; 12];
        for r in 0..2 {
            spec.place(&spec.slice(&full, &[2, 6], r), &[2, 6], r, &mut back);
        }
        assert_eq!(back, full);
    }

    #[test]
    fn rows_split_into_contiguous_blocks() {
        let full: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let spec = ShardSpec {
            axis: 0,
            sections: 1,
            shards: 2,
        };
        assert_eq!(spec.slice(&full, &[4, 2], 1), vec![4., 5., 6., 7.]);
        assert!(!spec.fits(&[3, 2]));
    }
}
