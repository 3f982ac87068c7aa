//! Tile, Pad and CumSum: data movement whose gradient gathers `dY` back.

use super::elementwise::shape;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_s, int_attr};
use crate::Result;

/// Tile: `dY` seen as `[r0, d0, r1, d1, ...]` and summed over the repeat axes.
pub fn tile(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let repeats = ctx.const_ints(1)?.unwrap_or_default();
    if repeats.len() != sx.len() || repeats.iter().any(|&r| r < 1) {
        return Err(ctx.unsupported(format!("repeats {repeats:?} for an input of shape {sx:?}")));
    }
    let mut split = Vec::with_capacity(2 * sx.len());
    for (&r, &d) in repeats.iter().zip(&sx) {
        split.extend([r as usize, d]);
    }
    let axes: Vec<i64> = (0..sx.len() as i64).map(|a| 2 * a).collect();
    let v = ctx.e.reshape(&dy, &split);
    let s = ctx.e.reduce_sum(&v, &axes, false);
    let dx = ctx.e.reshape(&s, &sx);
    Ok(vec![Some(dx), None])
}

/// Pad in `constant` mode with non-negative pads: `dY` sliced back to X's window.
pub fn pad(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let rank = sx.len();
    let mode = attr_s(ctx.node, "mode").unwrap_or_else(|| "constant".into());
    if mode != "constant" {
        return Err(ctx.unsupported(format!(
            "mode=\"{mode}\" (only \"constant\" has a gradient)"
        )));
    }
    let pads = if ctx.opset >= 11 {
        ctx.const_ints(1)?.unwrap_or_default()
    } else {
        crate::graph::ir::attr_ints(ctx.node, "pads").unwrap_or_default()
    };
    let axes: Vec<usize> = match ctx.const_ints(3)? {
        Some(a) => a
            .iter()
            .map(|&x| (if x < 0 { x + rank as i64 } else { x }) as usize)
            .collect(),
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() || pads.iter().any(|&p| p < 0) {
        return Err(ctx.unsupported(format!("pads {pads:?} (negative or not one pair per axis)")));
    }
    let k = axes.len();
    let starts: Vec<i64> = pads[..k].to_vec();
    let ends: Vec<i64> = axes
        .iter()
        .enumerate()
        .map(|(i, &a)| pads[i] + sx[a] as i64)
        .collect();
    let axes: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let (s, e, a) = (ctx.e.ints(&starts), ctx.e.ints(&ends), ctx.e.ints(&axes));
    let dx = ctx.e.op("Slice", &[&dy, &s, &e, &a], vec![]);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(dx);
    Ok(g)
}

/// CumSum: the cumulative sum of `dY` taken the other way along the same axis.
pub fn cumsum(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let axis = ctx.input(1).to_string();
    let exclusive = attr_i(ctx.node, "exclusive").unwrap_or(0);
    let reverse = attr_i(ctx.node, "reverse").unwrap_or(0);
    let dx = ctx.e.op(
        "CumSum",
        &[&dy, &axis],
        vec![
            int_attr("exclusive", exclusive),
            int_attr("reverse", 1 - reverse),
        ],
    );
    Ok(vec![Some(dx), None])
}
