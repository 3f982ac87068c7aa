//! `partition = { balanced = { by = "time" } }` as `train` runs it: where the profile
//! holds the passes apart (`pipetrain plan --save-profile` writes them), the cuts that
//! the plan itself would choose for this layout, the linear partition of the nodes' times
//! moved while the schedule's simulated step gets shorter ([`super::stages`]); otherwise
//! the linear partition alone.

use std::path::Path;

use crate::config::TrainConfig;
use crate::graph::{Partition, TrainingGraph};
use crate::{Error, Result};

use super::stages::Cuttable;
use super::{cut_names, node_values, simulate_on_nodes, Candidate, Cuts, SavedProfile};
use crate::graph::BalanceBy;

/// The partition `cfg` cuts `tg` by.
///
/// # Errors
/// `Config` when `pipeline.profile` cannot be read again or its costs are malformed.
pub fn partition(tg: &TrainingGraph, cfg: &TrainConfig) -> Result<Partition> {
    let linear = cfg.partition();
    let (Partition::Weighted { .. }, Some(file)) = (&linear, &cfg.pipeline.profile) else {
        return Ok(linear);
    };
    let saved = read(file)?;
    let Some(costs) = &saved.costs else {
        tracing::info!(
            "{}: no costs by pass (written before they were saved): stages balanced by the \
             nodes' times alone",
            file.display()
        );
        return Ok(linear);
    };
    let profile = costs.profile(tg, &saved.times, cfg.batch_size);
    let cut = Cuttable::of(tg).measured_at(cfg.batch_size);
    let values = node_values(tg);
    let layout = Candidate::of(cfg);
    // Refined from the cuts by time, by parameters and by FLOPs: the moves are local.
    let starts = [BalanceBy::Params, BalanceBy::Flops]
        .into_iter()
        .filter_map(|by| cut.balanced_bounds(tg, layout.stages(), by))
        .collect();
    let on = (&costs.machinery, None);
    let simulated = simulate_on_nodes(
        &layout,
        &profile,
        (&cut, &values),
        on,
        Cuts::Refined(starts),
    );
    match simulated.filter(|s| !s.bounds.is_empty()) {
        Some(s) => {
            let cuts = cut_names(tg, &cut.live, &s.bounds);
            tracing::info!(
                "stages cut at {cuts:?}: balanced by time on the schedule's critical path \
                 (simulated step {:.4} s)",
                s.step
            );
            Ok(Partition::CutAt(cuts))
        }
        None => Ok(linear),
    }
}

/// The saved profile in `file`.
fn read(file: &Path) -> Result<SavedProfile> {
    let text = std::fs::read(file).map_err(Error::io(file))?;
    serde_json::from_slice(&text).map_err(|e| Error::Config {
        path: file.to_path_buf(),
        field: "costs".into(),
        rule: format!("not a profile `pipetrain plan --save-profile` writes: {e}"),
    })
}
