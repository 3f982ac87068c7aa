//! Layouts with cuts not chosen by time, simulated with the same costs: the one a user
//! would write by default, and the fastest pipeline layout cut by parameters or FLOPs.

use std::collections::BTreeMap;

use crate::config::{ScheduleKind, TrainConfig};
use crate::graph::{assign_stages, BalanceBy, Partition, Recompute, TrainingGraph};

use super::costs::Cuttable;
use super::search::{cut_names, simulate_candidate, Candidate, Machinery};
use super::{PlanOptions, PlanRow, Profile};

/// What simulating a layout with given cuts needs.
pub(super) struct Fixed<'a> {
    pub cfg: &'a TrainConfig,
    pub tg: &'a TrainingGraph,
    pub cut: &'a Cuttable,
    pub values: &'a [f64],
    pub machinery: &'a Machinery,
    pub profiles: &'a BTreeMap<usize, Profile>,
}

impl Fixed<'_> {
    /// Every worker a pipeline rank, 1F1B, as many micro-batches as ranks (or the next
    /// count that divides the global batch), cuts by parameter count.
    pub fn default_row(&self, opts: &PlanOptions<'_>) -> Option<PlanRow> {
        let pp = opts.workers;
        let global = self.cfg.global_batch();
        let m = (pp..=opts.max_micro_batches.max(pp)).find(|m| global % m == 0)?;
        let c = Candidate {
            dp: 1,
            pp,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            micro_batches: m,
            micro_batch: global / m,
            recompute: Recompute::None,
        };
        self.row(&c, BalanceBy::Params)
    }

    /// `c` with its cuts balanced by parameters, and by FLOPs.
    pub fn cut_rivals(&self, c: &Candidate) -> Vec<(&'static str, PlanRow)> {
        [("params", BalanceBy::Params), ("flops", BalanceBy::Flops)]
            .into_iter()
            .filter_map(|(name, by)| Some((name, self.row(c, by)?)))
            .collect()
    }

    /// `c` cut by `by`, simulated.
    fn row(&self, c: &Candidate, by: BalanceBy) -> Option<PlanRow> {
        let p = self.profiles.get(&c.micro_batch)?;
        let stages = c.stages();
        let a = assign_stages(self.tg, &Partition::Balanced { stages, by }).ok()?;
        let live = &self.cut.live;
        let bounds: Vec<usize> = (1..stages)
            .filter_map(|s| live.iter().position(|&i| a.stage[i] == Some(s)))
            .collect();
        let sim = simulate_candidate(c, p, (self.cut, self.values), self.machinery, Some(bounds))?;
        let cuts = cut_names(self.tg, live, &sim.bounds);
        let scale = c.micro_batch as f64 / self.cfg.batch_size as f64;
        let peak =
            crate::train::rank_bytes(self.tg, &c.apply(self.cfg, &cuts), scale).unwrap_or_default();
        Some(PlanRow {
            candidate: c.clone(),
            cuts,
            simulated: sim,
            peak,
        })
    }
}
