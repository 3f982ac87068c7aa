//! A product of matrices each stored row- or column-major with its own leading dimension
//! (the attention kernel's heads, read in place: `compute/fused/attention/head.rs`).

use std::ffi::c_int;

use super::{Blas, NO_TRANS, ROW_MAJOR, TRANS};

/// A matrix at a pointer with its row and column strides (in values).
type Strided<T> = (T, isize, isize);

impl Blas {
    /// `c = alpha a b + beta c` for `a` (`m x k`), `b` (`k x n`) and `c` (`m x n`) at
    /// the given strides, where each matrix has a unit stride on one axis and the other
    /// at least its extent there (a row-major or column-major matrix); returns `false`,
    /// having done nothing, where one does not.
    ///
    /// # Safety
    /// Every element the strides reach from `a`, `b` and `c` is live, and no other
    /// thread reads or writes the elements of `c` while it runs.
    pub unsafe fn sgemm_strided(
        &self,
        (m, k, n): (usize, usize, usize),
        (alpha, beta): (f32, f32),
        a: Strided<*const f32>,
        b: Strided<*const f32>,
        c: Strided<*mut f32>,
    ) -> bool {
        if m == 0 || n == 0 || k == 0 {
            return false;
        }
        // A column-major `c` is the row-major `c^T = b^T a^T`.
        let (m, n, a, b, c) = match (c.1, c.2) {
            (_, 1) => (m, n, a, b, c),
            (1, _) => (n, m, (b.0, b.2, b.1), (a.0, a.2, a.1), (c.0, c.2, c.1)),
            _ => return false,
        };
        let layout = |(rs, cs): (isize, isize), rows: usize, cols: usize| {
            let (rs, cs) = (usize::try_from(rs).ok()?, usize::try_from(cs).ok()?);
            match (rs, cs) {
                (ld, 1) if ld >= cols.max(1) || rows == 1 => Some((NO_TRANS, ld.max(cols))),
                (1, ld) if ld >= rows.max(1) || cols == 1 => Some((TRANS, ld.max(rows))),
                _ => None,
            }
        };
        let (Some((ta, lda)), Some((tb, ldb))) =
            (layout((a.1, a.2), m, k), layout((b.1, b.2), k, n))
        else {
            return false;
        };
        let ldc = c.1 as usize;
        let fits = |v: usize| c_int::try_from(v).is_ok();
        if ldc < n || ![m, n, k, lda, ldb, ldc].into_iter().all(fits) {
            return false;
        }
        // SAFETY: the caller's contract; the layouts address exactly the elements the
        // strides reach.
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                ta,
                tb,
                m as c_int,
                n as c_int,
                k as c_int,
                alpha,
                a.0,
                lda as c_int,
                b.0,
                ldb as c_int,
                beta,
                c.0,
                ldc as c_int,
            );
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{naive, venv_blas};

    /// Every layout of `a`, `b` and `c` (row- or column-major, with a leading dimension
    /// wider than the matrix): the sums, with `alpha` and `beta`; a matrix with no unit
    /// stride is refused.
    #[test]
    fn strided_products_take_row_and_column_major_matrices() {
        let Some(blas) = venv_blas() else {
            eprintln!("skipped: no BLAS beside ONNX Runtime");
            return;
        };
        let (m, k, n, pad) = (9, 13, 7, 3);
        let value = |i: usize, j: usize, s: usize| ((i * 31 + j * 17 + s) % 23) as f32 / 23.0 - 0.5;
        // A matrix of `rows x cols` stored row- or column-major with `pad` spare values
        // a line: its values and strides.
        let stored = |rows: usize, cols: usize, seed: usize, turned: bool| {
            let (lines, len) = if turned { (cols, rows) } else { (rows, cols) };
            let ld = len + pad;
            let mut v = vec![f32::NAN; lines * ld];
            for i in 0..rows {
                for j in 0..cols {
                    let at = if turned { j * ld + i } else { i * ld + j };
                    v[at] = value(i, j, seed);
                }
            }
            let strides = if turned {
                (1, ld as isize)
            } else {
                (ld as isize, 1)
            };
            (v, strides)
        };
        let a: Vec<f32> = (0..m * k).map(|x| value(x / k, x % k, 1)).collect();
        let b: Vec<f32> = (0..k * n).map(|x| value(x / n, x % n, 2)).collect();
        let ab = naive(&a, &b, m, k, n);
        for layout in 0..8 {
            let (ta, tb, tc) = (layout & 1 != 0, layout & 2 != 0, layout & 4 != 0);
            let (av, (ar, ac)) = stored(m, k, 1, ta);
            let (bv, (br, bc)) = stored(k, n, 2, tb);
            let (mut cv, (cr, cc)) = stored(m, n, 3, tc);
            let c0 = cv.clone();
            // SAFETY: the strides reach only the stored matrices' values.
            let done = unsafe {
                blas.sgemm_strided(
                    (m, k, n),
                    (0.5, 2.0),
                    (av.as_ptr(), ar, ac),
                    (bv.as_ptr(), br, bc),
                    (cv.as_mut_ptr(), cr, cc),
                )
            };
            assert!(done, "layout {layout}");
            for i in 0..m {
                for j in 0..n {
                    let at = (i as isize * cr + j as isize * cc) as usize;
                    let want = 0.5 * ab[i * n + j] + 2.0 * f64::from(c0[at]);
                    let got = f64::from(cv[at]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "layout {layout} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
        let (av, _) = stored(m, k, 1, false);
        let (bv, _) = stored(k, n, 2, false);
        let mut cv = vec![0.0; m * n * 4];
        // SAFETY: `a` read with strides (2 (k + pad), 2) reaches no further than it is.
        let done = unsafe {
            blas.sgemm_strided(
                (m / 2, k / 2, n),
                (1.0, 0.0),
                (av.as_ptr(), 2 * (k + pad) as isize, 2),
                (bv.as_ptr(), (n + pad) as isize, 1),
                (cv.as_mut_ptr(), n as isize, 1),
            )
        };
        assert!(!done, "a matrix with no unit stride");
    }
}
