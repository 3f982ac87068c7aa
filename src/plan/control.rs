//! A control run beside `--measure`'s: the profile's one-stage, one-graph run, made again
//! at the start of each round. The simulator predicts a layout from costs measured
//! minutes before; where the machine itself runs slower or faster by then (another
//! tenant of a shared host, a clock that moved), every measured step moves with it and
//! no model could have predicted it. The control's time against the profile's says by
//! how much, so a prediction's error can be read with the machine's drift taken out
//! beside the raw one.

use std::path::Path;

use super::machine::pass_seconds;
use super::profile::{Profile, ProfileRun};
use super::runs::{in_folder, RunKind};

/// The run repeated, and what it measured when profiled.
pub(super) struct Control<'a> {
    run: ProfileRun<'a>,
    micro_batch: usize,
    threads: usize,
    /// A micro-batch's forward and backward as one graph, when profiled.
    profiled: f64,
}

impl<'a> Control<'a> {
    /// The one-graph run of the smallest micro-batch profiled in one stage, unsplit
    /// (the most sensitive to the machine's overheads); `None` where there is none.
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
        let run = ProfileRun {
            worker,
            config,
            steps: p.steps.max(3),
            warmup: 2,
            global_batch,
            pipelines: false,
            shards: 1,
            stages: 1,
        };
        Some(Control {
            run,
            micro_batch: p.micro_batch,
            threads: p.threads,
            profiled: p.fused,
        })
    }

    /// The control's one graph now over when profiled (1.1: the machine runs 10% slower).
    ///
    /// # Errors
    /// Why the run failed.
    pub(super) fn drift(&self) -> Result<f64, String> {
        let key = (self.threads, self.micro_batch);
        let passes = in_folder(&self.run, key, RunKind::Fused, |dir| {
            pass_seconds(&dir.join("trace.json"), self.run.warmup)
        })?;
        Ok((passes.forward + passes.backward) / self.profiled)
    }

    /// Micro-batch samples of the control run.
    pub(super) fn micro_batch(&self) -> usize {
        self.micro_batch
    }
}

/// The median of `values` (`None` for none).
pub(super) fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (n > 0).then(|| (v[(n - 1) / 2] + v[n / 2]) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_middle_pair_s_mean() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }
}
