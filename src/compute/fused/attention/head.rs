//! One (batch, head) pair's forward and backward (see the parent module's doc): the
//! products by `matrixmultiply`'s strided SGEMM, in row blocks under a causal mask.

use super::layout::{Shared, View};
use super::Attributes;
use crate::compute::fused::softmax::{softmax_grad, softmax_row};

/// `c = alpha * a b + beta * c` for `a` (`m x k`) and `b` (`k x n`) at the given
/// strides (`c` is not read where `beta` is 0).
///
/// # Safety
/// Every element the strides reach from `a`, `b` and `c` is in its tensor, and no other
/// task writes the elements of `c`.
unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    (a, ra, ca): (*const f32, isize, isize),
    (b, rb, cb): (*const f32, isize, isize),
    (c, rc, cc): (*mut f32, isize, isize),
) {
    // SAFETY: the caller's contract.
    unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, ra, ca, b, rb, cb, beta, c, rc, cc) }
}

/// Query rows a block under a causal mask: a block's products stop at the last key its
/// last row sees (about half the work of the full products on square scores).
const ROW_BLOCK: usize = 16;

/// The blocks of query rows `(first, end, keys)` of `t` rows over `s` keys: one block of
/// every row and key, or under a causal mask (row `i` sees keys up to `i + s - t`) blocks
/// of [`ROW_BLOCK`] rows with the keys their last row sees.
fn row_blocks(t: usize, s: usize, causal: bool) -> Vec<(usize, usize, usize)> {
    if !causal {
        return vec![(0, t, s)];
    }
    (0..t)
        .step_by(ROW_BLOCK)
        .map(|r0| {
            let r1 = (r0 + ROW_BLOCK).min(t);
            (r0, r1, (r1 + s - t).min(s))
        })
        .collect()
}

/// Sets the `rows x cols` matrix of pair `bh` in view `v` of `x` to zeros.
///
/// # Safety
/// `x` holds the viewed tensor, and no other task writes pair `bh`'s elements.
unsafe fn zero(x: Shared, v: &View, bh: usize) {
    let at = v.at(bh);
    for i in 0..v.dims[2] {
        for j in 0..v.dims[3] {
            // SAFETY: the caller's contract; the view is the tensor's.
            unsafe { *x.get().add(at + i * v.strides[2] + j * v.strides[3]) = 0.0 };
        }
    }
}

/// An additive mask: its values and strides over `[B, H, T, S]`.
pub(super) struct Mask<'a> {
    pub(super) strides: [usize; 4],
    pub(super) values: &'a [f32],
}

