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
//! `erf`: ONNX Runtime's own (MLAS's kernel, after N. Juffa's faithfully rounded `erff`),
//! the same operations in the same order as its FMA kernel, so bit for bit the values of
//! ONNX Runtime's `Erf` on machines with FMA (the fused GELU's loss is bitwise the
//! exported form's: `tests/it/fused_kernels.rs`): `|x| (1 + P(x^2))` for `|x| <= 0.921875`,
//! else `1 - e^-Q(|x|)` with MLAS's own `exp` (its input at least `-127.5 ln 2`), both
//! evaluated and one selected, all in fused multiply-adds (exactly rounded: the same bits
//! on every machine, one instruction on those the kernels are compiled for). Within 1 ulp
//! of the float64 `erf` (tested).
//!
//! `tanh`: from `exp` (see its doc).
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

/// `tanh(z) = 1 - 2 / (e^(2z) + 1)` with [`exp`], branch-free (vectorizes): within a few
/// ulp of 1 in absolute terms (near 0 the subtraction loses its relative precision, not
/// its absolute: about 1e-7), saturating to exactly -1 and, to within 1.2e-38, 1.
#[inline(always)]
pub(crate) fn tanh(z: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * z) + 1.0)
}

/// Where `erf`'s two pieces meet.
const ERF_SPLIT: f32 = 0.921_875;
/// The lowest input of MLAS's `exp` inside `erf` (`-127.5 ln 2`).
const ERF_EXP_LOWEST: f32 = -88.376_26;
/// `P` in `x^2`, highest power first, its constant term less one.
const ERF_NEAR: [f32; 6] = [
    -5.991_049_7e-4,
    4.993_396e-3,
    -2.676_673_4e-2,
    1.128_180_25e-1,
    -3.761_248_6e-1,
    1.283_791_5e-1,
];
/// `Q` in `|x|`, highest power first, its constant term less one.
const ERF_FAR: [f32; 7] = [
    1.729_489_3e-5,
    -3.832_086_8e-4,
    3.883_934_4e-3,
    -2.425_456e-2,
    1.067_778_5e-1,
    6.348_467e-1,
    1.287_175_1e-1,
];
/// MLAS's `exp` inside `erf`: `ln 2` in two parts (negated), and its polynomial for
/// `e^f`, highest power first.
const ERF_LN2_HI: f32 = -6.931_457_5e-1;
const ERF_LN2_LO: f32 = -1.428_606_8e-6;
const ERF_EXP: [f32; 7] = [
    1.383_198_1e-3,
    8.375_5e-3,
    4.166_895e-2,
    1.666_644_7e-1,
    4.999_998_5e-1,
    1.0,
    1.0,
];

/// `c[0] z^n + ... + c[n]` by Horner's rule in fused multiply-adds.
#[inline(always)]
fn horner(c: &[f32], z: f32) -> f32 {
    c[1..].iter().fold(c[0], |p, &k| p.mul_add(z, k))
}

/// `erf(x)` (see the module doc). A NaN stays NaN.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let near = horner(&ERF_NEAR, a * a).mul_add(a, a);
    let q = -horner(&ERF_FAR, a).mul_add(a, a);
    // Not `max`, which would turn a NaN into the bound.
    let q = if q < ERF_EXP_LOWEST {
        ERF_EXP_LOWEST
    } else {
        q
    };
    let z = LOG2E.mul_add(q, ROUND);
    let n = z - ROUND;
    let f = n.mul_add(ERF_LN2_LO, n.mul_add(ERF_LN2_HI, q));
    // z's bits are those of 2^23 * 1.5 plus n: n + 127, moved into the exponent field.
    let two_n = f32::from_bits(z.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    let far = 1.0 - horner(&ERF_EXP, f) * two_n;
    let r = if a > ERF_SPLIT { far } else { near };
    r.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_within_1_ulp_of_float64() {
        let mut worst = 0f64;
        let xs = grid()
            .map(|x| x * 0.4)
            .chain([0.921_875, 0.921_876, 3.725, 3.8, 3.92, 1e-30]);
        for x in xs.flat_map(|x| [x, -x]) {
            let want = libm::erf(x as f64);
            let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE) * f32::EPSILON;
            let ulps = (erf(x) as f64 - want).abs() / ulp as f64;
            assert!(ulps <= 1.0, "erf({x}) = {}, not {want}", erf(x));
            worst = worst.max(ulps);
        }
        assert!(
            worst > 0.25,
            "the grid reaches rounding error ({worst} ulp)"
        );
        assert_eq!(erf(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(erf(-0.0).to_bits(), (-0.0f32).to_bits());
        // ONNX Runtime's values where `erf` reaches 1.
        assert_eq!(erf(3.8), 0.999_999_94);
        assert_eq!((erf(3.92), erf(50.0), erf(1e30)), (1.0, 1.0, 1.0));
        assert_eq!(erf(f32::NEG_INFINITY), -1.0);
        assert!(erf(f32::NAN).is_nan());
    }

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
