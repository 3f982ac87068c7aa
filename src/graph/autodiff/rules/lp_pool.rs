//! LpPool and GlobalLpPool, `Y = (sum |x|^p)^(1/p)` over each window (or each plane):
//! `dX = spread(dY Y^(1-p)) |x|^(p-1) sign(x)`, the spread adding each output's share to
//! its window's inputs as AveragePool's gradient does (0 where `Y` is 0: every input of
//! that window is 0). ONNX Runtime's training build has no gradient for them.

use super::elementwise::{dtype, shape};
use super::pool::{spread, windows};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::attr_i;
use crate::tensor::DType;
use crate::Result;

pub fn lp_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let w = windows(ctx)?;
    let p = power(ctx)?;
    let share = share(ctx, p, w.t)?;
    let spread = spread(ctx, &share, &w);
    Ok(vec![Some(times_slope(ctx, &spread, &w.x, p, w.t))])
}

pub fn global_lp_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    if sx.len() < 3 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (no spatial axes)")));
    }
    let p = power(ctx)?;
    // `[N, C, 1, ...]` broadcasts over each plane.
    let share = share(ctx, p, t)?;
    Ok(vec![Some(times_slope(ctx, &share, &x, p, t))])
}

/// The node's `p` (default 2), at least 1.
fn power(ctx: &RuleCtx) -> Result<i64> {
    match attr_i(ctx.node, "p").unwrap_or(2) {
        p if p >= 1 => Ok(p),
        p => Err(ctx.unsupported(format!("p = {p}"))),
    }
}

/// `dY Y^(1-p)`, 0 where `Y` is 0.
fn share(ctx: &mut RuleCtx, p: i64, t: DType) -> Result<String> {
    let dy = ctx.dy(0)?;
    if p == 1 {
        return Ok(dy);
    }
    let y = ctx.output(0).to_string();
    let e = &mut *ctx.e;
    let zero = e.scalar(0.0, t);
    let at_zero = e.op("Equal", &[&y, &zero], vec![]);
    let powered = match p {
        2 => y.clone(),
        _ => {
            let exponent = e.scalar((p - 1) as f64, t);
            e.op("Pow", &[&y, &exponent], vec![])
        }
    };
    let ratio = e.op("Div", &[&dy, &powered], vec![]);
    Ok(e.op("Where", &[&at_zero, &zero, &ratio], vec![]))
}

/// `g |x|^(p-1) sign(x)` (`g x` for p = 2).
fn times_slope(ctx: &mut RuleCtx, g: &str, x: &str, p: i64, t: DType) -> String {
    let e = &mut *ctx.e;
    let slope = match p {
        1 => e.op("Sign", &[x], vec![]),
        2 => x.to_string(),
        _ => {
            let a = e.op("Abs", &[x], vec![]);
            let exponent = e.scalar((p - 1) as f64, t);
            let m = e.op("Pow", &[&a, &exponent], vec![]);
            let s = e.op("Sign", &[x], vec![]);
            e.mul(&m, &s)
        }
    };
    e.mul(g, &slope)
}
