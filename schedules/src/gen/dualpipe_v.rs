//! DualPipeV: DeepSeek's DualPipe cut in half, on the V placement.

use std::collections::VecDeque;

use crate::ir::Action;
use crate::schedule::v_placement;
use crate::{Schedule, ScheduleError};

/// DualPipeV (DeepSeek, `dualpipe/dualpipev.py`; Sea AI's "cut-in-half" DualPipe):
/// `2 * ranks` stages on the V placement (rank `r` holds stages `r` and
/// `2 * ranks - 1 - r`, as [`crate::zb_v`]), in the reference's eight phases per rank:
///
/// 1. `2 (p - r - 1)` forwards of the first chunk;
/// 2. `r + 1` pairs: a first-chunk forward, a second-chunk forward;
/// 3. `p - r - 1` triples: a second-chunk input-gradient backward (its weight-gradient
///    part deferred), the oldest deferred weight gradient, a second-chunk forward;
/// 4. the main phase, `m - 2p + r + 1` rounds of a first-chunk forward with a
///    second-chunk backward, then a second-chunk forward with a first-chunk backward;
/// 5. `p - r - 1` rounds of a second-chunk backward, then a second-chunk forward with a
///    first-chunk backward;
/// 6. `r + 1` pairs of backwards (second chunk, first chunk), their weight gradients
///    deferred from the middle pair on (the reference's `enable_zb` switch);
/// 7. `p - r - 1` pairs: a deferred weight gradient, a first-chunk backward (deferred);
/// 8. the deferred weight gradients that remain.
///
/// The reference overlaps a forward with a backward of the other chunk
/// (`_forward_backward_chunk`); a rank here runs one action at a time, so the pair runs
/// forward first. A backward the reference runs whole is an input-gradient part followed
/// at once by its weight-gradient part, so that every backward of the schedule is split
/// and a stage keeps one set of backward graphs.
///
/// # Errors
/// [`ScheduleError::ZeroParameter`] for a zero parameter;
/// [`ScheduleError::TooFewMicroBatches`] when `micro_batches < 2 * ranks` (the
/// reference's own assertion).
pub fn dualpipe_v(ranks: usize, micro_batches: usize) -> Result<Schedule, ScheduleError> {
    const CONTEXT: &str = "dualpipe_v";
    super::require_positive(
        CONTEXT,
        &[("ranks", ranks), ("micro_batches", micro_batches)],
    )?;
    let required = 2 * ranks;
    if micro_batches < required {
        return Err(ScheduleError::TooFewMicroBatches {
            context: CONTEXT,
            micro_batches,
            required,
            rule: "DualPipeV fills both chunks of every rank: 2 * ranks micro-batches",
        });
    }
    let lists = (0..ranks)
        .map(|r| Rank::new(ranks, r).actions(micro_batches))
        .collect();
    Schedule::new(v_placement(ranks), micro_batches, lists)
}

/// One rank's list as it is built: its two stages, the next micro-batch of each chunk's
/// forward and backward, and the weight gradients deferred, oldest first.
struct Rank {
    p: usize,
    r: usize,
    stage: [usize; 2],
    forwards: [usize; 2],
    backwards: [usize; 2],
    deferred: VecDeque<Action>,
    list: Vec<Action>,
}

impl Rank {
    fn new(p: usize, r: usize) -> Rank {
        Rank {
            p,
            r,
            stage: [r, 2 * p - 1 - r],
            forwards: [0; 2],
            backwards: [0; 2],
            deferred: VecDeque::new(),
            list: Vec::new(),
        }
    }

    fn forward(&mut self, chunk: usize) {
        let mb = self.forwards[chunk];
        self.forwards[chunk] += 1;
        self.list.push(Action::forward(self.stage[chunk], mb));
    }

    /// A backward of `chunk`: its weight-gradient part deferred (`defer`) or right after.
    fn backward(&mut self, chunk: usize, defer: bool) {
        let (stage, mb) = (self.stage[chunk], self.backwards[chunk]);
        self.backwards[chunk] += 1;
        self.list.push(Action::backward_input(stage, mb));
        let weight = Action::backward_weight(stage, mb);
        match defer {
            true => self.deferred.push_back(weight),
            false => self.list.push(weight),
        }
    }

    fn weight(&mut self) {
        if let Some(w) = self.deferred.pop_front() {
            self.list.push(w);
        }
    }

    /// The reference's `_forward_backward_chunk(f, b)`: one chunk's forward, the other's
    /// whole backward.
    fn forward_backward(&mut self, f: usize, b: usize) {
        self.forward(f);
        self.backward(b, false);
    }

    fn actions(mut self, m: usize) -> Vec<Action> {
        let (p, r) = (self.p, self.r);
        for _ in 0..2 * (p - r - 1) {
            self.forward(0);
        }
        for _ in 0..r + 1 {
            self.forward(0);
            self.forward(1);
        }
        for _ in 0..p - r - 1 {
            self.backward(1, true);
            self.weight();
            self.forward(1);
        }
        for _ in 0..m - 2 * p + r + 1 {
            self.forward_backward(0, 1);
            self.forward_backward(1, 0);
        }
        for _ in 0..p - r - 1 {
            self.backward(1, false);
            self.forward_backward(1, 0);
        }
        let pairs = r + 1;
        let mut defer = false;
        for i in 0..pairs {
            if i == pairs / 2 && r % 2 == 1 {
                defer = true;
            }
            self.backward(1, defer);
            if i == pairs / 2 && r % 2 == 0 {
                defer = true;
            }
            self.backward(0, defer);
        }
        for _ in 0..p - r - 1 {
            self.weight();
            self.backward(0, true);
        }
        while !self.deferred.is_empty() {
            self.weight();
        }
        self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ActionKind;

    #[test]
    fn every_micro_batch_runs_once_in_each_pass_of_each_stage() {
        for p in 1..=4 {
            for m in 2 * p..=2 * p + 5 {
                let s = dualpipe_v(p, m).unwrap();
                assert_eq!(s.stages(), 2 * p);
                for kind in [
                    ActionKind::Forward,
                    ActionKind::BackwardInput,
                    ActionKind::BackwardWeight,
                ] {
                    let n = s
                        .ranks()
                        .iter()
                        .flatten()
                        .filter(|a| a.kind() == kind)
                        .count();
                    assert_eq!(n, 2 * p * m, "p={p} m={m} {kind:?}");
                }
            }
        }
        assert!(matches!(
            dualpipe_v(2, 3),
            Err(ScheduleError::TooFewMicroBatches { required: 4, .. })
        ));
    }
}
