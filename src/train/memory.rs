//! What a run's stages keep between forward and backward: the bytes the schedule
//! predicts from the stage graphs' value sizes, next to what the stages measured.

use std::collections::BTreeSet;

use pipetrain_schedules::{simulate, ActionKind, CostModel, Schedule, StageCost};

use crate::graph::{StageGraphs, TrainingGraph};

/// One stage's peak stash: the most bytes it kept at once for its in-flight
/// micro-batches (activations, data, and under a split backward the hand-off from the
/// input-gradient half to the weight-gradient half).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StashPeak {
    /// The stage.
    pub stage: usize,
    /// What the stage held at its peak (replica 0's), counted as it ran.
    pub measured: u64,
    /// What the schedule's order predicts from the stage graphs' value sizes.
    pub predicted: u64,
}

/// Per stage, the bytes the schedule predicts it keeps at its peak: each forward keeps
/// the values the stage's backward reads and its data; an input-gradient pass adds what
/// it hands the weight-gradient pass and the gradients that arrived. The last stage of
/// an unsplit schedule runs forward and backward in one graph and keeps nothing.
pub(super) fn predicted_stash(
    tg: &TrainingGraph,
    stages: &[StageGraphs],
    schedule: &Schedule,
) -> Vec<u64> {
    let split = schedule
        .ranks()
        .iter()
        .flatten()
        .any(|a| a.kind() == ActionKind::BackwardInput);
    let bytes = |names: &BTreeSet<&String>| -> u64 {
        names
            .iter()
            .filter_map(|n| tg.metas.get(n.as_str()))
            .map(|m| (m.numel() * m.dtype.size()) as u64)
            .sum()
    };
    let mut kept = Vec::with_capacity(stages.len());
    let mut handoff = Vec::with_capacity(stages.len());
    for g in stages {
        if g.fused.is_some() && !split {
            kept.push(0);
            handoff.push(0);
            continue;
        }
        let k: BTreeSet<&String> = g.io.stash.iter().chain(&g.io.data).collect();
        let h: BTreeSet<&String> = match split {
            true => g.io.i_to_w.iter().chain(&g.io.bwd_recv).collect(),
            false => BTreeSet::new(),
        };
        kept.push(bytes(&k));
        handoff.push(bytes(&h.difference(&k).copied().collect()));
    }
    let costs = CostModel::uniform(stages.len(), StageCost::default());
    match simulate(schedule, &costs) {
        Ok(t) => t.peak_stash_bytes(&kept, &handoff),
        Err(_) => vec![0; stages.len()],
    }
}
