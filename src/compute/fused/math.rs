//! `exp` for float32 written branch-free, so that a loop over a slice calling
//! it vectorizes (the loops sit in `multiversion` functions, which compile them for
//! AVX2 and AVX-512 as well). The standard library's `f32::exp` is a call into libm per
//! element, which no loop vectorizes.
//!
//! `exp`: Cody-Waite range reduction, `x = n ln 2 + r` with `|r| <= ln 2 / 2`, and
//! Cephes' degree-7 polynomial for `e^r` (relative error about 2 ulp), scaled by `2^n`
//! built in the exponent bits. Inputs above 88 are taken as 88; below -87.3 (where the
//! result would be subnormal) the result is 0, never a subnormal, which would slow every
//! later product it meets by orders of magnitude.
//!
//! No crate offers it as an inlinable, vectorizable float32 function (`libm` is scalar).

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
}
