//! The engine over this process's stage computes: alone, or as its part of a cluster
//! run; and the trained parameters gathered whole from what it hands back.

use std::collections::HashMap;
use std::sync::Arc;

use pipetrain_actors::{Collective, EngineSettings, StepResult};

use super::cluster::{gather_parameters, ClusterPart};
use crate::graph::tensor_parallel::ShardPlan;
use crate::pipeline::{OrtStage, StepData};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What the engine hands back: the steps' results, the trace, the trained parameters
/// (replica 0's, every stage), and what each stage of replica 0 (shard 0) reports.
pub(super) type EngineOutput = (
    Vec<StepResult>,
    Option<pipetrain_actors::RunTrace>,
    Vec<(String, Tensor)>,
    Vec<StageFacts>,
);

/// What one stage of replica 0 reports at the end of the run.
#[derive(Debug, Clone, Copy)]
pub(super) struct StageFacts {
    pub stage: usize,
    /// The most bytes its stash held.
    pub peak_stash: usize,
    /// What its tensor shard's all-reduces carried (`None`: not split).
    pub shard_traffic: Option<crate::compute::ShardTraffic>,
    /// What it handed between host and device (`None`: its state on the host).
    pub host_traffic: Option<crate::pipeline::HostTraffic>,
}

impl StageFacts {
    fn of(stage: usize, c: &OrtStage) -> StageFacts {
        StageFacts {
            stage,
            peak_stash: c.peak_stash_bytes(),
            shard_traffic: c.shard_traffic(),
            host_traffic: c.host_traffic(),
        }
    }
}

/// Runs the engine over this process's computes, alone or as its part of a cluster.
pub(super) async fn run_engine<K: Collective>(
    engine: &EngineSettings,
    mut computes: HashMap<(usize, usize), OrtStage>,
    data: Arc<StepData>,
    lr_at: Box<dyn Fn(u64) -> f64 + Send + Sync>,
    (steps, on_step): (std::ops::Range<u64>, impl FnMut(&StepResult) + Send),
    cluster: Option<ClusterPart<K>>,
    (stages, plan, gather): (usize, Option<&ShardPlan>, bool),
) -> Result<EngineOutput> {
    let failed = Error::runtime;
    match cluster {
        None => {
            let by_replica = (0..engine.replicas)
                .map(|r| {
                    (0..stages)
                        .map(|s| computes.remove(&(r, s)).expect("every stage was built"))
                        .collect()
                })
                .collect();
            let out = pipetrain_actors::run(engine, by_replica, data, lr_at, steps, on_step)
                .await
                .map_err(failed)?;
            let first = out.computes.first().into_iter().flatten();
            let peaks = first
                .clone()
                .enumerate()
                .map(|(s, c)| StageFacts::of(s, c))
                .collect();
            // Data-parallel replica 0: its tensor shards, each stage's parts together;
            // the other replicas go first, and each stage frees its sessions, gradients
            // and optimizer state before its parameters are copied out (GPT-2 small,
            // SGD: the run's peak was these copies beside the whole training state).
            let mut computes = out.computes;
            computes.truncate(engine.shards);
            let mut by_shard = Vec::with_capacity(engine.shards);
            for r in computes {
                let stages = r.into_iter().map(OrtStage::into_parameters);
                let stages: Vec<_> = stages.collect::<Result<_>>()?;
                by_shard.push(stages.into_iter().flatten().collect());
            }
            let params = whole_parameters(plan, by_shard)?;
            Ok((out.steps, out.trace, params, peaks))
        }
        Some(part) => {
            let bus = part.dist.bus.clone();
            let out = pipetrain_actors::run_distributed(
                engine, computes, data, lr_at, steps, on_step, part.dist,
            )
            .await
            .map_err(failed)?;
            // Data-parallel replica 0's tensor shards.
            let mut mine: Vec<_> = out
                .computes
                .into_iter()
                .filter(|((r, _), _)| *r < engine.shards)
                .collect();
            mine.sort_by_key(|((r, s), _)| (*s, *r));
            let peaks = mine
                .iter()
                .filter(|((r, _), _)| *r == 0)
                .map(|((_, s), c)| StageFacts::of(*s, c))
                .collect();
            // The stages' sessions, gradients and optimizer state go before the gather's
            // copies arrive (a launched rank of a wide GPT with AdamW: its peak 1.31 ->
            // 0.96 GB, the steps' own).
            let mut local = Vec::new();
            for ((r, _), c) in mine {
                if gather {
                    local.extend(c.into_parameters()?.into_iter().map(|(n, t)| (r, n, t)));
                }
            }
            // Gathered only for the trained model's file: every rank would receive every
            // parameter (a rank of a 1-billion-parameter model at pp = 4 was killed by its
            // 6 GB cap there, after training).
            let params = match gather {
                true => whole_parameters(plan, gather_parameters(bus.as_ref(), local).await?)?,
                false => Vec::new(),
            };
            Ok((out.steps, out.trace, params, peaks))
        }
    }
}

/// Whole parameters from data-parallel replica 0's tensor shards (`by_shard[k]`: shard
/// `k`'s); shard 0's as they are when the model is not split.
fn whole_parameters(
    plan: Option<&ShardPlan>,
    by_shard: Vec<Vec<(String, Tensor)>>,
) -> Result<Vec<(String, Tensor)>> {
    match plan {
        Some(p) => crate::pipeline::whole_parameters(&p.specs, by_shard),
        None => Ok(by_shard.into_iter().next().unwrap_or_default()),
    }
}
