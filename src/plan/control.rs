//! A control run beside `--measure`'s: one of the profile's runs made again at the start
//! of each round, the two-stage pipeline the stages' own cost was calibrated against
//! (where there is one: it runs on two cores, as the measured layouts do), else the
//! one-stage one-graph run. The simulator predicts a layout from costs measured minutes
//! before; where the machine itself runs slower or faster by then (another tenant of a
//! shared host, a clock that moved), every measured step moves with it and no model
//! could have predicted it. The control's step against the profile's says by how much,
//! so a prediction's error can be read with the machine's drift taken out beside the
//! raw one.

use std::path::Path;

use super::machine::pass_seconds;
use super::profile::{Profile, ProfileRun};
use super::runs::{in_folder, RunKind};
use crate::cost::Family;

/// The run repeated, and what it measured when profiled.
pub(super) struct Control<'a> {
    run: ProfileRun<'a>,
    kind: RunKind,
    micro_batch: usize,
    threads: usize,
    /// Its seconds when profiled: the pipeline's step, or a micro-batch's forward and
    /// backward as one graph.
    profiled: f64,
}

impl<'a> Control<'a> {
    /// The run of the smallest micro-batch profiled in one stage, unsplit (the most
    /// sensitive to the machine's overheads): its two-stage pipeline where it was made,
    /// else its one graph; `None` where there is neither.
    pub(super) fn of(
        profiles: &[Profile],
        worker: &'a Path,
        config: &'a Path,
        global_batch: usize,
    ) -> Option<Control<'a>> {
        let p = profiles
            .iter()
            .filter(|p| p.shards == 1 && p.stages == 1 && p.fused > 0.0)
            .min_by_key(|p| p.micro_batch)?;
        // ZB-H1's where it ran (not for a lone micro-batch), else V-Half's.
        let made = [Family::Split, Family::V]
            .into_iter()
            .find(|&f| p.periods[f] > 0.0);
        let (kind, profiled) = match made {
            Some(f) => (RunKind::Pipeline(f), p.periods[f]),
            None => (RunKind::Fused, p.fused),
        };
        let run = ProfileRun {
            worker,
            config,
            steps: p.steps.max(3),
            warmup: 2,
            global_batch,
            pipelines: made.is_some(),
            shards: 1,
            stages: 1,
        };
        Some(Control {
            run,
            kind,
            micro_batch: p.micro_batch,
            threads: p.threads,
            profiled,
        })
    }

    /// The control's time now over when profiled (1.1: the machine runs 10% slower).
    ///
    /// # Errors
    /// Why the run failed.
    pub(super) fn drift(&self) -> Result<f64, String> {
        let key = (self.threads, self.micro_batch);
        let passes = in_folder(&self.run, key, self.kind, |dir| {
            pass_seconds(&dir.join("trace.json"), self.run.warmup)
        })?;
        Ok(match self.kind {
            RunKind::Pipeline(_) => passes.period,
            _ => passes.forward + passes.backward,
        } / self.profiled)
    }

    /// What the control runs, for the report.
    pub(super) fn name(&self) -> String {
        let what = match self.kind {
            RunKind::Pipeline(f) => format!("{} on two ranks", f.run().0.name()),
            _ => "one stage, one graph".to_string(),
        };
        format!("{what}, micro-batches of {}", self.micro_batch)
    }
}
