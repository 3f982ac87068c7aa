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
    /// run, the values it receives and keeps), as a share of their time (0.2: a fifth
    /// more), per schedule [`Family`]: calibrated so that the family's two-rank run
    /// ([`Profile::periods`]) simulates to its measured step (`plan::calibrate`; 0
    /// where not measured).
    #[serde(default)]
    pub stage_overheads: PerFamily,
    /// Where a schedule does not split the backward, what its last stage's one graph of
    /// forward and backward pays against what its other actions pay, a factor on
    /// `1 + stage_overheads` (0: not measured, the same): from the family's two-rank run,
    /// its stages' actions set against their nodes (`plan::calibrate`).
    #[serde(default)]
    pub last_stage_factors: PerFamily,
    /// In each family's two-rank run, its last stage's actions' time over its other
    /// stages' (0 where not read): what [`Profile::last_stage_factors`] are set from.
    #[serde(default)]
    pub last_stage_ratios: PerFamily,
    /// Each family's two-rank run's measured step ([`Family::run`]; 0 where not run).
    #[serde(default)]
    pub periods: PerFamily,
    /// In the GPipe run, the median wait of an action for a value from the other stage,
    /// where its own stage was idle when the value was made (0 where not run).
    #[serde(default)]
    pub hand_off: f64,
    /// The same for a gradient (0: as `hand_off`).
    #[serde(default)]
    pub hand_off_back: f64,
    /// In the GPipe run, how much its two stages' actions slowed each other where they
    /// ran at once (`plan::overlap`; `None` where they did not, or it was not run).
    #[serde(default)]
    pub stage_contention: Option<f64>,
    /// Share of kernel time in nodes ONNX Runtime made itself, spread by proportion.
    pub unmatched: f64,
    /// In the one-rank run of the model cut in two ([`Profile::run_cuts`]; ZB-V at one rank), each
    /// stage's forward, input-gradient and weight-gradient action, seconds (their
    /// medians; `None` where not run): what the nodes' shares are set against
    /// (`plan::shares`).
    #[serde(default)]
    pub stage_passes: Option<StagePasses>,
    /// The cuts the profile's pipeline runs were made at, one for each stage count
    /// (empty: cut by FLOPs, as a configuration without a partition cuts them).
    #[serde(default)]
    pub run_cuts: Vec<RunCut>,
}

/// Per stage of a two-stage run, its `F`, `I` and `W` actions' seconds.
pub type StagePasses = [[f64; 3]; 2];

/// Where a profile's pipeline runs of `stages` stages were cut: balanced by the nodes'
/// measured times (`plan::profile`), so that the runs the stages' costs are calibrated
/// against are cut as the planned layouts are, not by FLOPs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCut {
    /// Stages cut.
    pub stages: usize,
    /// The cut positions in the live nodes (`stages::Cuttable::live`).
    pub bounds: Vec<usize>,
    /// The same as `partition = { cut_at = ... }` names them.
    pub names: Vec<String>,
}

fn one() -> usize {
    1
}

impl Profile {
    /// Sum of every node's forward and backward: one micro-batch's compute.
    pub fn total(&self) -> f64 {
        self.forward.iter().chain(&self.backward).sum()
    }

    /// Its nodes' times scaled so the forward's sum to `forward` seconds and the
    /// backward's to `backward` (the profiler gives only each node's share of its pass).
    pub fn scale_passes_to(&mut self, forward: f64, backward: f64) {
        let rescale = |v: &mut Vec<f64>, to: f64| {
            let of: f64 = v.iter().sum();
            let k = if of > 0.0 { to / of } else { 0.0 };
            v.iter_mut().for_each(|x| *x *= k);
        };
        rescale(&mut self.forward, forward);
        rescale(&mut self.backward, backward);
    }

