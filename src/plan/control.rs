//! A control beside `--measure`'s runs: the profile's own runs made again at the start
//! of each round and after the last, at every size profiled in one stage: the two-stage
//! pipeline the stages' own cost was calibrated against, cut where the profile cut it
//! (where there is one: it runs on two cores, as the measured layouts do), else the
//! one-stage one-graph run. The simulator predicts a layout from costs measured minutes
//! before; where the machine itself runs slower or faster by then (another tenant of a
//! shared host, a clock that moved), every measured step moves with it and no model
//! could have predicted it. The control's steps against the profile's say by how much
//! (their median: one run alone was as noisy as the drift it measured), so a
//! prediction's error can be read with the machine's drift taken out beside the raw
//! one: their median for every run, or each round's own, interpolated between the
//! controls either side of it (`drift_at`).

use std::path::Path;

use super::passes::pass_seconds;
use super::profile::{Profile, ProfileRun};
use super::runs::{in_folder, RunKind};
use crate::cost::Family;

/// A value measured, and when: seconds from the first round's start to the middle of
/// its run (a measured step, or the control's drift).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Timed {
    pub value: f64,
    pub at: f64,
}

/// The control's drift at `at` seconds: interpolated between the controls either side
/// of it, the nearest one's beyond them; `None` without any.
pub(super) fn drift_at(controls: &[Timed], at: f64) -> Option<f64> {
    let after = controls.iter().position(|c| c.at >= at);
    match after {
        Some(0) => controls.first().map(|c| c.value),
        Some(i) => {
            let (a, b) = (controls[i - 1], controls[i]);
            let share = (at - a.at) / (b.at - a.at).max(f64::MIN_POSITIVE);
            Some(a.value + (b.value - a.value) * share)
        }
        None => controls.last().map(|c| c.value),
    }
}

/// The median of `seen`'s steps, each divided by the drift at its time; `None` without
/// `drifts`.
pub(super) fn steady_median(seen: &[Timed], drifts: &[Timed]) -> Option<f64> {
    let steady: Option<Vec<f64>> = seen
        .iter()
        .map(|s| drift_at(drifts, s.at).map(|d| s.value / d))
        .collect();
    super::rounds::median(&steady?)
}

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
        profiles: &'a [Profile],
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
    fn of(p: &'a Profile, worker: &'a Path, config: &'a Path, global_batch: usize) -> Repeated<'a> {
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
            cuts: &p.run_cuts,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_is_read_against_the_drift_at_its_own_time() {
        let at = |value: f64, at: f64| Timed { value, at };
        // The machine 20% slower ten seconds in, and so it stayed.
        let controls = [at(1.0, 0.0), at(1.2, 10.0), at(1.2, 20.0)];
        assert_eq!(drift_at(&controls, 5.0), Some(1.1));
        assert_eq!(drift_at(&controls, -1.0), Some(1.0));
        assert_eq!(drift_at(&controls, 30.0), Some(1.2));
        assert_eq!(drift_at(&[], 5.0), None);
        // A run of 1 ms measured halfway into the slow-down, then in it: each round is
        // 1 ms with its own drift out, where one drift for all would misread both.
        let rounds = [at(1.1e-3, 5.0), at(1.2e-3, 15.0)];
        let steady = steady_median(&rounds, &controls).unwrap();
        assert!((steady - 1.0e-3).abs() < 1e-12, "{steady}");
        assert_eq!(steady_median(&rounds, &[]), None);
    }
}
