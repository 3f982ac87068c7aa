//! ZeRO stage 1 (`deepspeed_zero_stage = 1`, as ONNX Runtime's TrainingRunner's
//! `deepspeed_zero` and Megatron-LM's distributed optimizer): a stage's optimizer state
//! sharded across its data-parallel replicas.
//!
//! Every replica keeps the whole parameters and gradient buffers. Each replica's
//! optimizer holds the state of one part of the stage only, a run of whole tensors
//! ([`ParamLayout::partition`]), so per-tensor updates (LAMB's trust ratio) and parameter
//! groups work as they do on the whole. After the backward the gradients are
//! reduce-scattered ([`pipetrain_actors::Collective::reduce_scatter`]: each replica gets
//! the sum of its part, the bits the all-reduce would give), each replica takes its
//! part's gradient statistics (the coordinator adds them up, `partial_stats`) and updates
//! its part, and the parameters are then all-gathered (the stage actor's optimizer step,
//! [`pipetrain_actors::Collective::all_gather`]): the bytes of one all-reduce, as
//! without sharding. An element's update reads only that element, its gradient and the
//! step's scalars, so a sharded run trains the same bits as an unsharded one (with
//! clipping, the norm adds its parts in another order); the optimizer's memory falls as
//! 1 / replicas. Gradient buckets are off: the reduction waits for the backward.
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
}

/// A stage's parameters cut among its data-parallel replicas' optimizers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZeroPart {
    /// This replica's rank.
    pub rank: usize,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_cover_the_stage_once_in_rank_order() {
        let layout = ParamLayout::new((0..7).map(|i| (format!("t{i}"), vec![i + 1, 3])));
        let parts: Vec<ZeroPart> = (0..3)
            .map(|rank| ZeroPart::new(&layout, ZeroSlot { rank, ranks: 3 }))
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
}
