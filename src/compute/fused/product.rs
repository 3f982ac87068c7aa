//! `BlasMatMul`: a float32 matrix product by a CBLAS, MKL or OpenBLAS (`compute::blas`),
//! where ONNX Runtime's CPU provider would run MLAS. `A, B[, C]` in, `Y = alpha op(A) op(B) + beta
//! C` out, with `transA`, `transB`, `alpha` and `beta` as `Gemm` and `FusedMatMul` have
//! them; `B` a matrix, `A` a matrix or, untransposed, a stack of rows (`[..., M, K]`, its
//! leading axes kept in `Y`); `C` the bias, `[N]`, `[1, N]` or `[M, N]`
//! (`graph::fusion::blas_products` writes it only where the shapes fit).
//!
//! The product is cut along the longer of `Y`'s two axes, each block packing the other
//! operand once, as OpenBLAS's own threads would. Where the library sums a value of `Y`
//! in the same order whatever block it is in (`compute/blas/cut.rs` asks it when it
//! loads), the cut is one block per intra-op thread, and results do not depend on the
//! thread count. Where it does not, it is one block per core of the machine, whatever the
//! session's threads, so that they still do not: a session with fewer threads than cores
//! runs several blocks on each, packing the other operand once per block. Of the
//! libraries tried, OpenBLAS's Haswell kernels change a row's bits with any block, MKL's
//! and OpenBLAS's Skylake-X kernels with blocks of a few rows (which the last block of a
//! cut can be), and only OpenBLAS's Sandy Bridge kernels never.

use std::sync::Arc;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output};
use crate::compute::blas::{Blas, Product};
use crate::graph::custom_ops::BLAS_MATMUL;

/// The operator, with the library it calls and how many blocks a product is cut into.
pub(crate) struct BlasMatMul {
    blas: Arc<Blas>,
    /// How many blocks a product is cut into (see the module's notes).
    blocks: usize,
}

impl BlasMatMul {
    /// The operator calling `blas`, in a session of `threads` intra-op threads.
    pub(crate) fn new(blas: Arc<Blas>, threads: usize) -> BlasMatMul {
        let blocks = match blas.cut_keeps_bits() {
            true => threads,
            false => std::thread::available_parallelism().map_or(threads, |n| n.get()),
        };
        BlasMatMul {
            blas,
            blocks: blocks.max(1),
        }
    }
}

/// The smallest block (rows or columns): OpenBLAS's register tiles are 16 wide.
const ALIGN: usize = 16;

/// A product's attributes, read once per node.
#[derive(Clone, Copy)]
struct Attrs {
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
}

impl Operator for BlasMatMul {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        BLAS_MATMUL
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let f32 = TensorElementType::Float32;
        [
            OperatorInput::required(f32),
            OperatorInput::required(f32),
            OperatorInput::optional(f32),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let flag = |name: &str| info.get::<i64>(name).unwrap_or(0) != 0;
        let attrs = Attrs {
            trans_a: flag("transA"),
            trans_b: flag("transB"),
            alpha: info.get::<f32>("alpha").unwrap_or(1.0),
            beta: info.get::<f32>("beta").unwrap_or(1.0),
        };
        let (blas, blocks) = (self.blas.clone(), self.blocks);
        Ok(Box::new(move |ctx: &ComputeContext| {
            compute(ctx, &blas, blocks, attrs)
        }))
    }
}

/// One call: checks the shapes, writes the bias, runs the blocks.
fn compute(ctx: &ComputeContext, blas: &Blas, blocks: usize, at: Attrs) -> ort::Result<()> {
    let op = BLAS_MATMUL;
    let a = input(ctx, op, 0)?;
    let b = input(ctx, op, 1)?;
    let (a_shape, a) = a.try_extract_tensor::<f32>()?;
    let (b_shape, b) = b.try_extract_tensor::<f32>()?;
    let dims = |s: &[i64]| s.iter().map(|&d| d.max(0) as usize).collect::<Vec<_>>();
    let (ad, bd) = (dims(a_shape), dims(b_shape));
    let fits = bd.len() == 2 && (ad.len() == 2 || (ad.len() > 2 && !at.trans_a));
    if !fits {
        return Err(ort::Error::new(format!(
            "{op}: A {ad:?} and B {bd:?}: B must be a matrix, A a matrix or untransposed rows"
        )));
    }
    let rows: usize = ad[..ad.len() - 1].iter().product();
    let (m, k) = match at.trans_a {
        true => (ad[1], ad[0]),
        false => (rows, ad[ad.len() - 1]),
    };
    let (kb, n) = if at.trans_b {
        (bd[1], bd[0])
    } else {
        (bd[0], bd[1])
    };
    if k != kb {
        return Err(ort::Error::new(format!(
            "{op}: A {ad:?} and B {bd:?} do not multiply (transA {}, transB {})",
            at.trans_a, at.trans_b
        )));
    }
    let mut y_shape: Vec<i64> = match at.trans_a {
        true => vec![m as i64],
        false => a_shape[..a_shape.len() - 1].to_vec(),
    };
    y_shape.push(n as i64);
    let mut y = output(ctx, op, 0, &y_shape)?;
    let (_, y) = y.try_extract_tensor_mut::<f32>()?;
    let c_in = ctx.input(2)?;
    let c = match &c_in {
        Some(c) => Some(bias(c, m, n)?),
        None => None,
    };
    let p = Product {
        m,
        n,
        k,
        trans_a: at.trans_a,
        trans_b: at.trans_b,
        alpha: at.alpha,
        beta: if c.is_some() { 1.0 } else { 0.0 },
    };
    let (lda, ldb) = (
        if at.trans_a { m } else { k },
        if at.trans_b { k } else { n },
    );
    let c = c.map(|c| (c, at.beta));
    run_blocks(ctx, blas, blocks, &p, (a, lda), (b, ldb), (y, c))
}

