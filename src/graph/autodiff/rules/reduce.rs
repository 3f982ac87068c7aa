//! ReduceMean and ReduceSum.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints};
use crate::Result;

pub fn reduce(ctx: &mut RuleCtx, mean: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    // ReduceSum takes axes as an input from opset 13, ReduceMean from opset 18.
    let axes_from_input = !mean || ctx.opset >= 18;
    let axes = if axes_from_input {
        ctx.const_ints(1)?
    } else {
        attr_ints(ctx.node, "axes")
    };
    let noop_if_empty = attr_i(ctx.node, "noop_with_empty_axes").unwrap_or(0) != 0;
    let axes: Vec<usize> = match axes.filter(|a| !a.is_empty()) {
        Some(a) => a
            .iter()
            .map(|&ax| {
                if ax < 0 {
                    (ax + sx.len() as i64) as usize
                } else {
                    ax as usize
                }
            })
            .collect(),
        None if noop_if_empty => return Ok(vec![Some(dy), None]),
        None => (0..sx.len()).collect(),
    };
    let mut kept = sx.clone();
    for &a in &axes {
        kept[a] = 1;
    }
    let count: usize = axes.iter().map(|&a| sx[a]).product();
    let r = ctx.e.reshape(&dy, &kept);
    let s = ctx
        .e
        .ints(&sx.iter().map(|&d| d as i64).collect::<Vec<_>>());
    let full = ctx.e.op("Expand", &[&r, &s], vec![]);
    let dx = if mean {
        ctx.e.scale(&full, 1.0 / count as f64, t)
    } else {
        full
    };
    Ok(vec![Some(dx), None])
}
