//! One (batch, head) pair's forward and backward (see the parent module's doc): the
//! products by the session's BLAS where it has one (each head's matrices are row- or
//! column-major with their own leading dimension), else by `matrixmultiply`'s strided
//! SGEMM; in row blocks under a causal mask.

use super::layout::{Shared, View};
use super::Attributes;
use crate::compute::blas::Blas;
use crate::compute::fused::math;
use crate::compute::fused::softmax::{softmax_grad, softmax_row};

/// The fewest multiply-adds of a head's product that runs on the BLAS: BERT-base's and
/// ViT-B/16's heads (128 x 64 x 128 and more: their attention 1.2-1.5x as fast on MKL as
/// on `matrixmultiply`, by ONNX Runtime's profile), not a small model's (the test
/// fixtures' heads of 4-16 values), whose results stay those of `matrixmultiply`.
const BLAS_FROM: usize = 1 << 18;

/// `c = alpha * a b + beta * c` for `a` (`m x k`) and `b` (`k x n`) at the given
/// strides (`c` is not read where `beta` is 0), by `blas` where it takes the strides and
/// the product has at least [`BLAS_FROM`] multiply-adds.
///
/// # Safety
/// Every element the strides reach from `a`, `b` and `c` is in its tensor, and no other
/// task writes the elements of `c`.
unsafe fn gemm(
    blas: Option<&Blas>,
    (m, k, n): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    (a, ra, ca): (*const f32, isize, isize),
    (b, rb, cb): (*const f32, isize, isize),
    (c, rc, cc): (*mut f32, isize, isize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        let large = m * k * n >= BLAS_FROM;
        let done = large
            && blas.is_some_and(|blas| {
                blas.sgemm_strided(
                    (m, k, n),
                    (alpha, beta),
                    (a, ra, ca),
                    (b, rb, cb),
                    (c, rc, cc),
                )
            });
        if !done {
            matrixmultiply::sgemm(m, k, n, alpha, a, ra, ca, b, rb, cb, beta, c, rc, cc)
        }
    }
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

/// An additive mask: its values and strides over `[B, H, T, S]`.
pub(super) struct Mask<'a> {
    pub(super) strides: [usize; 4],
    pub(super) values: &'a [f32],
}