    /// The cut its pipeline runs of `stages` stages were made at (`None`: by FLOPs).
    pub fn run_cut(&self, stages: usize) -> Option<&RunCut> {
        self.run_cuts.iter().find(|c| c.stages == stages)
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
    /// What each action of a pipeline's stage pays beside its nodes, as a share of
    /// their time, per schedule [`Family`] in [`Family::ALL`]'s order (unsplit, split,
    /// interleaved, V): [`Profile::stage_overheads`]. Older files have the seconds
    /// below instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_overheads: Option<PerFamily>,
    /// [`Profile::last_stage_factors`] (older files: none, the last stage's one graph
    /// paying as the other actions do).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stage_factors: Option<PerFamily>,
    /// Older files: what each action of a pipeline's stage pays beside its nodes,
    /// seconds, in a schedule that splits the backward, one stage a rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_run: Option<f64>,
    /// Older files: the same, in a schedule that does not split the backward (older
    /// still: as `stage_run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsplit_stage_run: Option<f64>,
    /// Older files: the same, in interleaved 1F1B (older still: as
    /// `unsplit_stage_run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interleaved_stage_run: Option<f64>,
    /// Older files: the same, in a V-shaped schedule (older still: as `stage_run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
                stage_overheads: Some(profile.stage_overheads),
                last_stage_factors: Some(profile.last_stage_factors),
                stage_run: None,
                unsplit_stage_run: None,
                interleaved_stage_run: None,
                v_stage_run: None,
                machinery: *machinery,
            }),
        }
    }
}

impl NamedCosts {
    /// Each family's stage overhead. Older files' seconds an action are read as a
    /// share of an action of a two-stage cut (a quarter of a micro-batch's nodes), a
    /// family they lack taking its kin's.
    fn stage_overheads(&self) -> PerFamily {
        if let Some(overheads) = self.stage_overheads {
            return overheads;
        }
        let nodes: f64 = self.forward.values().chain(self.backward.values()).sum();
        let share = |seconds: f64| match nodes > 0.0 {
            true => seconds / (nodes / 4.0),
            false => 0.0,
        };
        let split = self.stage_run.unwrap_or(0.0);
        let unsplit = self.unsplit_stage_run.unwrap_or(split);
        let mut out = PerFamily::default();
        out[Family::Split] = share(split);
        out[Family::Unsplit] = share(unsplit);
        out[Family::Interleaved] = share(self.interleaved_stage_run.unwrap_or(unsplit));
        out[Family::V] = share(self.v_stage_run.unwrap_or(split));
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
            stage_overheads: self.stage_overheads(),
            last_stage_factors: self.last_stage_factors.unwrap_or_default(),
            last_stage_ratios: PerFamily::default(),
            periods: PerFamily::default(),
            hand_off: 0.0,
            hand_off_back: 0.0,
            stage_contention: None,
            unmatched: 0.0,
            stage_passes: None,
            run_cuts: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A saved profile's costs: a micro-batch's nodes 4 ms (an action of a two-stage cut
    /// 1 ms), with `stages` written in.
    fn named(stages: &str) -> NamedCosts {
        let text = format!(
            r#"{{"forward": {{"a": 1e-3}}, "backward": {{"b": 3e-3}}, "fused": 3e-3,
            "step_per_value": 1e-9, "action_gap": 1e-5, {stages}
            "machinery": {{"cores": 2, "threads": 1, "hop": 1e-6, "add_per_value": 1e-9,
            "contention": 0.5, "replica_sync": 0.0, "step_overhead": 0.0}}}}"#
        );
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn older_files_seconds_an_action_are_read_as_shares_of_a_two_stage_action() {
        // 0.2 ms and 0.5 ms an action against 1 ms; interleaved takes unsplit's, V split's.
        let old = named(r#""stage_run": 2e-4, "unsplit_stage_run": 5e-4,"#);
        let read = old.stage_overheads().0;
        let want = [0.5, 0.2, 0.5, 0.2];
        assert!(
            read.iter().zip(want).all(|(r, w)| (r - w).abs() < 1e-12),
            "{read:?}"
        );
        // Overheads written as such are read as they are, and written back so.
        let new = named(r#""stage_overheads": [0.3, 0.1, 0.4, 0.2],"#);
        assert_eq!(new.stage_overheads().0, [0.3, 0.1, 0.4, 0.2]);
        let text = serde_json::to_string(&new).unwrap();
        assert!(!text.contains("stage_run"), "{text}");
        // A file with neither pays none.
        assert_eq!(named("").stage_overheads().0, [0.0; 4]);
    }
}
