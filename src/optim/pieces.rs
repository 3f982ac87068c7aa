//! Element-wise updates of big buffers, cut into pieces that run on scoped threads.
//!
//! A step over a few hundred megabytes (GPT-2 small: 163 M parameters, 650 MB each for
//! parameters and gradients) is bound by memory bandwidth, which one core does not
//! reach: on a 16-core GPU host, plain SGD over GPT-2 small took 185 ms on one thread.
//! Every value's update reads only that value's parameter, gradient and state, so the
//! pieces give bitwise the same result whatever their number. Buffers under two pieces
//! of [`MIN_PIECE`] values stay on the calling thread: for the small models that step
//! hundreds of times a second, starting threads would cost more than it saves.
//!
//! `std::thread::scope` rather than a pool crate (rayon): the one use is a fork-join
//! over a few slices once a step, which scoped threads do in a few lines.

/// The fewest values a piece of its own is worth (4 MiB of `f32`).
pub(crate) const MIN_PIECE: usize = 1 << 20;

/// The length of each piece of an update over `len` values: `len` itself (one piece, on
/// the calling thread) below two [`MIN_PIECE`]s, else `len` over the cores, rounded up.
pub(crate) fn piece_len(len: usize) -> usize {
    if len < 2 * MIN_PIECE {
        return len.max(1);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    len.div_ceil((len / MIN_PIECE).clamp(1, cores))
}

/// Runs `f` on every one of `parts`: the last on this thread, each other on a thread of
/// its own; returns when all are done.
pub(crate) fn run_pieces<T: Send>(parts: impl Iterator<Item = T>, f: impl Fn(T) + Sync) {
    let f = &f;
    std::thread::scope(|s| {
        let mut parts = parts.peekable();
        while let Some(part) = parts.next() {
            if parts.peek().is_none() {
                f(part);
            } else {
                s.spawn(move || f(part));
            }
        }
    });
}

/// Test aid: `pieces` (an update run in pieces) is bitwise `one` (the same update in
/// one pass), and moved most of `before`'s values.
#[cfg(test)]
pub(crate) fn assert_bitwise_and_moved(pieces: &[f32], one: &[f32], before: &[f32]) {
    assert!(pieces
        .iter()
        .zip(one)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let moved = pieces.iter().zip(before).filter(|(a, b)| a != b).count();
    assert!(
        moved > before.len() / 2,
        "only {moved} of {} values moved",
        before.len()
    );
}

/// Test aid: `len` values spread over [-0.5, 0.5), a different pattern for each `k`.
#[cfg(test)]
pub(crate) fn wave(len: usize, k: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| ((i.wrapping_mul(k) >> 9) as f32 / 4e6) - 0.5)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_updates_are_one_piece_and_big_ones_cover_every_value_once() {
        assert_eq!(piece_len(0), 1);
        assert_eq!(piece_len(1000), 1000);
        assert_eq!(piece_len(2 * MIN_PIECE - 1), 2 * MIN_PIECE - 1);
        let len = 5 * MIN_PIECE + 3;
        let n = piece_len(len);
        assert!(n >= MIN_PIECE && n <= len);
        let mut seen = vec![0u8; len];
        run_pieces(seen.chunks_mut(n), |c| c.iter_mut().for_each(|v| *v += 1));
        assert!(seen.iter().all(|&v| v == 1));
    }
}
