//! Matrix products: MatMul (batched, broadcasting, 1-D operands) and Gemm.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i};
use crate::Result;

pub fn matmul(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (a, b) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let (sa, sb) = (shape(ctx, &a)?, shape(ctx, &b)?);
    let t = dtype(ctx, &a)?;
    // 1-D operands are matrices with a unit axis (ONNX follows numpy.matmul); work on
    // those and reshape the gradients back at the end.
    let sa2 = if sa.len() == 1 {
        vec![1, sa[0]]
    } else {
        sa.clone()
    };
    let sb2 = if sb.len() == 1 {
        vec![sb[0], 1]
    } else {
        sb.clone()
    };
    let a2 = if sa.len() == 1 {
        ctx.e.reshape(&a, &sa2)
    } else {
        a.clone()
    };
    let b2 = if sb.len() == 1 {
        ctx.e.reshape(&b, &sb2)
    } else {
        b.clone()
    };
    let (ra, rb) = (sa2.len(), sb2.len());
    let batch = broadcast(&sa2[..ra - 2], &sb2[..rb - 2]);
    let (m, k, n) = (sa2[ra - 2], sa2[ra - 1], sb2[rb - 1]);
    let mut sy: Vec<usize> = batch.clone();
    sy.extend([m, n]);
    let dy2 = if sa.len() == 1 || sb.len() == 1 {
        ctx.e.reshape(&dy, &sy)
    } else {
        dy
    };
    let ry = sy.len();
    let mut g = vec![None, None];
    if ctx.needs(0) {
        // dA = dY @ B^T, summed over broadcast batch axes; dY @ W where B = W^T.
        let full = match ctx.untransposed(&b).filter(|_| sb.len() == 2) {
            Some(w) => ctx.e.matmul_t((&dy2, ry), (&w, 2), false, false, 1.0, t),
            None => ctx.e.matmul_t((&dy2, ry), (&b2, rb), false, true, 1.0, t),
        };
        let mut full_shape = batch.clone();
        full_shape.extend([m, k]);
        let d = ctx.e.unbroadcast(&full, &full_shape, &sa2, t);
        g[0] = Some(if sa.len() == 1 {
            ctx.e.reshape(&d, &sa)
        } else {
            d
        });
    }
    if ctx.needs(1) {
        let d = if rb == 2 && ra > 2 {
            // B is shared by every batch row: one (rows x K)^T (rows x N) product.
            let rows = sa2[..ra - 1].iter().product();
            let a_flat = ctx.e.reshape(&a2, &[rows, k]);
            let dy_flat = ctx.e.reshape(&dy2, &[rows, n]);
            ctx.e
                .matmul_t((&a_flat, 2), (&dy_flat, 2), true, false, 1.0, t)
        } else {
            let full = ctx.e.matmul_t((&a2, ra), (&dy2, ry), true, false, 1.0, t);
            let mut full_shape = batch.clone();
            full_shape.extend([k, n]);
            ctx.e.unbroadcast(&full, &full_shape, &sb2, t)
        };
        g[1] = Some(if sb.len() == 1 {
            ctx.e.reshape(&d, &sb)
        } else {
            d
        });
    }
    Ok(g)
}

/// `com.microsoft.FusedMatMul(X, W)` as `graph::fusion` writes a linear layer: `W` a
/// matrix, `transA = 0`, `alpha = 1`, `transB` either. With `transB`, `Y = X W^T`:
/// `dX = dY W` and `dW = dY^T X` over every row of the batch.
pub fn fused_matmul(ctx: &mut RuleCtx) -> Result<Grads> {
    let ta = attr_i(ctx.node, "transA").unwrap_or(0) != 0;
    let tb = attr_i(ctx.node, "transB").unwrap_or(0) != 0;
    let alpha = attr_f(ctx.node, "alpha").unwrap_or(1.0);
    let (x, w) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let (sx, sw) = (shape(ctx, &x)?, shape(ctx, &w)?);
    if ta || alpha != 1.0 || sw.len() != 2 || sx.len() < 2 {
        return Err(ctx.unsupported("only a matrix product of X (rank 2 or more) and a matrix W, with transA = 0 and alpha = 1"));
    }
    let dy = ctx.dy(0)?;
    let t = dtype(ctx, &x)?;
    let (rx, k) = (sx.len(), sx[sx.len() - 1]);
    let n = if tb { sw[0] } else { sw[1] };
    let mut g = vec![None, None];
    if ctx.needs(0) {
        g[0] = Some(ctx.e.matmul_t((&dy, rx), (&w, 2), false, !tb, 1.0, t));
    }
    if ctx.needs(1) {
        let rows: usize = sx[..rx - 1].iter().product();
        let x_flat = ctx.e.reshape(&x, &[rows, k]);
        let dy_flat = ctx.e.reshape(&dy, &[rows, n]);
        g[1] = Some(match tb {
            true => ctx
                .e
                .matmul_t((&dy_flat, 2), (&x_flat, 2), true, false, 1.0, t),
            false => ctx
                .e
                .matmul_t((&x_flat, 2), (&dy_flat, 2), true, false, 1.0, t),
        });
    }
    Ok(g)
}

/// Numpy broadcast of two batch shapes (already checked by ONNX Runtime in the probe).
fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = a.len().checked_sub(n - i).map_or(1, |j| a[j]);
            let db = b.len().checked_sub(n - i).map_or(1, |j| b[j]);
            da.max(db)
        })
        .collect()
}

pub fn gemm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (a, b) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let t = dtype(ctx, &a)?;
    let alpha = attr_f(ctx.node, "alpha").unwrap_or(1.0) as f64;
    let beta = attr_f(ctx.node, "beta").unwrap_or(1.0) as f64;
    let ta = attr_i(ctx.node, "transA").unwrap_or(0) != 0;
    let tb = attr_i(ctx.node, "transB").unwrap_or(0) != 0;
    let mut g = vec![None, None, None];
    // Y = alpha op(A) op(B) + beta C, op = optional transpose.
    if ctx.needs(0) {
        g[0] = Some(if ta {
            // dA = alpha (dY op(B)^T)^T = alpha op(B) dY^T
            ctx.e.matmul_t((&b, 2), (&dy, 2), tb, true, alpha, t)
        } else {
            ctx.e.matmul_t((&dy, 2), (&b, 2), false, !tb, alpha, t)
        });
    }
    if ctx.needs(1) {
        g[1] = Some(if tb {
            // dB = alpha (op(A)^T dY)^T = alpha dY^T op(A)
            ctx.e.matmul_t((&dy, 2), (&a, 2), true, ta, alpha, t)
        } else {
            ctx.e.matmul_t((&a, 2), (&dy, 2), !ta, false, alpha, t)
        });
    }
    if ctx.needs(2) {
        let from = shape(ctx, ctx.output(0))?;
        let to = shape(ctx, ctx.input(2))?;
        let scaled = ctx.e.scale(&dy, beta, t);
        g[2] = Some(ctx.e.unbroadcast(&scaled, &from, &to, t));
    }
    Ok(g)
}
