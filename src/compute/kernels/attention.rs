//! Attention's plan on a GPU (`compute/cuda_attention.rs`): the products as cuBLAS's
//! strided batched GEMMs over the heads of each batch entry, reading Q, K, V and writing O
//! and the gradients where they lie (a packed `[B, T, 3 H D]` tensor's parts, any
//! transpose whose rows or columns are contiguous: no copies), and `attention.cu`'s row
//! kernels between them. The formulas are the CPU kernel's (`compute/fused/attention`):
//!
//! ```text
//! forward   S = scale q kt [+ mask];  P = softmax(S) (causal: query i sees keys up to
//!           i + S - T);
//!           O = P v
//! backward  dP = dO v^T;  dS = scale P (dP - rowsum(dP P));  dv = P^T dO;
//!           dq = dS kt^T;  dkt = q^T dS
//! ```
//!
//! P is the forward's second output, `[B, H, T, S]`, kept for the backward; the backward
//! needs one batch entry's dP (`[H, T, S]`) of scratch.

use super::{Arg, Launch};

/// Attention's row kernels, and the flash kernels (`flash.cu`, planned by `flash.rs`).
pub const ATTENTION_SOURCE: &str = concat!(include_str!("attention.cu"), include_str!("flash.cu"));

/// A matrix of each (batch entry, head): `rows` x `cols` float32 values, element (i, j)
/// at `at + 4 (i rs + j cs)` for batch entry 0 and head 0, each head `hs` values on and
/// each batch entry `bs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mat {
    /// Element (0, 0) of batch entry 0, head 0.
    pub at: u64,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Values from one row to the next.
    pub rs: usize,
    /// Values from one column to the next.
    pub cs: usize,
    /// Values from one head to the next.
    pub hs: usize,
    /// Values from one batch entry to the next.
    pub bs: usize,
}

impl Mat {
    /// The CPU kernel's view of a tensor (`[B, H, rows, cols]` at strides) whose values
    /// start at `base`.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn of(view: &crate::compute::fused::View, base: u64) -> Mat {
        let [_, _, rows, cols] = view.dims;
        let [bs, hs, rs, cs] = view.strides;
        Mat {
            at: base + 4 * view.offset as u64,
            rows,
            cols,
            rs,
            cs,
            hs,
            bs,
        }
    }

    /// Row-major `[B, H, rows, cols]` values at `at`.
    pub fn dense(at: u64, heads: usize, rows: usize, cols: usize) -> Mat {
        Mat {
            at,
            rows,
            cols,
            rs: cols,
            cs: 1,
            hs: rows * cols,
            bs: heads * rows * cols,
        }
    }

    /// The transpose (the same values).
    pub fn t(self) -> Mat {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Batch entry `b`'s heads.
    fn entry(self, b: usize) -> Mat {
        Mat {
            at: self.at + 4 * (b * self.bs) as u64,
            ..self
        }
    }

    /// How cuBLAS (column-major) reads it: `(transposed, leading dimension)`; `None`
    /// where neither its rows nor its columns are contiguous.
    fn operand(&self) -> Option<(bool, usize)> {
        if self.rs == 1 && self.cs >= self.rows.max(1) {
            Some((false, self.cs))
        } else if self.cs == 1 && self.rs >= self.cols.max(1) {
            Some((true, self.rs))
        } else {
            None
        }
    }
}

/// One `cublasSgemmStridedBatched` call, its arguments as cuBLAS takes them
/// (column-major; strides in values): `C = alpha op(A) op(B) + beta C` for each of
/// `batch` matrices.
#[derive(Debug, Clone, Copy, PartialEq)]
#[allow(missing_docs)] // cuBLAS's own parameters, by cuBLAS's names
pub struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    pub a: u64,
    pub lda: i32,
    pub stride_a: i64,
    pub b: u64,
    pub ldb: i32,
    pub stride_b: i64,
    pub beta: f32,
    pub c: u64,
    pub ldc: i32,
    pub stride_c: i64,
    pub batch: i32,
}

/// A step of a plan: a kernel of ours, or a product on cuBLAS.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A kernel of ours.
    Kernel(Launch),
    /// A product on cuBLAS.
    Gemm(Gemm),
}

/// `c = alpha a b` for each of `heads` heads.
///
/// # Errors
/// Where a matrix has neither contiguous rows nor contiguous columns, or the shapes do
/// not agree.
fn product(c: Mat, a: Mat, b: Mat, alpha: f32, heads: usize) -> Result<Gemm, String> {
    if a.rows != c.rows || b.cols != c.cols || a.cols != b.rows {
        return Err(format!(
            "a product of {}x{} by {}x{} into {}x{}",
            a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
        ));
    }
    let strided = || format!("a matrix with strides {c:?}, {a:?}, {b:?} (none contiguous)");
    let (turned, ldc) = c.operand().ok_or_else(strided)?;
    if turned {
        // C is row-major: C^T = B^T A^T, column-major.
        return product(c.t(), b.t(), a.t(), alpha, heads);
    }
    let ((ta, lda), (tb, ldb)) = (
        a.operand().ok_or_else(strided)?,
        b.operand().ok_or_else(strided)?,
    );
    Ok(Gemm {
        trans_a: ta,
        trans_b: tb,
        m: c.rows as i32,
        n: c.cols as i32,
        k: a.cols as i32,
        alpha,
        a: a.at,
        lda: lda as i32,
        stride_a: a.hs as i64,
        b: b.at,
        ldb: ldb as i32,
        stride_b: b.hs as i64,
        beta: 0.0,
        c: c.at,
        ldc: ldc as i32,
        stride_c: c.hs as i64,
        batch: heads as i32,
    })
}

