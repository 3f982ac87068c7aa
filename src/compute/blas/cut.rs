//! Whether a library gives a row (or column) of a product the same bits in a block of
//! any size: what lets `BlasMatMul` (`compute/fused/product.rs`) cut a product into one
//! block per intra-op thread and still compute the same bits on any thread count.
//!
//! It is asked once, when the library loads, by running a 128 x 256 x 64 product whole
//! and cut: its rows 16.., 32.., 48.., 120.. and 125.. alone, and its columns 16.. and
//! 56.. alone. On an AMD EPYC (2026-12-02), OpenBLAS's Haswell kernels changed 348-2,657
//! values at every cut of the first four; its Skylake-X kernels and MKL (sequential) kept
//! the large blocks' bits but not those of blocks of a few rows (their small-matrix
//! paths), and the last block of a cut can be that small; its Sandy Bridge kernels kept
//! them all.

use super::{Blas, Product};

/// Whether `blas` computes the rows 16.., 32.., 48.., 120.. and 125.. of a 128 x 256 x 64
/// product, and its columns 16.. and 56.., bitwise as the whole product does.
pub(super) fn keeps_bits(blas: &Blas) -> bool {
    let (m, k, n) = (128, 256, 64);
    let value = |i: usize, p: usize, q: usize| ((i * p) % q) as f32 / q as f32 - 0.5;
    let a: Vec<f32> = (0..m * k).map(|i| value(i, 7919, 97)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| value(i, 104_729, 89)).collect();
    let p = Product {
        m,
        n,
        k,
        trans_a: false,
        trans_b: false,
        alpha: 1.0,
        beta: 0.0,
    };
    let run = |p: &Product, a: &[f32], b: &[f32], c: &mut [f32]| {
        // SAFETY: `c` is a live, exclusive slice of `c.len()` values.
        unsafe { blas.sgemm_into(p, (a, k), (b, n), (c.as_mut_ptr(), c.len(), n)) }
    };
    let mut whole = vec![0.0; m * n];
    run(&p, &a, &b, &mut whole);
    let rows_keep = [16, 32, 48, 120, 125].into_iter().all(|s| {
        let mut part = vec![0.0; (m - s) * n];
        run(&Product { m: m - s, ..p }, &a[s * k..], &b, &mut part);
        bits(&part) == bits(&whole[s * n..])
    });
    let cols_keep = [16, 56].into_iter().all(|s| {
        let mut cols = vec![0.0; m * n];
        run(&Product { n: n - s, ..p }, &a, &b[s..], &mut cols[s..]);
        (0..m).all(|i| bits(&cols[i * n + s..(i + 1) * n]) == bits(&whole[i * n + s..(i + 1) * n]))
    });
    rows_keep && cols_keep
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
