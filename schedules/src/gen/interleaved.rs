//! Interleaved 1F1B: several stages per rank, placed round-robin.

use super::looped::{rank_ops, Backward, Looped};
use crate::schedule::looped_placement;
use crate::{Schedule, ScheduleError};

/// Interleaved 1F1B (Narayanan et al. 2021, section 2.2), as PyTorch's
/// `ScheduleInterleaved1F1B`: `ranks * virtual_stages` stages, stage `s` on rank
/// `s % ranks`. Micro-batches go through a rank's chunks in rounds of
/// `micro_batches / rounds`, with `rounds = max(1, micro_batches / ranks)`; rank `r` warms
/// up with `(virtual_stages - 1) * per_round + 2 * (ranks - 1 - r)` forwards (capped at
/// all of them), then alternates forward and backward, depth first.
///
/// When `micro_batches` is a multiple of `ranks` this is Megatron's schedule. With equal
/// per-chunk costs and free transfers each rank idles `(ranks - 1) * (F + B)` of chunk time
/// for any `micro_batches >= ranks`, `1/virtual_stages` of 1F1B's bubble for the same model;
/// with fewer micro-batches than ranks, `(virtual_stages - 1) * (ranks - micro_batches) *
/// (F + B)` more. Counts that are not a multiple of `ranks` follow PyTorch's relaxed rule.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] for a zero parameter;
/// [`ScheduleError::MicroBatchesNotMultipleOfRounds`] when `micro_batches % rounds != 0`
/// (PyTorch refuses the same).
pub fn interleaved_1f1b(
    ranks: usize,
    virtual_stages: usize,
    micro_batches: usize,
) -> Result<Schedule, ScheduleError> {
    const CONTEXT: &str = "interleaved_1f1b";
    super::require_positive(
        CONTEXT,
        &[
            ("ranks", ranks),
            ("virtual_stages", virtual_stages),
            ("micro_batches", micro_batches),
        ],
    )?;
    let rounds = (micro_batches / ranks).max(1);
    if micro_batches % rounds != 0 {
        return Err(ScheduleError::MicroBatchesNotMultipleOfRounds {
            context: CONTEXT,
            micro_batches,
            ranks,
            rounds,
        });
    }
    let shape = Looped {
        ranks,
        virtual_stages,
        micro_batches,
        per_round: micro_batches / rounds,
    };
    let lists = (0..ranks)
        .map(|r| {
            // Two per hop: the first backward reaches rank r a forward and a backward per
            // downstream rank after the last stage's first forward.
            let warmup = (virtual_stages - 1) * shape.per_round + 2 * (ranks - 1 - r);
            rank_ops(&shape, r, warmup, Backward::Full)
        })
        .collect();
    Schedule::new(
        looped_placement(ranks, virtual_stages),
        micro_batches,
        lists,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_uneven_rounds() {
        // 9 micro-batches on 4 ranks: 2 rounds of 4.5.
        assert_eq!(
            interleaved_1f1b(4, 2, 9),
            Err(ScheduleError::MicroBatchesNotMultipleOfRounds {
                context: "interleaved_1f1b",
                micro_batches: 9,
                ranks: 4,
                rounds: 2,
            })
        );
        assert!(interleaved_1f1b(4, 2, 10).is_ok());
        assert!(interleaved_1f1b(4, 2, 3).is_ok());
    }

    #[test]
    fn two_ranks_two_chunks_four_micro_batches() {
        // Worked by hand through PyTorch's `_calculate_single_rank_operations` (padding
        // dropped): per_round = 2, warm-up 4 on rank 0 and 2 on rank 1.
        let s = interleaved_1f1b(2, 2, 4).unwrap();
        let text: Vec<String> = s.ranks()[1].iter().map(|a| a.to_string()).collect();
        assert_eq!(
            text.join(" "),
            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
        );
    }
}