/// Where one attention's tensors are: `q` `[T, D]`, `kt` `[D, S]`, `v` `[S, E]`, `o`
/// (or `dO`) `[T, E]` for each (batch entry, head), and the probabilities `p`
/// (`[B, H, T, S]`, row-major).
#[derive(Debug, Clone, Copy)]
pub struct AttentionAt {
    /// Batch entries (B).
    pub batch: usize,
    /// Heads (H).
    pub heads: usize,
    /// The queries, `[T, D]`.
    pub q: Mat,
    /// The keys, turned: `[D, S]`.
    pub kt: Mat,
    /// The values, `[S, E]`.
    pub v: Mat,
    /// The output (the forward) or its gradient (the backward), `[T, E]`.
    pub o: Mat,
    /// The probabilities, `[B, H, T, S]` row-major.
    pub p: u64,
    /// An additive mask over `[B, H, T, S]`: where, and its strides (0 where it is
    /// broadcast). Read by the forward only.
    pub mask: Option<(u64, [usize; 4])>,
}

impl AttentionAt {
    fn p(&self) -> Mat {
        Mat::dense(self.p, self.heads, self.q.rows, self.kt.cols)
    }

    fn row_launch(&self, kernel: &'static str, rows: usize, args: Vec<Arg>) -> Launch {
        Launch::new(kernel, (rows.clamp(1, 1 << 20) as u32, 1), args)
    }
}

/// The forward: scores into `p`, their softmax in place, then `o`.
///
/// # Errors
/// As [`product`].
pub fn attention(x: &AttentionAt, scale: f32, causal: bool) -> Result<Vec<Step>, String> {
    let (t, s) = (x.q.rows, x.kt.cols);
    let rows = x.batch * x.heads * t;
    let p = x.p();
    let mut steps = Vec::with_capacity(2 * x.batch + 1);
    for b in 0..x.batch {
        let (q, kt) = (x.q.entry(b), x.kt.entry(b));
        steps.push(Step::Gemm(product(p.entry(b), q, kt, scale, x.heads)?));
    }
    let (mask, [mb, mh, mt, ms]) = x.mask.unwrap_or((0, [0; 4]));
    let mut args = vec![
        Arg::Ptr(x.p),
        Arg::I64(rows as i64),
        Arg::I32(s as i32),
        Arg::I32(t as i32),
        Arg::I32(causal as i32),
        Arg::Ptr(mask),
        Arg::I32(x.heads as i32),
    ];
    args.extend([mb, mh, mt, ms].map(|v| Arg::I64(v as i64)));
    steps.push(Step::Kernel(x.row_launch("attn_softmax", rows, args)));
    for b in 0..x.batch {
        let (o, v) = (x.o.entry(b), x.v.entry(b));
        steps.push(Step::Gemm(product(o, p.entry(b), v, 1.0, x.heads)?));
    }
    Ok(steps)
}

/// Where the backward writes: the gradients of q, kt and v, laid out as those (`zero`:
/// values of a packed gradient no part covers, zeroed first), and its scratch
/// ([`attention_grad_scratch`] floats).
#[derive(Debug, Clone, Copy)]
pub struct AttentionGradAt {
    /// q's gradient.
    pub dq: Mat,
    /// kt's gradient.
    pub dkt: Mat,
    /// v's gradient.
    pub dv: Mat,
    /// Values to zero first: where, and how many.
    pub zero: Option<(u64, usize)>,
    /// One batch entry's dP.
    pub scratch: u64,
}

/// The floats of scratch the backward needs: one batch entry's dP.
pub fn attention_grad_scratch(x: &AttentionAt) -> usize {
    x.heads * x.q.rows * x.kt.cols
}

/// The backward, one batch entry after another (`x.o` is `dO`).
///
/// # Errors
/// As [`product`].
pub fn attention_grad(
    x: &AttentionAt,
    g: &AttentionGradAt,
    scale: f32,
) -> Result<Vec<Step>, String> {
    let (t, s) = (x.q.rows, x.kt.cols);
    let (p, dp) = (x.p(), Mat::dense(g.scratch, x.heads, t, s));
    let mut steps = Vec::with_capacity(5 * x.batch + 1);
    if let Some((at, n)) = g.zero {
        let zero = Launch::new(
            "attn_zero",
            (super::blocks_for(n), 1),
            vec![Arg::Ptr(at), Arg::I64(n as i64)],
        );
        steps.push(Step::Kernel(zero));
    }
    for b in 0..x.batch {
        let (q, kt, v, d_o, p) = (
            x.q.entry(b),
            x.kt.entry(b),
            x.v.entry(b),
            x.o.entry(b),
            p.entry(b),
        );
        steps.push(Step::Gemm(product(dp, d_o, v.t(), 1.0, x.heads)?));
        let rows = x.heads * t;
        let args = vec![
            Arg::Ptr(p.at),
            Arg::Ptr(g.scratch),
            Arg::I64(rows as i64),
            Arg::I32(s as i32),
            Arg::F32(scale),
        ];
        steps.push(Step::Kernel(x.row_launch("attn_softmax_grad", rows, args)));
        steps.push(Step::Gemm(product(
            g.dv.entry(b),
            p.t(),
            d_o,
            1.0,
            x.heads,
        )?));
        steps.push(Step::Gemm(product(
            g.dq.entry(b),
            dp,
            kt.t(),
            1.0,
            x.heads,
        )?));
        steps.push(Step::Gemm(product(
            g.dkt.entry(b),
            q.t(),
            dp,
            1.0,
            x.heads,
        )?));
    }
    Ok(steps)
}
