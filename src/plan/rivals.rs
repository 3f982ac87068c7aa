//! Layouts with cuts not chosen by time, simulated with the same costs: the one a user
//! would write by default, and the fastest pipeline layout cut by parameters or FLOPs.

use crate::config::TrainConfig;
use crate::graph::BalanceBy;

use super::{PlanOptions, PlanRow, Profiles, Sharded};
use crate::cost::{cut_names, simulate_on_nodes, Candidate, Cuts, Machinery, Nodes};

/// What simulating a layout with given cuts needs.
pub(super) struct Fixed<'a> {
    pub cfg: &'a TrainConfig,
    /// The model at each tensor-shard count.
    pub models: &'a [Sharded],
    pub machinery: &'a Machinery,
    /// By (tensor shards, micro-batch).
    pub profiles: &'a Profiles,
    /// The cluster's nodes, where the workers span several.
    pub nodes: Option<&'a Nodes>,
    /// What each process holds beside its ranks.
    pub process_base: &'a super::process::ProcessBase,
}

impl Fixed<'_> {
    /// Every worker a pipeline rank, 1F1B, as many micro-batches as ranks (or the next
    /// count that divides the global batch), cuts by parameter count.
    pub fn default_row(&self, opts: &PlanOptions<'_>) -> Option<PlanRow> {
        let pp = opts.workers;
        let global = self.cfg.global_batch();
        let m = (pp..=opts.max_micro_batches.max(pp)).find(|m| global % m == 0)?;
        let c = Candidate::one_f_one_b((1, 1, pp), (m, global / m));
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
        let p = self.profiles.get(&(c.tp, c.micro_batch))?;
        let model = self.models.iter().find(|m| m.tp == c.tp)?;
        let stages = c.stages();
        let bounds = model.balanced_bounds(stages, by)?;
        let on = (self.machinery, self.nodes);
        let sim = simulate_on_nodes(c, p, model.costs(), on, Cuts::Fixed(bounds))?;
        let cuts = cut_names(&model.tg, &model.cut.live, &sim.bounds);
        let scale = c.micro_batch as f64 / self.cfg.batch_size as f64;
        let applied = c.apply(self.cfg, &cuts);
        let peak = crate::train::rank_bytes(&model.tg, &applied, scale).unwrap_or_default();
        let processes = super::process::process_peaks(c, &peak, self.process_base, self.nodes);
        Some(PlanRow {
            candidate: c.clone(),
            cuts,
            simulated: sim,
            peak,
            processes,
        })
    }
}
