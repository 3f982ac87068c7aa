//! The per-rank order shared by the looped-placement schedules (interleaved 1F1B and
//! ZB-H1): a port of PyTorch pipelining's `_get_1f1b_rank_ops`.
//!
//! It differs in one way: PyTorch pads the lists with `None` so that steps line up in time
//! when printed; here a list is only an order, and time is the simulator's business.

use crate::ir::Action;

/// Shape of a looped schedule: stage `chunk * ranks + rank` is `rank`'s chunk `chunk`.
pub(super) struct Looped {
    pub(super) ranks: usize,
    pub(super) virtual_stages: usize,
    pub(super) micro_batches: usize,
    /// Micro-batches that go through one chunk before the rank moves to the next chunk.
    pub(super) per_round: usize,
}

/// How the backward is run.
pub(super) enum Backward {
    /// One `B` per (stage, micro-batch).
    Full,
    /// `I` in place of `B`; the matching `W`s follow in `I` order, each right after an `I`
    /// once `delay` `I`s have run past the warm-up, and the rest at the end. The delay is
    /// what fills the cool-down bubble with weight gradients.
    Split { delay: usize },
}

/// `rank`'s action list: `warmup` forwards, then (forward, backward) pairs, then the
/// remaining backwards; forwards walk the chunks upwards and backwards downwards, a round
/// of `per_round` micro-batches at a time.
pub(super) fn rank_ops(l: &Looped, rank: usize, warmup: usize, backward: Backward) -> Vec<Action> {
    let v = l.virtual_stages;
    let ops = v * l.micro_batches;
    let warmup = warmup.min(ops);
    let steady = ops - warmup;
    let stage = |chunk: usize| chunk * l.ranks + rank;
    let fwd_chunk = |op: usize| (op / l.per_round) % v;
    let bwd_chunk = |op: usize| v - 1 - ((op - warmup) / l.per_round) % v;

    let mut next_f = vec![0; v];
    let mut next_b = vec![0; v];
    let mut next_w = vec![0; v];
    // Chunks of the backwards run so far, in order, so the Ws can follow them.
    let mut backward_chunks = Vec::with_capacity(ops);
    let mut weights_done = 0;
    let mut list = Vec::with_capacity(3 * ops);

    let take = |counter: &mut Vec<usize>, chunk: usize| {
        let mb = counter[chunk];
        counter[chunk] += 1;
        mb
    };
    for op in 0..warmup + steady + warmup {
        if op < warmup + steady {
            let c = fwd_chunk(op);
            list.push(Action::forward(stage(c), take(&mut next_f, c)));
        }
        if op < warmup {
            continue;
        }
        let c = bwd_chunk(op);
        let mb = take(&mut next_b, c);
        match backward {
            Backward::Full => list.push(Action::backward(stage(c), mb)),
            Backward::Split { delay } => {
                list.push(Action::backward_input(stage(c), mb));
                backward_chunks.push(c);
                if op - warmup >= delay {
                    let wc = backward_chunks[weights_done];
                    weights_done += 1;
                    list.push(Action::backward_weight(stage(wc), take(&mut next_w, wc)));
                }
            }
        }
    }
    for &wc in &backward_chunks[weights_done..] {
        list.push(Action::backward_weight(stage(wc), take(&mut next_w, wc)));
    }
    list
}
