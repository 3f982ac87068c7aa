//! What a layout's processes hold, beside their ranks' own memory: the cap `train`
//! refuses a run over is a process's (`runtime.memory_limit_gb`, the cgroup's limit),
//! and a process holds ONNX Runtime and the libraries, the training graph every process
//! builds whole, and graph building's peak before its sessions open (`train::check_fits`).
//!
//! The plan measures these in its own process, while it builds the model's training
//! graph the way `train` does, and adds each process's ranks as the memory model predicts
//! them: in one process every worker's; over a cluster manifest, each node's.

use serde::{Deserialize, Serialize};

use crate::cost::{Candidate, Nodes};
use crate::graph::TrainingGraph;
use crate::train::peak::gb;
use crate::train::release_freed_memory;
use crate::Result;

/// A process's memory before its sessions open, as `train` counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessBase {
    /// Resident after building the training graph, less the parameters' initial values
    /// (they move into the stages, counted there).
    pub fixed: u64,
    /// Graph building's peak (anonymous memory; memory-mapped weights are the page
    /// cache's), at the configuration's micro-batch.
    pub building: u64,
    /// The parameters' initial values.
    pub params: u64,
    /// The micro-batch the graph was built at (the configuration's).
    pub micro_batch: usize,
}

/// What a process held before anything of the plan's own: resident and anonymous bytes.
/// The plan's process does more than a training process before it builds the graph (it
/// measures the link of a manifest's nodes), so what building adds is counted from here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Baseline {
    resident: u64,
    anon: u64,
}

impl Baseline {
    /// This process now.
    pub fn now() -> Baseline {
        Baseline {
            resident: crate::train::resident_now(),
            anon: crate::telemetry::anon_resident_bytes().unwrap_or(0),
        }
    }
}

impl ProcessBase {
    /// Runs `build` (which builds the training graph at micro-batches of `micro_batch`)
    /// in this process and measures what it adds to the process, and to its peak, over
    /// what the process held at `start` (as a training process holds when it starts to
    /// build).
    ///
    /// # Errors
    /// What `build` returns.
    pub fn measure(
        build: impl FnOnce() -> Result<TrainingGraph>,
        micro_batch: usize,
        start: Baseline,
    ) -> Result<(TrainingGraph, ProcessBase)> {
        release_freed_memory();
        let before = Baseline::now();
        let sampler = crate::telemetry::AnonPeak::start();
        let tg = build()?;
        let peak = sampler.peak().unwrap_or(before.anon);
        // As `train` does after building: glibc keeps freed heap unless asked.
        release_freed_memory();
        let initial = tg.initial_value_bytes();
        let added = crate::train::resident_now().saturating_sub(before.resident);
        let base = ProcessBase {
            fixed: (start.resident + added).saturating_sub(initial),
            building: start.anon + peak.saturating_sub(before.anon),
            params: initial,
            micro_batch,
        };
        Ok((tg, base))
    }

