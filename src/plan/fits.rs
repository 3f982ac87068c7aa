//! Whether a layout fits the memory caps (a rank's, a process's), and what is short
//! where none does.

use crate::train::peak::gb;

use super::{Plan, PlanRow};

impl PlanRow {
    /// Whether every rank fits the device cap and every process the process cap.
    pub fn fits(&self, caps: &Caps) -> bool {
        let ranks = caps
            .device
            .is_none_or(|c| self.peak.iter().all(|&p| p <= c));
        let processes = caps
            .process
            .as_ref()
            .is_none_or(|(c, _)| self.processes.iter().all(|p| p <= c));
        ranks && processes
    }
}

/// The memory caps a layout must fit.
#[derive(Debug, Clone, Default)]
pub struct Caps {
    /// Each rank's, bytes (`--memory-per-device`): what the memory model predicts of
    /// its state, constants and activations.
    pub device: Option<u64>,
    /// Each process's, bytes, and where it comes from (`--memory-per-process`, else the
    /// cap `train` refuses a run over: `runtime.memory_limit_gb` or the cgroup's limit).
    pub process: Option<(u64, String)>,
}

/// Why no layout fits: the smallest need against each cap it exceeds.
pub(super) fn nothing_fits(plan: &Plan) -> String {
    let least = |of: fn(&PlanRow) -> u64| plan.rows.iter().map(of).min();
    let largest_rank = least(|r| r.peak.iter().copied().max().unwrap_or(0));
    let largest_process = least(|r| r.processes.iter().copied().max().unwrap_or(0));
    let mut short = Vec::new();
    if let (Some(need), Some(cap)) = (largest_rank, plan.cap.device) {
        if need > cap {
            short.push(format!(
                "the smallest layout needs {} on its largest rank, {} over the cap of {}",
                gb(need),
                gb(need - cap),
                gb(cap)
            ));
        }
    }
    if let (Some(need), Some((cap, from))) = (largest_process, &plan.cap.process) {
        if need > *cap {
            short.push(format!(
                "the smallest layout needs {} in a process (its ranks and {} beside them), \
                 {} over the process cap of {} ({from})",
                gb(need),
                gb(plan.process_base.fixed),
                gb(need - cap),
                gb(*cap)
            ));
        }
    }
    match (plan.rows.is_empty(), short.is_empty()) {
        (true, _) => "\nno candidate could be simulated\n".to_string(),
        (false, true) => {
            "\nnothing fits: no layout fits the rank cap and the process cap at once\n".into()
        }
        (false, false) => format!("\nnothing fits: {}\n", short.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::process::ProcessBase;
    use super::super::{Plan, Simulated};
    use super::*;
    use crate::cost::{Candidate, Machinery};

    /// A layout whose largest rank holds `rank` bytes and its process `process`.
    fn row(rank: u64, process: u64) -> PlanRow {
        PlanRow {
            candidate: Candidate::one_f_one_b((1, 1, 1), (1, 8)),
            cuts: Vec::new(),
            simulated: Simulated {
                step: 1e-3,
                bubble: 0.0,
                bounds: Vec::new(),
            },
            peak: vec![rank],
            processes: vec![process],
        }
    }

    fn plan(rows: Vec<PlanRow>, cap: Caps) -> Plan {
        Plan {
            rows,
            default: None,
            cut_rivals: Vec::new(),
            profiles: Vec::new(),
            skipped: Vec::new(),
            tp_skipped: Vec::new(),
            threads: 1,
            cap,
            process_base: ProcessBase {
                fixed: 50_000_000,
                building: 0,
                params: 1_000_000,
                micro_batch: 8,
            },
            profile_seconds: 0.0,
            profile_read: None,
            machinery: Machinery::bare(2, 1),
            node_times: None,
            nodes: None,
            shards_across_nodes: 0,
            fixed_batch: None,
        }
    }

    fn caps(device: u64, process: u64) -> Caps {
        Caps {
            device: Some(device),
            process: Some((process, "--memory-per-process".into())),
        }
    }

    #[test]
    fn where_nothing_fits_each_cap_the_smallest_layout_exceeds_is_named_with_the_shortfall() {
        // Every process over its cap, every rank within its own.
        let p = plan(
            vec![row(10_000_000, 80_000_000), row(20_000_000, 70_000_000)],
            caps(30_000_000, 60_000_000),
        );
        assert!(p.best().is_none());
        let said = nothing_fits(&p);
        assert!(
            said.contains("the smallest layout needs 0.07 GB in a process (its ranks and 0.05 GB beside them), 0.01 GB over the process cap of 0.06 GB (--memory-per-process)"),
            "{said}"
        );
        assert!(!said.contains("largest rank"), "{said}");
        // Both caps short: both named.
        let p = plan(
            vec![row(40_000_000, 80_000_000)],
            caps(30_000_000, 60_000_000),
        );
        let said = nothing_fits(&p);
        assert!(
            said.contains("largest rank") && said.contains("process cap"),
            "{said}"
        );
    }

    #[test]
    fn where_each_cap_alone_is_met_by_some_layout_but_none_meets_both_the_plan_says_so() {
        // One layout fits the ranks' cap, the other the process cap.
        let p = plan(
            vec![row(10_000_000, 80_000_000), row(40_000_000, 50_000_000)],
            caps(30_000_000, 60_000_000),
        );
        assert!(p.best().is_none());
        assert!(
            nothing_fits(&p).contains("no layout fits the rank cap and the process cap at once")
        );
    }
}
