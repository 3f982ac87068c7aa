//! A stage that is one tensor shard of its data-parallel replica (see
//! [`crate::graph::tensor_parallel`]): which of its parameters are split, and what that
//! changes in its gradient statistics, checkpoints and exported parameters.

use std::collections::BTreeMap;
use std::sync::Arc;

use pipetrain_actors::GradStats;

use crate::checkpoint::SavedShard;
use crate::graph::tensor_parallel::ShardSpec;
use crate::graph::TrainingGraph;
use crate::optim::ParamLayout;
use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// The split parameters of the whole model and how they are split.
pub type Specs = BTreeMap<String, (ShardSpec, Vec<usize>)>;

/// One tensor shard of a stage.
#[derive(Debug, Clone)]
pub struct StageShard {
    /// This shard.
    pub rank: usize,
    specs: Arc<Specs>,
    /// Layout indices of this stage's split parameters.
    split: Vec<usize>,
}

impl StageShard {
    /// Shard `rank` of a stage holding `layout`'s parameters of `tg` (`None` when the
    /// graph is not split).
    pub fn new(tg: &TrainingGraph, layout: &ParamLayout, rank: usize) -> Option<StageShard> {
        let plan = tg.shards.as_ref()?;
        let split = (0..layout.count())
            .filter(|&i| plan.specs.contains_key(&layout.names()[i]))
            .collect();
        Some(StageShard {
            rank,
            specs: Arc::new(plan.specs.clone()),
            split,
        })
    }

    /// What the checkpoint code needs to know of the shard.
    pub fn saved(&self) -> SavedShard<'_> {
        SavedShard {
            rank: self.rank,
            specs: &self.specs,
        }
    }

    /// Statistics of the gradients this shard counts: shard 0 all of its own, the other
    /// shards only their parts of the split parameters (the replicated ones are the same
    /// on every shard), so that the shards' statistics add up to the whole model's.
    pub fn grad_stats(&self, layout: &ParamLayout, grads: &[f32]) -> GradStats {
        self.grad_stats_of(layout, grads, 0..layout.count())
    }

    /// [`StageShard::grad_stats`] of the tensors `tensors` (layout indices) only: a
    /// replica's part of the stage when the optimizer state is sharded (ZeRO stage 1).
    pub fn grad_stats_of(
        &self,
        layout: &ParamLayout,
        grads: &[f32],
        tensors: std::ops::Range<usize>,
    ) -> GradStats {
        if self.rank == 0 {
            return GradStats::of(&grads[layout.values_of(tensors)]);
        }
        let sum_sq = (self.split.iter())
            .filter(|i| tensors.contains(i))
            .map(|&i| GradStats::of(layout.slice(grads, i)).sum_sq)
            .sum();
        GradStats { sum_sq }
    }
}

/// Whole parameters from the parts that every shard of one data-parallel replica holds
/// (`by_shard[k]`: shard `k`'s `(name, value)` list); replicated ones are taken from
/// shard 0.
///
/// # Errors
/// `BadTensor` when a part is missing or of the wrong size.
pub fn whole_parameters(
    specs: &Specs,
    by_shard: Vec<Vec<(String, Tensor)>>,
) -> Result<Vec<(String, Tensor)>> {
    let mut shards = by_shard.into_iter();
    let first = shards.next().unwrap_or_default();
    let rest: Vec<_> = shards.collect();
    let mut out = Vec::with_capacity(first.len());
    for (name, t) in first {
        let Some((spec, whole)) = specs.get(&name) else {
            out.push((name, t));
            continue;
        };
        let bad = |reason: &str| Error::BadTensor {
            name: name.clone(),
            reason: reason.into(),
        };
        let mut all = vec![0.0f32; whole.iter().product()];
        let part0 = t.as_f32().ok_or_else(|| bad("not float32"))?;
        spec.place(part0, whole, 0, &mut all);
        for (k, list) in rest.iter().enumerate() {
            let part = list
                .iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, t)| t.as_f32())
                .filter(|p| p.len() == part0.len())
                .ok_or_else(|| bad(&format!("tensor shard {} has no part of it", k + 1)))?;
            spec.place(part, whole, k + 1, &mut all);
        }
        let t = Tensor {
            shape: whole.clone(),
            data: TensorData::F32(all),
        };
        out.push((name, t));
    }
    Ok(out)
}