    /// Refuses a process cap that no layout can fit: every process holds its fixed
    /// memory and every parameter at least, before profiling runs into it.
    ///
    /// # Errors
    /// `Plan`, saying what a process holds and by how much it is over the cap.
    pub fn check_room(&self, cap: Option<&(u64, String)>) -> Result<()> {
        let least = self.fixed + self.params;
        match cap {
            Some((cap, from)) if least > *cap => Err(super::plan_error(
                "memory",
                format!(
                    "nothing fits: every process holds at least {} (ONNX Runtime, the \
                     libraries and the training graph {}, the parameters {}), {} over the \
                     process cap of {} ({from})",
                    gb(least),
                    gb(self.fixed),
                    gb(self.params),
                    gb(least - cap),
                    gb(*cap)
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Graph building's peak at micro-batches of `micro_batch`: its shape probes run
    /// the model at the micro-batch (the vocabulary GPT's peak 0.18 GB at 16 samples,
    /// 0.12 at 8), so what it holds above the fixed memory and the parameters scales
    /// with it.
    pub fn building_at(&self, micro_batch: usize) -> u64 {
        let held = self.fixed + self.params;
        let scale = micro_batch as f64 / self.micro_batch.max(1) as f64;
        held + (self.building.saturating_sub(held) as f64 * scale) as u64
    }

    /// A process whose ranks hold `ranks` bytes in all, at micro-batches of
    /// `micro_batch`: the training's peak, or graph building's where that is higher.
    pub fn with_ranks(&self, ranks: u64, micro_batch: usize) -> u64 {
        (self.fixed + ranks).max(self.building_at(micro_batch))
    }

    /// `"0.05 GB (ONNX Runtime, the libraries, the training graph), graph building's
    /// peak 0.18 GB"`.
    pub fn describe(&self) -> String {
        format!(
            "{} (ONNX Runtime, the libraries, the training graph), graph building's peak {}",
            gb(self.fixed),
            gb(self.building)
        )
    }
}

/// The predicted peak of each process of `c`'s layout whose pipeline ranks hold `ranks`
/// bytes each (every replica and shard alike): one process holding every member, or
/// over `nodes` one a node, the members placed as the manifest places them.
pub fn process_peaks(
    c: &Candidate,
    ranks: &[u64],
    base: &ProcessBase,
    nodes: Option<&Nodes>,
) -> Vec<u64> {
    let mut held = vec![0u64; nodes.map_or(1, |n| n.slots.len())];
    for dp in 0..c.dp {
        for pp in 0..c.pp {
            for tp in 0..c.tp {
                let process = nodes.map_or(0, |n| n.member(c, (dp, pp, tp)));
                held[process] += ranks.get(pp).copied().unwrap_or(0);
            }
        }
    }
    held.into_iter()
        .map(|ranks| base.with_ranks(ranks, c.micro_batch))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(dp: usize, tp: usize, pp: usize) -> Candidate {
        Candidate::one_f_one_b((dp, tp, pp), (4, 8))
    }

    const BASE: ProcessBase = ProcessBase {
        fixed: 100,
        building: 150,
        params: 10,
        micro_batch: 8,
    };

    #[test]
    fn one_process_holds_every_replica_and_shard_of_every_rank_beside_what_it_holds_fixed() {
        // dp 2 x tp 2 x pp 2: each rank's bytes four times.
        let peaks = process_peaks(&candidate(2, 2, 2), &[10, 20], &BASE, None);
        assert_eq!(peaks, [100 + 4 * (10 + 20)]);
    }

    #[test]
    fn graph_building_bounds_a_process_whose_ranks_hold_little() {
        assert_eq!(
            process_peaks(&candidate(1, 1, 2), &[10, 20], &BASE, None),
            [150]
        );
    }

    #[test]
    fn graph_building_above_the_fixed_memory_and_the_parameters_scales_with_the_micro_batch() {
        // 40 above fixed and parameters at the configuration's micro-batch; 10 at a quarter.
        assert_eq!(BASE.building_at(8), 150);
        assert_eq!(BASE.building_at(2), 120);
        let quarter = Candidate {
            micro_batch: 2,
            ..candidate(1, 1, 2)
        };
        assert_eq!(process_peaks(&quarter, &[5, 5], &BASE, None), [120]);
    }

    #[test]
    fn a_process_cap_below_the_fixed_memory_and_the_parameters_is_refused_saying_by_how_much() {
        let cap = |bytes: u64| (bytes, "--memory-per-process".to_string());
        assert!(BASE.check_room(None).is_ok());
        assert!(BASE.check_room(Some(&cap(110))).is_ok());
        let why = BASE.check_room(Some(&cap(109))).unwrap_err().to_string();
        assert!(
            why.contains("over the process cap") && why.contains("(--memory-per-process)"),
            "{why}"
        );
    }

    #[test]
    fn over_nodes_each_process_holds_the_ranks_the_manifest_places_on_its_node() {
        // Two nodes of two slots; dp 2 x pp 2: replica 0's ranks on node 0, replica 1's
        // on node 1 (rank r = (dp x pp + p) x tp + t).
        let nodes = Nodes {
            slots: vec![2, 2],
            hosts: 1,
        };
        let peaks = process_peaks(&candidate(2, 1, 2), &[60, 20], &BASE, Some(&nodes));
        assert_eq!(peaks, [180, 180]);
        // pp 4 over the same nodes: ranks 0 and 1 on node 0, 2 and 3 on node 1.
        let peaks = process_peaks(&candidate(1, 1, 4), &[60, 20, 5, 1], &BASE, Some(&nodes));
        assert_eq!(peaks, [180, 150]);
    }
}