/// What a call's tasks read: the attributes and the viewed `Q`, `K`, `V`.
pub(super) struct Pair<'a> {
    pub(super) a: &'a Attributes,
    pub(super) blas: Option<&'a Blas>,
    pub(super) q: (&'a [f32], View),
    pub(super) k: (&'a [f32], View),
    pub(super) v: (&'a [f32], View),
}

impl Pair<'_> {
    /// `(pointer, row stride, column stride)` of pair `bh`'s matrix in `x`'s view `v`
    /// from row `row` on (turned: rows and columns swapped).
    fn at(x: &[f32], v: &View, bh: usize, row: usize, turned: bool) -> (*const f32, isize, isize) {
        let (at, r, c) = v.matrix(bh, row, turned);
        (x.as_ptr().wrapping_add(at), r, c)
    }

    /// Query `i`'s scores before the softmax, whole rows of `S` as the standard graph has
    /// them: the products `computed` (the keys its row block sees) plus the mask, and
    /// under a causal mask `-inf` for the keys the query does not see (where the
    /// standard graph adds -1e8 or less: either way `exp` gives exactly 0, the maximum is
    /// among the keys seen, and the softmax's sums are the same, bit for bit).
    fn scores(&self, bh: usize, i: usize, mask: Option<&Mask>, computed: &[f32], row: &mut [f32]) {
        let ([_, h, t, _], s) = (self.q.1.dims, self.k.1.dims[3]);
        let seen = if self.a.causal {
            (i + s - t + 1).min(s)
        } else {
            s
        };
        row[..seen].copy_from_slice(&computed[..seen]);
        row[seen..].fill(f32::NEG_INFINITY);
        if let Some(m) = mask {
            let ms = m.strides;
            let base = (bh / h) * ms[0] + (bh % h) * ms[1] + i * ms[2];
            for (j, x) in row[..seen].iter_mut().enumerate() {
                *x += m.values[base + j * ms[3]];
            }
        }
    }

    /// Scores `scale q kt` of pair `bh`'s row block `(r0, r1, keys)` into rows `r0..r1` of
    /// `p` (the pair's `[T, S]`), the first `keys` of each.
    fn score_block(&self, bh: usize, (r0, r1, keys): (usize, usize, usize), p: *mut f32) {
        let (qv, kv) = (self.q.1, self.k.1);
        let ([_, _, _, d], s) = (qv.dims, kv.dims[3]);
        let q = Self::at(self.q.0, &qv, bh, r0, false);
        let k = Self::at(self.k.0, &kv, bh, 0, false);
        // SAFETY: the views are the tensors' own shapes and strides; the rows of `p` are
        // this task's alone.
        unsafe {
            gemm(
                self.blas,
                (r1 - r0, d, keys),
                (self.a.scale, 0.0),
                q,
                k,
                (p.wrapping_add(r0 * s), s as isize, 1),
            )
        };
    }

    /// The forward of pair `bh` (see the module doc): `O`, the probabilities in `p` (the
    /// pair's `[T, S]`), and where `lse` is given each query row's log-sum-exp there;
    /// `row` is scratch of `S` values.
    pub(super) fn forward(
        &self,
        bh: usize,
        mask: Option<&Mask>,
        (out, ov): (Shared, View),
        (p, lse): (*mut f32, Option<*mut f32>),
        row: &mut [f32],
    ) {
        let ([_, _, t, _], s, e) = (self.q.1.dims, self.k.1.dims[3], self.v.1.dims[3]);
        let (one, st) = (1isize, s as isize);
        for (r0, r1, keys) in row_blocks(t, s, self.a.causal) {
            self.score_block(bh, (r0, r1, keys), p);
            for i in r0..r1 {
                // SAFETY: row `i` of this pair's `P`, this task's alone.
                let y = unsafe { std::slice::from_raw_parts_mut(p.add(i * s), s) };
                self.scores(bh, i, mask, &y[..keys], row);
                let l = softmax_row(row, y);
                if let Some(lse) = lse {
                    // SAFETY: this pair's `L` row `i`, this task's alone.
                    unsafe { *lse.add(i) = l };
                }
            }
            let v = Self::at(self.v.0, &self.v.1, bh, 0, false);
            let o = out.matrix(&ov, bh, r0, false);
            // SAFETY: the views are the tensors' own; `O`'s elements of this pair are
            // written by this task alone.
            unsafe {
                gemm(
                    self.blas,
                    (r1 - r0, keys, e),
                    (1.0, 0.0),
                    (p.wrapping_add(r0 * s), st, one),
                    v,
                    o,
                )
            };
        }
    }

    /// Pair `bh`'s probabilities again from its rows' log-sum-exps `lse`:
    /// `P = exp(S - L)`, into `p` (`[T, S]`); `row` is scratch of `S` values.
    pub(super) fn probabilities(
        &self,
        bh: usize,
        mask: Option<&Mask>,
        lse: &[f32],
        p: &mut [f32],
        row: &mut [f32],
    ) {
        let ([_, _, t, _], s) = (self.q.1.dims, self.k.1.dims[3]);
        for (r0, r1, keys) in row_blocks(t, s, self.a.causal) {
            self.score_block(bh, (r0, r1, keys), p.as_mut_ptr());
            for i in r0..r1 {
                let y = &mut p[i * s..(i + 1) * s];
                self.scores(bh, i, mask, &y[..keys], row);
                for (y, &x) in y.iter_mut().zip(row.iter()) {
                    *y = math::exp(x - lse[i]);
                }
            }
        }
    }
}

impl Pair<'_> {
    /// The backward of pair `bh` (see the module doc): `dO` in its view, the pair's
    /// probabilities `pb` (`[T, S]`), the gradients of `Q`, `K`, `V` (written in their
    /// views); `scratch` of `2 T S` values.
    pub(super) fn backward(
        &self,
        bh: usize,
        (d_out, ov): (&[f32], View),
        pb: &[f32],
        [dq, dk, dv]: [Shared; 3],
        scratch: &mut [f32],
    ) {
        let (qv, kv, vv) = (self.q.1, self.k.1, self.v.1);
        let ([_, _, t, d], s, e) = (qv.dims, kv.dims[3], vv.dims[3]);
        let (dp, ds) = scratch.split_at_mut(t * s);
        let (st, one) = (s as isize, 1isize);
        let scale = self.a.scale;
        for (r0, r1, keys) in row_blocks(t, s, self.a.causal) {
            let rows = r1 - r0;
            let d_o = Self::at(d_out, &ov, bh, r0, false);
            let v_turned = Self::at(self.v.0, &vv, bh, 0, true);
            let dp0 = dp[r0 * s..].as_mut_ptr();
            // SAFETY: the views are the tensors' own shapes and strides; the gradients'
            // elements of this pair are written by this task alone.
            unsafe {
                gemm(
                    self.blas,
                    (rows, e, keys),
                    (1.0, 0.0),
                    d_o,
                    v_turned,
                    (dp0, st, one),
                )
            };
            // Whole rows, as without a causal mask: the keys not computed have `dP` 0
            // and `P` 0, so the row sums and `dS` are bit for bit the same.
            for i in r0..r1 {
                dp[i * s + keys..(i + 1) * s].fill(0.0);
            }
            softmax_grad(
                &dp[r0 * s..r1 * s],
                &pb[r0 * s..r1 * s],
                s,
                &mut ds[r0 * s..r1 * s],
            );
            let ds_rows = (ds[r0 * s..].as_ptr(), st, one);
            let k_rows = Self::at(self.k.0, &kv, bh, 0, true);
            // SAFETY: as above.
            unsafe {
                gemm(
                    self.blas,
                    (rows, keys, d),
                    (scale, 0.0),
                    ds_rows,
                    k_rows,
                    dq.matrix(&qv, bh, r0, false),
                )
            };
        }
        // The keys' gradients sum over every query in one product each (as without a
        // causal mask; the queries that do not see a key add exact zeros).
        let d_o = Self::at(d_out, &ov, bh, 0, false);
        let q_rows = Self::at(self.q.0, &qv, bh, 0, false);
        let p_turned = (pb.as_ptr(), one, st);
        let ds_turned = (ds.as_ptr(), one, st);
        // SAFETY: as above.
        unsafe {
            gemm(
                self.blas,
                (s, t, e),
                (1.0, 0.0),
                p_turned,
                d_o,
                dv.matrix(&vv, bh, 0, false),
            );
            gemm(
                self.blas,
                (s, t, d),
                (scale, 0.0),
                ds_turned,
                q_rows,
                dk.matrix(&kv, bh, 0, true),
            );
        }
    }
}
