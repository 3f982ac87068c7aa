//! Global ranks and their (data, pipeline, tensor) coordinates.
//!
//! ONNX Runtime's distributed training asks only that data x horizontal x pipeline
//! parallel sizes multiply to the world size; it fixes no numbering. pipetrain's is
//! `rank = (dp * pipeline_parallel + pp) * tensor_parallel + tp`: tensor index fastest,
//! then the pipeline stage, then the replica (Megatron-LM's order). Assigned to nodes in
//! order, a stage's tensor shards fill a node before spanning nodes (they all-reduce
//! activations several times per micro-batch), one replica's stages come next, on one
//! node or neighbouring ones (activations and gradients cross between stages every
//! micro-batch), and replicas exchange gradients once per optimizer step.

use serde::{Deserialize, Serialize};

/// The `[layout]` table: how many replicas, pipeline stages and tensor shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Data-parallel replicas (ONNX Runtime's `data_parallel_size`).
    pub data_parallel: usize,
    /// Pipeline stages of one replica (`pipeline_parallel_size`).
    pub pipeline_parallel: usize,
    /// Tensor shards (`horizontal_parallel_size`).
    #[serde(default = "one")]
    pub tensor_parallel: usize,
}

fn one() -> usize {
    1
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            data_parallel: 1,
            pipeline_parallel: 1,
            tensor_parallel: 1,
        }
    }
}

/// Where one global rank sits in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
pub struct RankCoords {
    /// The global rank, `0..world_size`.
    pub rank: usize,
    /// The data-parallel replica.
    pub dp: usize,
    /// The pipeline stage (rank within the replica's pipeline).
    pub pp: usize,
    /// The tensor shard.
    pub tp: usize,
}

impl Layout {
    /// `data_parallel x pipeline_parallel x tensor_parallel`, or `None` on overflow.
    pub fn checked_world_size(&self) -> Option<usize> {
        self.data_parallel
            .checked_mul(self.pipeline_parallel)?
            .checked_mul(self.tensor_parallel)
    }

    /// `data_parallel x pipeline_parallel x tensor_parallel` (saturating; a validated
    /// manifest's layout never overflows).
    pub fn world_size(&self) -> usize {
        self.checked_world_size().unwrap_or(usize::MAX)
    }

    /// The coordinates of `rank`, or `None` when it is not below the world size.
    pub fn coords(&self, rank: usize) -> Option<RankCoords> {
        if rank >= self.checked_world_size()? {
            return None;
        }
        let tp = rank % self.tensor_parallel;
        let rest = rank / self.tensor_parallel;
        Some(RankCoords {
            rank,
            dp: rest / self.pipeline_parallel,
            pp: rest % self.pipeline_parallel,
            tp,
        })
    }

    /// The global rank at `(dp, pp, tp)`, or `None` when a coordinate is out of range.
    pub fn rank(&self, dp: usize, pp: usize, tp: usize) -> Option<usize> {
        if dp >= self.data_parallel || pp >= self.pipeline_parallel || tp >= self.tensor_parallel {
            return None;
        }
        dp.checked_mul(self.pipeline_parallel)?
            .checked_add(pp)?
            .checked_mul(self.tensor_parallel)?
            .checked_add(tp)
    }

    /// Every rank's coordinates, in rank order.
    pub fn all(&self) -> impl Iterator<Item = RankCoords> + '_ {
        (0..self.checked_world_size().unwrap_or(0)).filter_map(|r| self.coords(r))
    }
}
