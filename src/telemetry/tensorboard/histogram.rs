//! Histograms of f32 values as TensorBoard's `HistogramProto`.
//!
//! # Buckets
//! [`BUCKETS`] buckets of equal width over `[min, max]`, computed exactly as TensorBoard's
//! own writer does today (`tensorboard.plugins.histogram.summary_v2.histogram_pb`, 30
//! buckets: `floor((x - min) / ((max - min) / 30))`, the last bucket closed; in f64). Not
//! TensorFlow 1's default exponential buckets (±1e-12 x 1.1^k up to 1e20, 1,549 limits):
//! those give 10% relative resolution at any scale, but TensorBoard re-bins whatever it
//! reads onto a linear axis for display, so the fine buckets are spent on nothing, and
//! with their empty runs collapsed the bucket layout changes from step to step. Linear
//! buckets cost one subtraction, division and floor per value (no search among 1,549
//! limits), always write 30 buckets whose edges are the drawn bins, and can be checked
//! against TensorBoard's reference implementation bucket for bucket (the tests do).
//!
//! # Non-finite values
//! NaN and infinities have no place on a linear axis: they are left out of `min`, `max`
//! and the buckets, but counted in `num` and carried by `sum` and `sum_squares` (which
//! become NaN or infinite), so a diverged tensor is visible rather than silently dropped.

use super::proto::HistogramProto;

/// Buckets per histogram: TensorBoard's `DEFAULT_BUCKET_COUNT`.
pub const BUCKETS: usize = 30;

/// The histogram of `values`: see the module docs for the buckets.
pub(super) fn histogram(values: &[f32]) -> HistogramProto {
    let (mut sum, mut sum_squares) = (0.0f64, 0.0f64);
    let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut finite = 0usize;
    for &v in values {
        let x = f64::from(v);
        sum += x;
        sum_squares += x * x;
        if v.is_finite() {
            finite += 1;
            min = min.min(v);
            max = max.max(v);
        }
    }
    let mut h = HistogramProto {
        num: values.len() as f64,
        sum,
        sum_squares,
        ..HistogramProto::default()
    };
    if finite == 0 {
        // min = max = 0 and no buckets: what TensorFlow writes for an empty histogram.
        return h;
    }
    let (min, max) = (f64::from(min), f64::from(max));
    h.min = min;
    h.max = max;
    if min == max {
        // One value repeated: a single bucket ending at it (TensorBoard's reference writes
        // 30 buckets of zero width with everything in the last; they draw the same).
        h.bucket_limit.push(max);
        h.bucket.push(finite as f64);
        return h;
    }
    let width = (max - min) / BUCKETS as f64;
    let mut counts = [0u64; BUCKETS];
    for &v in values.iter().filter(|v| v.is_finite()) {
        // In [0, BUCKETS] since min <= v <= max; the cast saturates, and `min` clamps the
        // maximum into the last bucket, as the reference's `np.minimum` does.
        let i = ((f64::from(v) - min) / width).floor() as usize;
        counts[i.min(BUCKETS - 1)] += 1;
    }
    // Right edges as `np.linspace(min, max, BUCKETS + 1)[1:]` computes them, the last
    // exactly `max`.
    h.bucket_limit = (1..=BUCKETS)
        .map(|i| {
            if i == BUCKETS {
                max
            } else {
                i as f64 * width + min
            }
        })
        .collect();
    h.bucket = counts.iter().map(|&c| c as f64).collect();
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_buckets_over_min_max() {
        // 0..=29 and 30: every integer in its own bucket but 29 and 30 sharing the last.
        let values: Vec<f32> = (0..=30).map(|i| i as f32).collect();
        let h = histogram(&values);
        assert_eq!((h.min, h.max, h.num), (0.0, 30.0, 31.0));
        assert_eq!(h.sum, 465.0);
        assert_eq!(h.sum_squares, (0..=30).map(|i| (i * i) as f64).sum::<f64>());
        assert_eq!(h.bucket_limit.len(), BUCKETS);
        assert_eq!(h.bucket_limit[0], 1.0);
        assert_eq!(h.bucket_limit[BUCKETS - 1], 30.0);
        let mut want = vec![1.0; BUCKETS];
        want[BUCKETS - 1] = 2.0;
        assert_eq!(h.bucket, want);
    }

    #[test]
    fn degenerate_inputs() {
        let h = histogram(&[]);
        assert_eq!((h.num, h.min, h.max), (0.0, 0.0, 0.0));
        assert!(h.bucket.is_empty() && h.bucket_limit.is_empty());

        let h = histogram(&[-2.5; 4]);
        assert_eq!((h.min, h.max, h.num, h.sum), (-2.5, -2.5, 4.0, -10.0));
        assert_eq!((h.bucket_limit, h.bucket), (vec![-2.5], vec![4.0]));
    }

    #[test]
    fn non_finite_values_are_counted_not_bucketed() {
        let h = histogram(&[1.0, f32::NAN, 2.0, f32::INFINITY]);
        assert_eq!((h.min, h.max, h.num), (1.0, 2.0, 4.0));
        assert!(h.sum.is_nan() && h.sum_squares.is_nan());
        assert_eq!(h.bucket.iter().sum::<f64>(), 2.0);

        let h = histogram(&[f32::NAN]);
        assert_eq!((h.min, h.max, h.num), (0.0, 0.0, 1.0));
        assert!(h.bucket.is_empty());
    }
}
