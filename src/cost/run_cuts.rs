//! Where a profile's pipeline runs cut the model: balanced by the nodes' measured times,
//! as the planned layouts are cut, not by FLOPs.
//!
//! Each family's stage cost is calibrated on one run of its own (`plan::calibrate`), and a
//! stage's nodes cost what the whole model's profile says only to within about 10%,
//! stage by stage and cut by cut. On the peers' tiny GPT, V-Half's input-gradient passes
//! ran at 0.94-1.01 of their nodes' time cut by time and at 1.07-1.12 cut by FLOPs
//! (traced, three runs each in turn); calibrated on the FLOPs cut, every V layout the
//! plan cut by time came out 7-12% slow. The cut balanced by node times alone is not the
//! plan's own (that one moves while the simulated step falls, on costs this calibration
//! sets), but it is its start, and the nearest cut that does not depend on the result.

use crate::graph::TrainingGraph;

use super::stages::{even_bounds, Cuttable};
use super::{cut_names, Family, Profile, RunCut};

/// The cuts of `tg` for every stage count a profile's pipeline runs take
/// ([`Family::run`] on two ranks, and the one-rank run of two stages), balanced by its
/// nodes' shares of the profiler's `forward` and `backward`, each pass scaled to its
/// measured seconds, `seconds` (the profiler gives only shares, and slows the two passes
/// unevenly). A stage count whose even cut hands nothing on is left to FLOPs.
pub fn run_cuts(
    tg: &TrainingGraph,
    (forward, backward): (&[f64], &[f64]),
    seconds: (f64, f64),
) -> Vec<RunCut> {
    let mut profile = Profile {
        forward: forward.to_vec(),
        backward: backward.to_vec(),
        ..Profile::default()
    };
    profile.scale_passes_to(seconds.0, seconds.1);
    let cut = Cuttable::of(tg);
    let mut counts: Vec<usize> = Family::ALL.iter().map(|f| f.run_stages()).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
        .into_iter()
        .filter_map(|stages| {
            let bounds = even_bounds(&profile, &cut, stages);
            let whole = bounds.len() + 1 == stages && cut.hands_on(&bounds);
            whole.then(|| RunCut {
                stages,
                names: cut_names(tg, &cut.live, &bounds),
                bounds,
            })
        })
        .collect()
}
