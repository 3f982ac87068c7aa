//! ReduceMean, ReduceSum and ReduceMax.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, int_attr};
use crate::Result;

/// The axes a reduction of a value of rank `rank` reduces, non-negative; `None` when it
/// reduces nothing (`noop_with_empty_axes` with no axes). The axes are an input from
/// opset 18 (ReduceSum: 13), an attribute before.
fn reduced_axes(ctx: &RuleCtx, rank: usize, axes_from_input: bool) -> Result<Option<Vec<usize>>> {
    let axes = if axes_from_input {
        ctx.const_ints(1)?
    } else {
        attr_ints(ctx.node, "axes")
    };
    let noop_if_empty = attr_i(ctx.node, "noop_with_empty_axes").unwrap_or(0) != 0;
    Ok(match axes.filter(|a| !a.is_empty()) {
        Some(a) => Some(
            a.iter()
                .map(|&ax| if ax < 0 { ax + rank as i64 } else { ax } as usize)
                .collect(),
        ),
        None if noop_if_empty => None,
        None => Some((0..rank).collect()),
    })
}

/// `shape` with the `axes` kept as 1.
fn kept_dims(shape: &[usize], axes: &[usize]) -> Vec<usize> {
    let mut kept = shape.to_vec();
    for &a in axes {
        kept[a] = 1;
    }
    kept
}

pub fn reduce(ctx: &mut RuleCtx, mean: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let Some(axes) = reduced_axes(ctx, sx.len(), !mean || ctx.opset >= 18)? else {
        return Ok(vec![Some(dy), None]);
    };
    let count: usize = axes.iter().map(|&a| sx[a]).product();
    let r = ctx.e.reshape(&dy, &kept_dims(&sx, &axes));
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

/// ReduceMax: `dY` shared evenly among the positions equal to the maximum (PyTorch's
/// `amax`).
pub fn reduce_max(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, y) = (ctx.input(0).to_string(), ctx.output(0).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let Some(axes) = reduced_axes(ctx, sx.len(), ctx.opset >= 18)? else {
        return Ok(vec![Some(dy), None]);
    };
    let kept = kept_dims(&sx, &axes);
    let y_kept = ctx.e.reshape(&y, &kept);
    let dy_kept = ctx.e.reshape(&dy, &kept);
    let hit = ctx.e.op("Equal", &[&x, &y_kept], vec![]);
    let hit = ctx
        .e
        .op("Cast", &[&hit], vec![int_attr("to", t.onnx() as i64)]);
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let count = ctx.e.reduce_sum(&hit, &ax, true);
    let share = ctx.e.op("Div", &[&dy_kept, &count], vec![]);
    Ok(vec![Some(ctx.e.mul(&hit, &share)), None])
}
