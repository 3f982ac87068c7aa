//! ZeRO stages 1 and 2 (`deepspeed_zero_stage`, as ONNX Runtime's TrainingRunner's
//! `deepspeed_zero` and Megatron-LM's distributed optimizer): a stage's optimizer state,
//! and at stage 2 its gradients, sharded across its data-parallel replicas.
//!
//! Each replica's optimizer holds the state of one part of the stage only, a run of whole
//! tensors ([`ParamLayout::partition`]), so per-tensor updates (LAMB's trust ratio) and
//! parameter groups work as they do on the whole. Each replica takes its part's gradient
//! statistics (the coordinator adds them up, `partial_stats`) and updates its part, and
//! the parameters are then all-gathered (the stage actor's optimizer step,
//! [`pipetrain_actors::Collective::all_gather`]). An element's update reads only that
//! element, its gradient and the step's scalars; the optimizer's memory falls as
//! 1 / replicas.
//!
//! - **Stage 1**: every replica keeps the whole gradient buffer. After the backward the
//!   gradients are reduce-scattered ([`pipetrain_actors::Collective::reduce_scatter`]:
//!   each replica gets the sum of its part, the bits the all-reduce would give), so a
//!   sharded run trains the same bits as an unsharded one (with clipping, the norm adds
//!   its parts in another order). Gradient buckets are off: the reduction waits for the
//!   backward.
//! - **Stage 2**: every micro-batch's backward runs as the chain of gradient buckets
//!   (`pipeline::buckets`); each piece writes its gradients into a bucket, which is
//!   reduce-scattered while the next pieces run ([`ZeroPart::bucket_parts`]), and each
//!   replica adds the sum of its own part into its gradients (`pipeline::zero_grads`).
//!   A replica's gradient buffer keeps the stage's length, so every offset stays the
//!   layout's, but only its own part is ever written: the kernel never backs the rest with
//!   memory (a fresh zeroed allocation is mapped lazily), and the gradients' memory falls
//!   as 1 / replicas too, less the buckets in flight. The replicas are summed per
//!   micro-batch, so the sum's order differs from stage 1's: float32 rounding.
//!
//! A checkpoint keeps whole tensors by name, as always: data-parallel rank 0 saves the
//! parameters and its part of the optimizer state, every other rank its own part in its
//! own file, so any layout, sharded or not, loads it.

use std::ops::Range;

use crate::optim::ParamLayout;

/// This replica's place among the data-parallel replicas sharing a stage's optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroSlot {
    /// This replica's data-parallel rank.
    pub rank: usize,
    /// The data-parallel replicas.
    pub ranks: usize,
    /// Whether the gradients are sharded too (ZeRO stage 2).
    pub gradients: bool,
}

/// A stage's parameters cut among its data-parallel replicas' optimizers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZeroPart {
    /// This replica's rank.
    pub rank: usize,
    /// Whether it keeps its part of the gradients only (ZeRO stage 2).
    pub gradients: bool,
    /// Every rank's tensors (layout indices), in rank order.
    tensors: Vec<Range<usize>>,
    /// Every rank's values in the flat buffers, in rank order.
    values: Vec<Range<usize>>,
}

impl ZeroPart {
    /// The parts of `layout` for `slot`'s replicas.
    pub fn new(layout: &ParamLayout, slot: ZeroSlot) -> ZeroPart {
        let tensors = layout.partition(slot.ranks);
        let values = tensors
            .iter()
            .map(|t| layout.values_of(t.clone()))
            .collect();
        ZeroPart {
            rank: slot.rank,
            gradients: slot.gradients,
            tensors,
            values,
        }
    }

    /// The tensors this replica updates.
    pub fn own_tensors(&self) -> Range<usize> {
        self.tensors[self.rank].clone()
    }

    /// The values this replica updates.
    pub fn own_values(&self) -> Range<usize> {
        self.values[self.rank].clone()
    }

    /// Every rank's values, in rank order (what the all-gather moves).
    pub fn values(&self) -> &[Range<usize>] {
        &self.values
    }

    /// The rank owning tensor `i`.
    fn owner(&self, i: usize) -> usize {
        (self.tensors.iter())
            .position(|t| t.contains(&i))
            .unwrap_or(self.tensors.len().saturating_sub(1))
    }

    /// Each rank's part (in rank order) of a bucket holding tensors `params` one after
    /// another, `params` in layout order (so each rank's tensors are one run of the
    /// bucket; a rank owning none of them gets an empty part at its place).
    pub fn bucket_parts(&self, layout: &ParamLayout, params: &[usize]) -> Vec<Range<usize>> {
        let mut parts = Vec::with_capacity(self.tensors.len());
        let mut at = 0;
        let mut next = params.iter().peekable();
        for rank in 0..self.tensors.len() {
            let start = at;
            while let Some(&&i) = next.peek() {
                if self.owner(i) != rank {
                    break;
                }
                at += layout.shapes()[i].iter().product::<usize>();
                next.next();
            }
            parts.push(start..at);
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_cover_the_stage_once_in_rank_order() {
        let layout = ParamLayout::new((0..7).map(|i| (format!("t{i}"), vec![i + 1, 3])));
        let parts: Vec<ZeroPart> = (0..3)
            .map(|rank| {
                ZeroPart::new(
                    &layout,
                    ZeroSlot {
                        rank,
                        ranks: 3,
                        gradients: false,
                    },
                )
            })
            .collect();
        let mut at = 0;
        for (rank, p) in parts.iter().enumerate() {
            assert_eq!(
                p.values(),
                parts[0].values(),
                "every rank agrees on the cut"
            );
            assert_eq!(
                p.own_values().start,
                at,
                "rank {rank} starts where the last ended"
            );
            assert_eq!(p.own_values(), layout.values_of(p.own_tensors()));
            at = p.own_values().end;
        }
        assert_eq!(at, layout.len());
    }

    #[test]
    fn a_buckets_parts_are_each_ranks_tensors_in_it() {
        let layout = ParamLayout::new((0..6).map(|i| (format!("t{i}"), vec![2])));
        let slot = ZeroSlot {
            rank: 1,
            ranks: 2,
            gradients: true,
        };
        let part = ZeroPart::new(&layout, slot);
        let (first, second) = (part.tensors[0].clone(), part.tensors[1].clone());
        assert_eq!((first.end, second.start), (3, 3), "{:?}", part.tensors);
        // Tensors 1 and 2 are rank 0's, 4 rank 1's: 4 values, then 2.
        assert_eq!(part.bucket_parts(&layout, &[1, 2, 4]), vec![0..4, 4..6]);
        // A bucket of rank 1's tensors only: rank 0's part is empty, at the start.
        assert_eq!(part.bucket_parts(&layout, &[3, 5]), vec![0..0, 0..4]);
        assert_eq!(part.bucket_parts(&layout, &[0]), vec![0..2, 2..2]);
    }
}
