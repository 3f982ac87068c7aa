//! `exp` and `erf` for float32 written branch-free, so that a loop over a slice calling
//! them vectorizes (the loops sit in `multiversion` functions, which compile them for
//! AVX2 and AVX-512 as well). The standard library's `f32::exp` is a call into libm per
//! element, which no loop vectorizes, and Rust's standard library has no `erf`.
//!
//! `exp`: Cody-Waite range reduction, `x = n ln 2 + r` with `|r| <= ln 2 / 2`, and
//! Cephes' degree-7 polynomial for `e^r` (relative error about 2 ulp), scaled by `2^n`
//! built in the exponent bits. Inputs above 88 are taken as 88; below -87.3 (where the
//! result would be subnormal) the result is 0, never a subnormal, which would slow every
//! later product it meets by orders of magnitude.
//!
//! `erf`: Abramowitz and Stegun 7.1.26, `1 - t (a1 + t (a2 + ...)) e^(-x^2)` with `t = 1 /
//! (1 + p |x|)` (absolute error below 1.5e-7), and below `|x| = 0.6`, where that is 1
//! minus nearly 1, erf's Taylor series to `x^13`: below 2.5e-7 absolute in float32.
//!
//! No crate offers these as inlinable, vectorizable float32 functions (`libm` is scalar).

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts: `n * LN2_HI` is exact for the `n` that occur.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// The smallest input with a normal result (`e^x >= f32::MIN_POSITIVE`).
const LOWEST: f32 = -87.336_54;
/// `1.5 * 2^23`: adding it rounds to an integer kept in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `e^x` (see the module doc).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let below = x < LOWEST;
    let x = x.clamp(LOWEST, 88.0);
    let z = x * LOG2E + ROUND;
    let n = z - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let p = p * (r * r) + r + 1.0;
    // z's bits are those of 2^23 * 1.5 plus n: n + 127, moved into the exponent field.
    let two_n = f32::from_bits(z.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    // Zero below the range (masked attention scores are -inf); a select, not a branch.
    if below {
        0.0
    } else {
        p * two_n
    }
}

/// `erf(x)`, and `e^(-x^2)` which it computes on the way (GELU's backward reuses it).
#[inline(always)]
pub(crate) fn erf_and_gauss(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let q = 1.061_405_4;
    let q = q * t - 1.453_152;
    let q = q * t + 1.421_413_8;
    let q = q * t - 0.284_496_74;
    let q = q * t + 0.254_829_6;
    let u = x * x;
    let gauss = exp(-u);
    let tail = (1.0 - q * t * gauss).copysign(x);
    // Near 0 that is 1 minus nearly 1: the Taylor series instead (to u^6, error < 1e-9).
    let series = 1.0 / 9360.0;
    let series = series * u - 1.0 / 1320.0;
    let series = series * u + 1.0 / 216.0;
    let series = series * u - 1.0 / 42.0;
    let series = series * u + 0.1;
    let series = series * u - 1.0 / 3.0;
    let series = (series * u + 1.0) * x * std::f32::consts::FRAC_2_SQRT_PI;
    (if a < 0.6 { series } else { tail }, gauss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        (-20_000..=20_000).map(|k| k as f32 * 0.000_7)
    }

    #[test]
    fn exp_is_within_3_ulp_over_its_range() {
        let xs = grid()
            .map(|x| x * 6.0)
            .chain([-87.0, -80.5, 80.5, 88.0, 0.0]);
        for x in xs {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                (got - want).abs() <= 3.0 * ulp as f64,
                "exp({x}) = {got}, not {want}"
            );
        }
    }

    #[test]
    fn exp_gives_no_subnormals_infinities_or_nans() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert!(exp(-87.3) >= f32::MIN_POSITIVE);
        assert!(exp(1000.0).is_finite() && exp(f32::INFINITY).is_finite());
    }

    #[test]
    fn erf_is_within_2_5e7_absolute() {
        for x in grid() {
            let want = libm::erf(x as f64);
            let (got, gauss) = erf_and_gauss(x);
            assert!(
                (got as f64 - want).abs() < 2.5e-7,
                "erf({x}) = {got}, not {want}"
            );
            // e^(-x^2) of the float32 square (its rounding is the input's, not exp's).
            let g = (-((x * x) as f64)).exp();
            let underflows = g < f32::MIN_POSITIVE as f64 && gauss == 0.0;
            assert!((gauss as f64 - g).abs() <= 3.0 * g * f32::EPSILON as f64 || underflows);
        }
    }
}
