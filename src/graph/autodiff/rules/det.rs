//! `Det`: `d det(X) / dX = C`, the cofactor matrix, `C[i, j] = (-1)^(i+j) det(M[i, j])`
//! with `M[i, j]` the minor of X without row i and column j. For n up to
//! [`COFACTORS_UP_TO`] the rule computes the cofactors themselves: the n^2 minors picked
//! with two `Gather`s of constant row and column lists, one batched `Det` of them, the
//! signs as a constant. That is exact where X is singular too (PyTorch's backward goes
//! through an SVD there). Above, `C = det(X) inverse(X)^T` needs an inverse, which ONNX
//! has no operator for: ONNX Runtime's contrib `Inverse` where contrib ops are allowed,
//! else the node is refused. ONNX Runtime's training build has no gradient for `Det`.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{int_attr, ints_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// The largest matrices whose gradient is the cofactors (n^4 values per matrix).
pub const COFACTORS_UP_TO: usize = 16;

pub fn det(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let rank = sx.len();
    if rank < 2 || sx[rank - 1] != sx[rank - 2] {
        return Err(ctx.unsupported(format!("X of shape {sx:?} is not square matrices")));
    }
    let n = sx[rank - 1];
    // dY, one value per matrix, against each matrix's values.
    let last_two = ctx.e.ints(&[-2, -1]);
    let dy = ctx.e.op("Unsqueeze", &[&dy, &last_two], vec![]);
    let c = match n {
        // A 1 x 1 matrix is its determinant: dY itself, already of X's shape.
        1 => return Ok(vec![Some(dy)]),
        n if n <= COFACTORS_UP_TO => cofactors(ctx, &x, rank, n, t)?,
        _ if ctx.e.contrib => {
            let inverse = ctx.e.fresh("Inverse");
            ctx.e.node("Inverse", "com.microsoft", &[&x], &[&inverse], vec![]);
            let r = rank as i64;
            let perm: Vec<i64> = (0..r - 2).chain([r - 1, r - 2]).collect();
            let inv_t = ctx.e.op("Transpose", &[&inverse], vec![ints_attr("perm", &perm)]);
            let det = ctx.node.output[0].clone();
            let det = ctx.e.op("Unsqueeze", &[&det, &last_two], vec![]);
            ctx.e.mul(&inv_t, &det)
        }
        n => {
            return Err(ctx.unsupported(format!(
                "{n} x {n} matrices need an inverse (ONNX has none): allow ONNX Runtime's contrib ops (runtime.standard_ops_only = false) or keep n <= {COFACTORS_UP_TO}"
            )))
        }
    };
    Ok(vec![Some(ctx.e.mul(&c, &dy))])
}

/// The cofactor matrices of `x` (`[..., n, n]`, of `rank`).
fn cofactors(ctx: &mut RuleCtx, x: &str, rank: usize, n: usize, t: DType) -> Result<String> {
    // Row (or column) lists without i, for every i: [n, n - 1].
    let others: Vec<i64> = (0..n)
        .flat_map(|i| (0..n).filter(move |&r| r != i).map(|r| r as i64))
        .collect();
    let others = ctx.e.constant(Tensor::i64(vec![n, n - 1], others)?);
    let r = rank as i64;
    // [..., i, r, col], then [..., i, r, j, c].
    let rows = ctx
        .e
        .op("Gather", &[x, &others], vec![int_attr("axis", r - 2)]);
    let minors = ctx
        .e
        .op("Gather", &[&rows, &others], vec![int_attr("axis", r)]);
    let batch = 0..r - 2;
    let perm: Vec<i64> = batch.chain([r - 2, r, r - 1, r + 1]).collect();
    let minors = ctx
        .e
        .op("Transpose", &[&minors], vec![ints_attr("perm", &perm)]);
    let dets = ctx.e.op("Det", &[&minors], vec![]);
    let signs: Vec<f64> = (0..n * n)
        .map(|k| if (k / n + k % n) % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let signs = match t {
        DType::F64 => Tensor::f64(vec![n, n], signs)?,
        _ => Tensor::f32(vec![n, n], signs.iter().map(|&s| s as f32).collect())?,
    };
    let signs = ctx.e.constant(signs);
    Ok(ctx.e.mul(&dets, &signs))
}
