//! A schedule: one ordered action list per rank, and where each stage lives.

use serde::{Deserialize, Serialize};

use crate::ir::Action;
use crate::ScheduleError;

/// Per-rank ordered action lists for one optimizer step, with the stage-to-rank placement.
///
/// Without virtual stages rank `r` holds stage `r`; interleaved schedules place stage `s` on
/// rank `s % ranks`, and V-shaped ones fold the stages back. Construction checks the
/// structure (every action's stage exists, is placed on the rank whose list holds it, and
/// names an existing micro-batch); [`crate::validate`] checks that the order is runnable.
///
/// Serialises as `{"placement": [0, 1], "micro_batches": 2, "ranks": [["0F0", ...], ...]}`
/// and is checked again when deserialised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ScheduleRepr", into = "ScheduleRepr")]
pub struct Schedule {
    placement: Vec<usize>,
    micro_batches: usize,
    ranks: Vec<Vec<Action>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleRepr {
    placement: Vec<usize>,
    micro_batches: usize,
    ranks: Vec<Vec<Action>>,
}

impl TryFrom<ScheduleRepr> for Schedule {
    type Error = ScheduleError;
    fn try_from(r: ScheduleRepr) -> Result<Self, ScheduleError> {
        Schedule::new(r.placement, r.micro_batches, r.ranks)
    }
}

impl From<Schedule> for ScheduleRepr {
    fn from(s: Schedule) -> Self {
        ScheduleRepr {
            placement: s.placement,
            micro_batches: s.micro_batches,
            ranks: s.ranks,
        }
    }
}

impl Schedule {
    /// A schedule from its placement (`placement[stage]` is the rank holding `stage`), its
    /// micro-batch count and one action list per rank.
    ///
    /// # Errors
    /// [`ScheduleError::ZeroParameter`] for no stages, ranks or micro-batches;
    /// [`ScheduleError::PlacementOutOfRange`], [`ScheduleError::StageOutOfRange`],
    /// [`ScheduleError::MicroBatchOutOfRange`] and [`ScheduleError::WrongRank`] for
    /// actions or placements that do not fit together.
    pub fn new(
        placement: Vec<usize>,
        micro_batches: usize,
        ranks: Vec<Vec<Action>>,
    ) -> Result<Self, ScheduleError> {
        let zero = |parameter| ScheduleError::ZeroParameter {
            context: "schedule",
            parameter,
        };
        if placement.is_empty() {
            return Err(zero("stages"));
        }
        if micro_batches == 0 {
            return Err(zero("micro_batches"));
        }
        if ranks.is_empty() {
            return Err(zero("ranks"));
        }
        for (stage, &rank) in placement.iter().enumerate() {
            if rank >= ranks.len() {
                return Err(ScheduleError::PlacementOutOfRange {
                    stage,
                    rank,
                    ranks: ranks.len(),
                });
            }
        }
        for (rank, list) in ranks.iter().enumerate() {
            for (step, &action) in list.iter().enumerate() {
                let Some(&expected_rank) = placement.get(action.stage()) else {
                    return Err(ScheduleError::StageOutOfRange {
                        rank,
                        step,
                        action,
                        stages: placement.len(),
                    });
                };
                if action.micro_batch().is_some_and(|mb| mb >= micro_batches) {
                    return Err(ScheduleError::MicroBatchOutOfRange {
                        rank,
                        step,
                        action,
                        micro_batches,
                    });
                }
                if expected_rank != rank {
                    return Err(ScheduleError::WrongRank {
                        rank,
                        step,
                        action,
                        expected_rank,
                    });
                }
            }
        }
        Ok(Schedule {
            placement,
            micro_batches,
            ranks,
        })
    }

