//! What a model's nodes cost on one machine, per micro-batch: measured by `pipetrain
//! plan` (`plan::profile`), read here by index into the training graph, or saved and read
//! again by name (`pipeline.profile`, [`crate::graph::NodeCosts`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::graph::{NodeTimes, TrainingGraph};

use super::{Family, Machinery, PerFamily};

/// Per forward node, seconds per micro-batch on one stage running `threads` intra-op
/// threads, micro-batches of `micro_batch` samples.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Tensor shards the model ran in (each shard's nodes timed).
    #[serde(default = "one")]
    pub shards: usize,
    /// Pipeline stages its runs cut the model into (1 unless no worker holds it whole).
    #[serde(default = "one")]
    pub stages: usize,
    /// Steps its timed runs took (`plan::ProfileRun::lengthened`).
    #[serde(default)]
    pub steps: usize,
    /// Intra-op threads the sessions ran.
    pub threads: usize,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Each forward node's kernels.
    pub forward: Vec<f64>,
    /// Each backward node's (`tg.graph.nodes[tg.forward_len..]`) kernels.
    pub backward: Vec<f64>,
    /// A micro-batch's forward and backward as one graph (one stage, unsplit schedule).
    pub fused: f64,
    /// The optimizer step's seconds per parameter value.
    pub step_per_value: f64,
    /// What each action costs beside its compute (the actors' hand-over, feeding the
    /// micro-batch, accumulating): fitted over the profiles (`plan::profile::fit_overheads`).
    pub action_gap: f64,
    /// The one-stage run's step less its actions' time.
    pub idle: f64,
    /// Its actions per step (a forward and a backward per micro-batch).
    pub actions: f64,
    /// What each action of a pipeline's stage pays beside its nodes (its own session
    /// run, the values it receives and keeps), per schedule [`Family`]: calibrated so that
    /// the family's two-rank run ([`Profile::periods`]) simulates to its measured step
    /// (`plan::calibrate`; 0 where not measured).
    #[serde(default)]
    pub stage_runs: PerFamily,
    /// Each family's two-rank run's measured step ([`Family::run`]; 0 where not run).
    #[serde(default)]
    pub periods: PerFamily,
    /// In the GPipe run, the median wait of an action for a value from the other stage,
    /// where its own stage was idle when the value was made (0 where not run).
    #[serde(default)]
    pub hand_off: f64,
    /// In the GPipe run, how much its two stages' actions slowed each other where they
    /// ran at once (`plan::overlap`; `None` where they did not, or it was not run).
    #[serde(default)]
    pub stage_contention: Option<f64>,
    /// Share of kernel time in nodes ONNX Runtime made itself, spread by proportion.
    pub unmatched: f64,
    /// In the one-rank run of the model cut in two by FLOPs (ZB-V at one rank), each
    /// stage's forward, input-gradient and weight-gradient action, seconds (their
    /// medians; `None` where not run): what the nodes' shares are set against
    /// (`plan::shares`).
    #[serde(default)]
    pub stage_passes: Option<StagePasses>,
}

/// Per stage of a two-stage run, its `F`, `I` and `W` actions' seconds.
pub type StagePasses = [[f64; 3]; 2];

fn one() -> usize {
    1
}

impl Profile {
    /// Sum of every node's forward and backward: one micro-batch's compute.
    pub fn total(&self) -> f64 {
        self.forward.iter().chain(&self.backward).sum()
    }
}

/// A profile as `pipetrain plan --save-profile` writes it for `pipeline.profile`: each
/// forward node's whole time (what the linear partition balances) and, where written by
/// this version on, what cutting on the schedule's critical path reads, by node name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedProfile {
    /// Micro-batch, threads and each forward node's forward and backward together.
    #[serde(flatten)]
    pub times: NodeTimes,
    /// The passes apart, and the machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub costs: Option<NamedCosts>,
}

