//! What a stage reports about its gradients before its optimizer step: their sum of
//! squares, which the coordinator's decisions (`decide`) turn into the global norm and
//! the overflow check.

/// What a stage reports about its reduced gradients before its optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradStats {
    /// Sum of squares of the stage's (still loss-scaled) gradients. It is not finite
    /// when some gradient value is not, so it doubles as the overflow check.
    pub sum_sq: f64,
}

/// Values per block of [`GradStats::of`].
const BLOCK: usize = 512;

/// The sum of squares of one block, in 16 `f32` lanes added in `f64`.
fn block_sum_sq(block: &[f32]) -> f64 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = block.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x * x;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| x * x).sum();
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + f64::from(tail)
}

/// [`block_sum_sq`] of four blocks of [`BLOCK`] values side by side, each in its own
/// 16 lanes: the same sums, four times as many additions in flight (one block's lanes
/// wait on their own previous additions). Compiled also for AVX2 and AVX-512 and picked
/// at run time (`multiversion`), where the four blocks' lanes fill the wider registers;
/// IEEE additions and products in the same order, so the same bits at every width.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
fn four_block_sums(blocks: &[f32]) -> [f64; 4] {
    let (ab, cd) = blocks.split_at(2 * BLOCK);
    let ((a, b), (c, d)) = (ab.split_at(BLOCK), cd.split_at(BLOCK));
    let mut lanes = [[0.0f32; 16]; 4];
    let rows = (a.chunks_exact(16).zip(b.chunks_exact(16)))
        .zip(c.chunks_exact(16).zip(d.chunks_exact(16)));
    for ((a, b), (c, d)) in rows {
        for i in 0..16 {
            lanes[0][i] += a[i] * a[i];
            lanes[1][i] += b[i] * b[i];
            lanes[2][i] += c[i] * c[i];
            lanes[3][i] += d[i] * d[i];
        }
    }
    lanes.map(|l| l.iter().map(|&x| f64::from(x)).sum())
}

impl GradStats {
    /// The statistics of `grads`, in one pass.
    ///
    /// Squares are summed in `f32` over blocks of 512 values in 16 independent lanes
    /// (what baseline x86-64 vectorizes: 4x faster than `f64` lanes there, and the pass
    /// runs every step), and the block sums are added in `f64`: a relative error of about
    /// 1e-6 at worst, well below what the clip coefficient needs. `f32` squares overflow
    /// only for gradients above ~1e19, which then read as an overflow, as they should.
    /// Over many blocks (more than 2^21 values) the blocks are summed on several cores,
    /// and their sums still added in block order: the same bits either way.
    pub fn of(grads: &[f32]) -> GradStats {
        const PIECE: usize = 1 << 20;
        if grads.len() < 2 * PIECE {
            let sum_sq = grads
                .chunks(BLOCK)
                .map(block_sum_sq)
                .fold(0.0, |t, b| t + b);
            return GradStats { sum_sq };
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let blocks = grads.len().div_ceil(BLOCK);
        let per = blocks.div_ceil((grads.len() / PIECE).clamp(1, cores));
        let mut sums = vec![0.0f64; blocks];
        std::thread::scope(|s| {
            for (g, out) in grads.chunks(per * BLOCK).zip(sums.chunks_mut(per)) {
                s.spawn(move || {
                    for (o, b) in out.iter_mut().zip(g.chunks(BLOCK)) {
                        *o = block_sum_sq(b);
                    }
                });
            }
        });
        GradStats {
            sum_sq: sums.iter().fold(0.0, |t, &b| t + b),
        }
    }

    /// Whether every gradient value is finite.
    pub fn finite(&self) -> bool {
        self.sum_sq.is_finite()
    }
}

/// [`GradStats::of`] taken stretch by stretch, in order, with the same bits: for a pass
/// that reads the gradients anyway (an optimizer's update) to take their statistics on
/// the way, while each stretch is still in the core's cache, instead of reading them
/// all from memory once more.
#[derive(Debug, Clone, Copy, Default)]
pub struct SumSq {
    sum_sq: f64,
}

impl SumSq {
    /// Every stretch added but the last must hold a multiple of this many values, so
    /// that the blocks fall where [`GradStats::of`]'s fall.
    pub const ALIGN: usize = BLOCK;

    /// Adds the next stretch of the buffer.
    pub fn add(&mut self, stretch: &[f32]) {
        let mut fours = stretch.chunks_exact(4 * BLOCK);
        for four in &mut fours {
            for s in four_block_sums(four) {
                self.sum_sq += s;
            }
        }
        for b in fours.remainder().chunks(BLOCK) {
            self.sum_sq += block_sum_sq(b);
        }
    }

    /// The statistics of everything added.
    pub fn stats(&self) -> GradStats {
        GradStats {
            sum_sq: self.sum_sq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradient_statistics_over_many_cores_are_the_bits_of_one_pass() {
        // Over 2^21 values the blocks are summed on several cores.
        let grads: Vec<f32> = (0..(5u32 << 20) + 77)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 1e7) - 0.8)
            .collect();
        let one_pass = grads
            .chunks(BLOCK)
            .map(block_sum_sq)
            .fold(0.0f64, |t, b| t + b);
        assert_eq!(GradStats::of(&grads).sum_sq.to_bits(), one_pass.to_bits());
        let mut bad = grads;
        bad[3 << 20] = f32::NAN;
        assert!(!GradStats::of(&bad).finite());
    }

    #[test]
    fn stats_sum_squares_and_flag_non_finite_values() {
        let g: Vec<f32> = (0..21).map(|i| i as f32 * 0.5).collect();
        let want: f64 = g.iter().map(|&x| f64::from(x).powi(2)).sum();
        let s = GradStats::of(&g);
        assert!(
            (s.sum_sq - want).abs() < 1e-9 * want,
            "{} vs {want}",
            s.sum_sq
        );
        assert!(s.finite());
        // Many values of mixed size: within 1e-6 of an f64 sum.
        let many: Vec<f32> = (0..100_003)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let want: f64 = many.iter().map(|&x| f64::from(x).powi(2)).sum();
        let got = GradStats::of(&many).sum_sq;
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        let mut bad = g.clone();
        bad[13] = f32::INFINITY;
        assert!(!GradStats::of(&bad).finite());
        bad[13] = f32::NAN;
        assert!(!GradStats::of(&bad).finite());
        let huge = vec![1e20f32; 10];
        assert!(
            !GradStats::of(&huge).finite(),
            "squares past f32's range read as an overflow"
        );
    }

    #[test]
    fn statistics_taken_stretch_by_stretch_are_the_bits_of_one_pass() {
        let grads: Vec<f32> = (0..(3u32 << 20) + 77)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 1e7) - 0.8)
            .collect();
        let mut sum = SumSq::default();
        let mut rest = grads.as_slice();
        for k in 1.. {
            let n = (k * 3 * SumSq::ALIGN).min(rest.len());
            let (stretch, tail) = rest.split_at(n);
            sum.add(stretch);
            rest = tail;
            if rest.is_empty() {
                break;
            }
        }
        assert_eq!(
            sum.stats().sum_sq.to_bits(),
            GradStats::of(&grads).sum_sq.to_bits()
        );
    }
}