/// What a call's tasks read: the attributes and the viewed `Q`, `K`, `V`.
pub(super) struct Pair<'a> {
    pub(super) a: &'a Attributes,
    pub(super) q: (&'a [f32], View),
    pub(super) k: (&'a [f32], View),
    pub(super) v: (&'a [f32], View),
}

impl Pair<'_> {
    /// `(pointer, row stride, column stride)` of pair `bh`'s matrix in `x`'s view `v`
    /// from row `row` on (turned: rows and columns swapped).
    fn at(x: &[f32], v: &View, bh: usize, row: usize, turned: bool) -> (*const f32, isize, isize) {
        let (r, c) = v.matrix(turned);
        (x.as_ptr().wrapping_add(v.at(bh) + row * r as usize), r, c)
    }

    /// The forward of pair `bh` (see the module doc); `row` is scratch of `S` values.
    pub(super) fn forward(
        &self,
        bh: usize,
        mask: Option<&Mask>,
        (out, ov): (Shared, View),
        probs: Shared,
        row: &mut [f32],
    ) {
        let (qv, kv) = (self.q.1, self.k.1);
        let ([_, h, t, d], s, e) = (qv.dims, kv.dims[3], self.v.1.dims[3]);
        let p = probs.get().wrapping_add(bh * t * s);
        let (one, st) = (1isize, s as isize);
        for (r0, r1, keys) in row_blocks(t, s, self.a.causal) {
            let q = Self::at(self.q.0, &qv, bh, r0, false);
            let k = Self::at(self.k.0, &kv, bh, 0, false);
            let p0 = p.wrapping_add(r0 * s);
            // SAFETY: the views are the tensors' own shapes and strides; `P`'s rows and
            // `O`'s elements of this pair are written by this task alone.
            unsafe { gemm((r1 - r0, d, keys), (self.a.scale, 0.0), q, k, (p0, st, one)) };
            for i in r0..r1 {
                let seen = if self.a.causal {
                    (i + s - t + 1).min(s)
                } else {
                    s
                };
                // SAFETY: row `i` of this pair's `P` block, this task's alone.
                let y = unsafe { std::slice::from_raw_parts_mut(p.add(i * s), s) };
                let x = &mut row[..seen];
                x.copy_from_slice(&y[..seen]);
                if let Some(m) = mask {
                    let ms = m.strides;
                    let base = (bh / h) * ms[0] + (bh % h) * ms[1] + i * ms[2];
                    for (j, x) in x.iter_mut().enumerate() {
                        *x += m.values[base + j * ms[3]];
                    }
                }
                softmax_row(x, &mut y[..seen]);
                y[seen..].fill(0.0);
            }
            let v = Self::at(self.v.0, &self.v.1, bh, 0, false);
            let (or, oc) = ov.matrix(false);
            let o = out.get().wrapping_add(ov.at(bh) + r0 * ov.strides[2]);
            // SAFETY: as above.
            unsafe {
                gemm(
                    (r1 - r0, keys, e),
                    (1.0, 0.0),
                    (p0, st, one),
                    v,
                    (o, or, oc),
                )
            };
        }
    }
}

impl Pair<'_> {
    /// The backward of pair `bh` (see the module doc): `dO` in its view, the kept
    /// probabilities `P`, the gradients of `Q`, `K`, `V` (written in their views); `scratch`
    /// of `2 T S` values.
    pub(super) fn backward(
        &self,
        bh: usize,
        (d_out, ov): (&[f32], View),
        p: &[f32],
        [dq, dk, dv]: [Shared; 3],
        scratch: &mut [f32],
    ) {
        let (qv, kv, vv) = (self.q.1, self.k.1, self.v.1);
        let ([_, _, t, d], s, e) = (qv.dims, kv.dims[3], vv.dims[3]);
        let (dp, ds) = scratch.split_at_mut(t * s);
        let pb = &p[bh * t * s..(bh + 1) * t * s];
        let (st, one) = (s as isize, 1isize);
        // Blocks after the first add to the keys' gradients; under a causal mask the
        // first does not reach every key, so they start from zeros.
        let causal = self.a.causal;
        if causal {
            // SAFETY: this pair's elements of `dK` and `dV`, this task's alone.
            unsafe { zero(dk, &kv.turned(), bh) };
            unsafe { zero(dv, &vv, bh) };
        }
        let beta = if causal { 1.0 } else { 0.0 };
        let scale = self.a.scale;
        let at = |g: Shared, v: &View, row: usize, turned: bool| {
            let (r, c) = v.matrix(turned);
            (g.get().wrapping_add(v.at(bh) + row * r as usize), r, c)
        };
        for (r0, r1, keys) in row_blocks(t, s, causal) {
            let rows = r1 - r0;
            let d_o = Self::at(d_out, &ov, bh, r0, false);
            let v_turned = Self::at(self.v.0, &vv, bh, 0, true);
            let dp0 = dp[r0 * s..].as_mut_ptr();
            // SAFETY: the views are the tensors' own shapes and strides; the gradients'
            // elements of this pair are written by this task alone.
            unsafe { gemm((rows, e, keys), (1.0, 0.0), d_o, v_turned, (dp0, st, one)) };
            for i in r0..r1 {
                let at = i * s..i * s + keys;
                softmax_grad(&dp[at.clone()], &pb[at.clone()], keys, &mut ds[at]);
            }
            let p_turned = (pb[r0 * s..].as_ptr(), one, st);
            let ds_rows = (ds[r0 * s..].as_ptr(), st, one);
            let ds_turned = (ds[r0 * s..].as_ptr(), one, st);
            let k_rows = Self::at(self.k.0, &kv, bh, 0, true);
            let q_rows = Self::at(self.q.0, &qv, bh, r0, false);
            // SAFETY: as above.
            unsafe {
                gemm(
                    (keys, rows, e),
                    (1.0, beta),
                    p_turned,
                    d_o,
                    at(dv, &vv, 0, false),
                );
                gemm(
                    (rows, keys, d),
                    (scale, 0.0),
                    ds_rows,
                    k_rows,
                    at(dq, &qv, r0, false),
                );
                gemm(
                    (keys, rows, d),
                    (scale, beta),
                    ds_turned,
                    q_rows,
                    at(dk, &kv, 0, true),
                );
            }
        }
    }
}