/// A [`Profile`]'s costs by node name, with the machine they were measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedCosts {
    /// Each forward node's forward, seconds.
    pub forward: BTreeMap<String, f64>,
    /// Each backward node, seconds.
    pub backward: BTreeMap<String, f64>,
    /// A micro-batch's forward and backward as one graph.
    pub fused: f64,
    /// The optimizer step's seconds per parameter value.
    pub step_per_value: f64,
    /// What each action costs beside its compute.
    pub action_gap: f64,
    /// What each action of a pipeline's stage pays beside its nodes, in a schedule
    /// that splits the backward, one stage a rank.
    pub stage_run: f64,
    /// The same, in a schedule that does not split the backward (older files: as
    /// `stage_run`).
    #[serde(default)]
    pub unsplit_stage_run: Option<f64>,
    /// The same, in interleaved 1F1B (older files: as `unsplit_stage_run`).
    #[serde(default)]
    pub interleaved_stage_run: Option<f64>,
    /// The same, in a V-shaped schedule (older files: as `stage_run`).
    #[serde(default)]
    pub v_stage_run: Option<f64>,
    /// The machine.
    pub machinery: Machinery,
}

impl SavedProfile {
    /// `profile` (of `tg`, unsplit) measured on `machinery`, by name.
    pub fn of(profile: &Profile, tg: &TrainingGraph, machinery: &Machinery) -> SavedProfile {
        let forward = &tg.graph.nodes[..tg.forward_len];
        let backward = &tg.graph.nodes[tg.forward_len..];
        let mut whole: Vec<f64> = profile.forward.clone();
        for (b, &t) in profile.backward.iter().enumerate() {
            if let Some(slot) = whole.get_mut(tg.anchors[b]) {
                *slot += t;
            }
        }
        let named = |nodes: &[crate::onnx::proto::NodeProto], times: &[f64]| {
            nodes
                .iter()
                .zip(times)
                .map(|(n, &t)| (n.name.clone(), t))
                .collect()
        };
        SavedProfile {
            times: NodeTimes {
                micro_batch: profile.micro_batch,
                threads: profile.threads,
                times: named(forward, &whole),
            },
            costs: Some(NamedCosts {
                forward: named(forward, &profile.forward),
                backward: named(backward, &profile.backward),
                fused: profile.fused,
                step_per_value: profile.step_per_value,
                action_gap: profile.action_gap,
                stage_run: profile.stage_runs[Family::Split],
                unsplit_stage_run: Some(profile.stage_runs[Family::Unsplit]),
                interleaved_stage_run: Some(profile.stage_runs[Family::Interleaved]),
                v_stage_run: Some(profile.stage_runs[Family::V]),
                machinery: *machinery,
            }),
        }
    }
}

impl NamedCosts {
    /// Each family's stage cost, a family older files lack taking its kin's.
    fn stage_runs(&self) -> PerFamily {
        let unsplit = self.unsplit_stage_run.unwrap_or(self.stage_run);
        let mut out = PerFamily::default();
        out[Family::Split] = self.stage_run;
        out[Family::Unsplit] = unsplit;
        out[Family::Interleaved] = self.interleaved_stage_run.unwrap_or(unsplit);
        out[Family::V] = self.v_stage_run.unwrap_or(self.stage_run);
        out
    }

    /// The profile of `tg`'s nodes (by name; a node not named costs nothing) at
    /// micro-batches of `micro_batch` samples, from costs measured at `measured_at`
    /// (node times scaled in proportion).
    pub fn profile(
        &self,
        tg: &TrainingGraph,
        measured_at: &NodeTimes,
        micro_batch: usize,
    ) -> Profile {
        let scale = micro_batch as f64 / measured_at.micro_batch.max(1) as f64;
        let times = |nodes: &[crate::onnx::proto::NodeProto], by: &BTreeMap<String, f64>| {
            nodes
                .iter()
                .map(|n| by.get(&n.name).copied().unwrap_or(0.0) * scale)
                .collect()
        };
        Profile {
            shards: 1,
            stages: 1,
            steps: 0,
            threads: measured_at.threads,
            micro_batch,
            forward: times(&tg.graph.nodes[..tg.forward_len], &self.forward),
            backward: times(&tg.graph.nodes[tg.forward_len..], &self.backward),
            fused: self.fused * scale,
            step_per_value: self.step_per_value,
            action_gap: self.action_gap,
            idle: 0.0,
            actions: 0.0,
            stage_runs: self.stage_runs(),
            periods: PerFamily::default(),
            hand_off: 0.0,
            stage_contention: None,
            unmatched: 0.0,
            stage_passes: None,
        }
    }
}
