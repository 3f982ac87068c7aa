//! The families of schedules whose stage actions pay alike beside their nodes, each
//! calibrated on a two-rank run of its own ([`Family::run`]).
//!
//! A stage's action costs more than its nodes' profiled time: its own session run, the
//! values it receives and keeps. How much depends on the schedule. Where the backward is
//! not split the last stage runs forward and backward as one graph; where a rank holds
//! two stages each action does half the work for the same session overhead, and the
//! machine's caches hold two stages' weights. Calibrated on GPipe alone, interleaved
//! 1F1B came out 20-33% slow on the BERT, ViT and Llama fixtures; calibrated on ZB-H1,
//! V-Min 13-20% slow.

use std::ops::{Index, IndexMut};

use serde::{Deserialize, Serialize};

use crate::config::ScheduleKind;

/// A family of schedules whose stage actions pay alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// One stage a rank, the backward in one pass (GPipe, 1F1B).
    Unsplit,
    /// One stage a rank, the backward split (ZB-H1).
    Split,
    /// Several stages a rank, the backward in one pass (interleaved 1F1B).
    Interleaved,
    /// Two stages a rank in a V, the backward split (ZB-V, DualPipeV, V-Half, V-Min).
    V,
}

impl Family {
    /// Every family, in [`PerFamily`]'s order.
    pub const ALL: [Family; 4] = [
        Family::Unsplit,
        Family::Split,
        Family::Interleaved,
        Family::V,
    ];

    /// The family of `kind`.
    pub fn of(kind: ScheduleKind) -> Family {
        match kind {
            k if k.v_shaped() => Family::V,
            ScheduleKind::ZbH1 => Family::Split,
            ScheduleKind::Interleaved1f1b => Family::Interleaved,
            _ => Family::Unsplit,
        }
    }

    /// The two-rank run this family is calibrated on, and its stages a rank (where the
    /// schedule takes them).
    pub fn run(self) -> (ScheduleKind, usize) {
        match self {
            Family::Unsplit => (ScheduleKind::Gpipe, 1),
            Family::Split => (ScheduleKind::ZbH1, 1),
            Family::Interleaved => (ScheduleKind::Interleaved1f1b, 2),
            Family::V => (ScheduleKind::VHalf, 1),
        }
    }

    /// The stages of its run ([`Family::run`] on two ranks).
    pub fn run_stages(self) -> usize {
        let (schedule, virtual_stages) = self.run();
        schedule.stages(2, virtual_stages)
    }

    /// Whether its run can take `micro_batches` a step on two ranks (ZB-H1 needs one a
    /// stage).
    pub fn runs(self, micro_batches: usize) -> bool {
        self != Family::Split || micro_batches >= 2
    }

    /// Whether its stages split the backward.
    pub fn splits_backward(self) -> bool {
        matches!(self, Family::Split | Family::V)
    }

    /// The families whose calibration stands in for this one's where it has none, the
    /// nearest first: the other depth of the same backward, then the other backward.
    pub fn stand_ins(self) -> [Family; 3] {
        match self {
            Family::Unsplit => [Family::Interleaved, Family::Split, Family::V],
            Family::Split => [Family::V, Family::Unsplit, Family::Interleaved],
            Family::Interleaved => [Family::Unsplit, Family::V, Family::Split],
            Family::V => [Family::Split, Family::Interleaved, Family::Unsplit],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A value for each [`Family`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PerFamily<T = f64>(pub [T; 4]);

impl<T> Index<Family> for PerFamily<T> {
    type Output = T;
    fn index(&self, f: Family) -> &T {
        &self.0[f.index()]
    }
}

impl<T> IndexMut<Family> for PerFamily<T> {
    fn index_mut(&mut self, f: Family) -> &mut T {
        &mut self.0[f.index()]
    }
}

impl<T: Copy> PerFamily<T> {
    /// The same `value` for every family.
    pub fn all(value: T) -> PerFamily<T> {
        PerFamily([value; 4])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_schedule_is_in_the_family_whose_run_has_its_shape() {
        for kind in ScheduleKind::ALL {
            let f = Family::of(kind);
            let (run, v) = f.run();
            assert_eq!(f.splits_backward(), kind.splits_backward(), "{kind:?}");
            assert_eq!(run.v_shaped(), kind.v_shaped(), "{kind:?}");
            assert_eq!(
                run.stages(2, v) > 2,
                kind.stages(2, 2) > 2,
                "{kind:?}: a rank holds several stages in both or neither"
            );
            assert_eq!(Family::of(run), f);
        }
        for f in Family::ALL {
            assert!(!f.stand_ins().contains(&f));
        }
    }
}