    /// `placement[stage]` is the rank that holds `stage`.
    pub fn placement(&self) -> &[usize] {
        &self.placement
    }
    /// Number of pipeline stages (virtual stages included).
    pub fn stages(&self) -> usize {
        self.placement.len()
    }
    /// Number of micro-batches in the step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }
    /// Number of ranks (action lists).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }
    /// Every rank's action list, in rank order.
    pub fn ranks(&self) -> &[Vec<Action>] {
        &self.ranks
    }
    /// The rank that holds `stage`, if the stage exists.
    pub fn rank_of(&self, stage: usize) -> Option<usize> {
        self.placement.get(stage).copied()
    }
    /// The stages `rank` holds, ascending.
    pub fn stages_of(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        self.placement
            .iter()
            .enumerate()
            .filter(move |&(_, &r)| r == rank)
            .map(|(s, _)| s)
    }
    /// Whether the schedule has explicit transfers (the output of [`crate::lower()`]); a
    /// schedule without them leaves every cross-rank hand-off implicit.
    pub fn is_lowered(&self) -> bool {
        self.ranks.iter().flatten().any(|a| a.kind().is_transfer())
    }
    /// The same schedule keeping only F, B, I and W: what [`crate::lower()`] takes.
    pub fn compute_only(&self) -> Schedule {
        Schedule {
            placement: self.placement.clone(),
            micro_batches: self.micro_batches,
            ranks: self
                .ranks
                .iter()
                .map(|l| {
                    l.iter()
                        .copied()
                        .filter(|a| a.kind().is_compute())
                        .collect()
                })
                .collect(),
        }
    }
    /// Hands back the action lists.
    pub fn into_ranks(self) -> Vec<Vec<Action>> {
        self.ranks
    }
}

/// Stage `s` on rank `s % ranks`: Megatron's and PyTorch's looped placement for
/// interleaved schedules (without virtual stages, stage `s` on rank `s`).
pub fn looped_placement(ranks: usize, virtual_stages: usize) -> Vec<usize> {
    (0..ranks * virtual_stages).map(|s| s % ranks).collect()
}

/// Two stages per rank folded into a V (ZB-V): stage `s < ranks` on rank `s`, stage
/// `s >= ranks` on rank `2 * ranks - 1 - s`, so the last rank holds the two middle stages
/// and rank 0 holds the first and the last.
pub fn v_placement(ranks: usize) -> Vec<usize> {
    (0..2 * ranks)
        .map(|s| if s < ranks { s } else { 2 * ranks - 1 - s })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_checks_structure() {
        let f = Action::forward;
        assert!(Schedule::new(vec![0, 1], 1, vec![vec![f(0, 0)], vec![f(1, 0)]]).is_ok());
        assert!(matches!(
            Schedule::new(vec![0, 1], 1, vec![vec![f(1, 0)], vec![]]),
            Err(ScheduleError::WrongRank {
                rank: 0,
                step: 0,
                expected_rank: 1,
                ..
            })
        ));
        assert!(matches!(
            Schedule::new(vec![0], 1, vec![vec![f(0, 1)]]),
            Err(ScheduleError::MicroBatchOutOfRange { step: 0, .. })
        ));
        assert!(matches!(
            Schedule::new(vec![0], 1, vec![vec![f(3, 0)]]),
            Err(ScheduleError::StageOutOfRange { stages: 1, .. })
        ));
        assert!(matches!(
            Schedule::new(vec![0, 2], 1, vec![vec![], vec![]]),
            Err(ScheduleError::PlacementOutOfRange { stage: 1, .. })
        ));
    }

    #[test]
    fn placements() {
        assert_eq!(looped_placement(2, 2), vec![0, 1, 0, 1]);
        assert_eq!(v_placement(3), vec![0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn deserialising_checks_structure() {
        let bad = r#"{"placement":[0],"micro_batches":1,"ranks":[["0F1"]]}"#;
        assert!(serde_json::from_str::<Schedule>(bad).is_err());
        let unknown = r#"{"placement":[0],"micro_batches":1,"ranks":[["0F0"]],"x":1}"#;
        assert!(serde_json::from_str::<Schedule>(unknown).is_err());
    }
}
