//! A control beside `--measure`'s runs: the profile's own runs made again at the start
//! of each round, at every size profiled in one stage: the two-stage pipeline the
//! stages' own cost was calibrated against (where there is one: it runs on two cores,
//! as the measured layouts do), else the one-stage one-graph run. The simulator
//! predicts a layout from costs measured minutes before; where the machine itself runs
//! slower or faster by then (another tenant of a shared host, a clock that moved), every
//! measured step moves with it and no model could have predicted it. The control's steps
//! against the profile's say by how much (their median: one run alone was as noisy as
//! the drift it measured), so a prediction's error can be read with the machine's drift
//! taken out beside the raw one.

use std::path::Path;

use super::passes::pass_seconds;
use super::profile::{Profile, ProfileRun};
use super::runs::{in_folder, RunKind};
use crate::cost::Family;

/// The runs repeated, and what each measured when profiled.
pub(super) struct Control<'a> {
    runs: Vec<Repeated<'a>>,
}

/// One of the profile's runs made again.
struct Repeated<'a> {
    run: ProfileRun<'a>,
    kind: RunKind,
    micro_batch: usize,
    threads: usize,
    /// Its seconds when profiled: the pipeline's step, or a micro-batch's forward and
    /// backward as one graph.
    profiled: f64,
}

impl<'a> Control<'a> {
    /// The runs of every micro-batch profiled in one stage, unsplit: each size's
    /// two-stage pipeline where it was made, else its one graph; `None` where there is
    /// none. One run is as noisy as any measured layout's; their median is steadier.
    pub(super) fn of(
        profiles: &[Profile],
        worker: &'a Path,
        config: &'a Path,
        global_batch: usize,
    ) -> Option<Control<'a>> {
        let runs: Vec<Repeated<'a>> = profiles
            .iter()
            .filter(|p| p.shards == 1 && p.stages == 1 && p.fused > 0.0)
            .map(|p| Repeated::of(p, worker, config, global_batch))
            .collect();
        (!runs.is_empty()).then_some(Control { runs })
    }

    /// The runs' time now over when profiled, their median (1.1: the machine runs 10%
    /// slower).
    ///
    /// # Errors
    /// Why every run failed.
    pub(super) fn drift(&self) -> Result<f64, String> {
        let mut ratios = Vec::new();
        let mut failed = None;
        for r in &self.runs {
            match r.drift() {
                Ok(d) => ratios.push(d),
                Err(e) => failed = Some(e),
            }
        }
        super::rounds::median(&ratios).ok_or_else(|| failed.unwrap_or_default())
    }

    /// What the control runs, for the report.
    pub(super) fn name(&self) -> String {
        let mut kinds: Vec<String> = self.runs.iter().map(Repeated::kind_name).collect();
        kinds.dedup();
        let sizes: Vec<String> = self
            .runs
            .iter()
            .map(|r| r.micro_batch.to_string())
            .collect();
        format!(
            "{}, micro-batches of {}: their median",
            kinds.join(" or "),
            sizes.join(", ")
        )
    }
}

impl<'a> Repeated<'a> {
    /// `p`'s two-stage pipeline where it was made (ZB-H1's, not made for a lone
    /// micro-batch, else V-Half's), else its one graph.
    fn of(p: &Profile, worker: &'a Path, config: &'a Path, global_batch: usize) -> Repeated<'a> {
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
        Repeated {
            run,
            kind,
            micro_batch: p.micro_batch,
            threads: p.threads,
            profiled,
        }
    }

    /// Its time now over when profiled.
    fn drift(&self) -> Result<f64, String> {
        let key = (self.threads, self.micro_batch);
        let passes = in_folder(&self.run, key, self.kind, |dir| {
            pass_seconds(&dir.join("trace.json"), self.run.warmup)
        })?;
        Ok(match self.kind {
            RunKind::Pipeline(_) => passes.period,
            _ => passes.forward + passes.backward,
        } / self.profiled)
    }

    fn kind_name(&self) -> String {
        match self.kind {
            RunKind::Pipeline(f) => format!("{} on two ranks", f.run().0.name()),
            _ => "one stage, one graph".to_string(),
        }
    }
}