/// `C`'s values, a row of `n` (broadcast over the rows) or all `m x n`.
fn bias<'c>(c: &'c ort::value::ValueRef<'_>, m: usize, n: usize) -> ort::Result<&'c [f32]> {
    let (_, c) = c.try_extract_tensor::<f32>()?;
    if c.len() != n && c.len() != m * n {
        return Err(ort::Error::new(format!(
            "{BLAS_MATMUL}: C has {} values; it must be a row of {n} or {m} x {n}",
            c.len()
        )));
    }
    Ok(c)
}

/// `y`'s base pointer, shared by the blocks, each of which writes only its own rows or
/// columns.
struct Out(*mut f32);
// SAFETY: the blocks write disjoint elements of the buffer `Out` points into, which
// outlives `par_for`.
unsafe impl Sync for Out {}
unsafe impl Send for Out {}

impl Out {
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// Cuts the product into at most `cut` blocks of whole rows (`m >= n`) or columns of
/// `y` and runs them on ONNX Runtime's intra-op threads; with `c` (`C` and `beta`),
/// each block first writes its part of `beta C` into `y`, which the product adds to.
fn run_blocks(
    ctx: &ComputeContext,
    blas: &Blas,
    cut: usize,
    p: &Product,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (y, c): (&mut [f32], Option<(&[f32], f32)>),
) -> ort::Result<()> {
    let by_rows = p.m >= p.n;
    let len = if by_rows { p.m } else { p.n };
    let per = len.div_ceil(cut).div_ceil(ALIGN).max(1) * ALIGN;
    let blocks = len.div_ceil(per).max(1);
    let (n, y_len, out) = (p.n, y.len(), Out(y.as_mut_ptr()));
    let block = |i: usize| {
        let (lo, hi) = (i * per, ((i + 1) * per).min(len));
        // `y`'s elements from the block's first one to the end, as OpenBLAS addresses
        // them (row-major, `n` a row).
        let start = if by_rows { lo * n } else { lo };
        let q = match by_rows {
            true => Product { m: hi - lo, ..*p },
            false => Product { n: hi - lo, ..*p },
        };
        let (a, b) = match (by_rows, p.trans_a, p.trans_b) {
            (true, false, _) => (&a[lo * lda..], b),
            (true, true, _) => (&a[lo..], b),
            (false, _, false) => (a, &b[lo..]),
            (false, _, true) => (a, &b[lo * ldb..]),
        };
        // SAFETY: `start` is inside `y`, which lives past `par_for`; the block writes
        // only its own rows (or columns) of it, which no other block reads or writes.
        unsafe {
            if let Some(c) = c {
                let (rows, cols) = if by_rows {
                    (lo..hi, 0..n)
                } else {
                    (0..p.m, lo..hi)
                };
                fill(out.ptr(), n, c, (rows, cols));
            }
            let c = (out.ptr().add(start), y_len - start, n);
            blas.sgemm_into(&q, (a, lda), (b, ldb), c);
        }
    };
    match blocks {
        1 => block(0),
        _ => ctx.par_for(blocks, blocks, block)?,
    }
    Ok(())
}

/// Writes `beta C` into `rows x cols` of the row-major `y` (`n` a row): `C` a row of `n`
/// for every row, or all of `y`'s values.
///
/// # Safety
/// `y` points to the product's `m x n` values, `rows` and `cols` are within them, and no
/// other thread reads or writes that part while this runs.
unsafe fn fill(
    y: *mut f32,
    n: usize,
    (c, beta): (&[f32], f32),
    (rows, cols): (std::ops::Range<usize>, std::ops::Range<usize>),
) {
    for r in rows {
        let from = if c.len() == n { 0 } else { r * n };
        // SAFETY: the caller's contract: row `r`'s columns `cols` are this call's alone.
        let row = unsafe { std::slice::from_raw_parts_mut(y.add(r * n + cols.start), cols.len()) };
        let c = &c[from + cols.start..from + cols.end];
        row.iter_mut().zip(c).for_each(|(y, &c)| *y = beta * c);
    }
}

#[cfg(test)]
mod tests;
