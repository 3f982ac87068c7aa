//! The reductions: ReduceMean, ReduceSum, ReduceMax and ReduceMin, ReduceL1, ReduceL2,
//! ReduceSumSquare, ReduceLogSum, ReduceLogSumExp and ReduceProd.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, int_attr, ints_attr};
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

/// What the gradients of ReduceMax and the pointwise reductions read: the input `x`
/// (shape `sx`, type `t`), the reduced `axes`, and `y` and `dY` with those axes kept (of
/// size 1, to broadcast against `x`).
struct Kept {
    x: String,
    sx: Vec<usize>,
    t: crate::tensor::DType,
    axes: Vec<usize>,
    y_kept: String,
    dy_kept: String,
}

/// [`Kept`] for the node; `None` where it reduces nothing (its gradient is `dY`).
fn kept(ctx: &mut RuleCtx) -> Result<Option<Kept>> {
    let dy = ctx.dy(0)?;
    let (x, y) = (ctx.input(0).to_string(), ctx.output(0).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let Some(axes) = reduced_axes(ctx, sx.len(), ctx.opset >= 18)? else {
        return Ok(None);
    };
    let dims = kept_dims(&sx, &axes);
    let y_kept = ctx.e.reshape(&y, &dims);
    let dy_kept = ctx.e.reshape(&dy, &dims);
    Ok(Some(Kept {
        x,
        sx,
        t,
        axes,
        y_kept,
        dy_kept,
    }))
}

/// ReduceMax (and ReduceMin): `dY` shared evenly among the positions equal to the
/// extremum (PyTorch's `amax`).
pub fn reduce_max(ctx: &mut RuleCtx) -> Result<Grads> {
    let Some(Kept {
        x,
        t,
        axes,
        y_kept,
        dy_kept,
        ..
    }) = kept(ctx)?
    else {
        return Ok(vec![Some(ctx.dy(0)?), None]);
    };
    let hit = ctx.e.op("Equal", &[&x, &y_kept], vec![]);
    let hit = ctx
        .e
        .op("Cast", &[&hit], vec![int_attr("to", t.onnx() as i64)]);
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let count = ctx.e.reduce_sum(&hit, &ax, true);
    let share = ctx.e.op("Div", &[&dy_kept, &count], vec![]);
    Ok(vec![Some(ctx.e.mul(&hit, &share)), None])
}

/// The reductions whose gradient is `dY` (kept dims, broadcast) times a local factor of
/// `x` and `y` (kept dims):
/// - ReduceL2, `y = sqrt(sum x^2)`: `x / y` (0 where `y` is 0, as PyTorch's `norm`);
/// - ReduceL1, `y = sum |x|`: `sign(x)`;
/// - ReduceSumSquare, `y = sum x^2`: `2 x`;
/// - ReduceLogSum, `y = log(sum x)`: `1 / exp(y)`;
/// - ReduceLogSumExp, `y = log(sum exp(x))`: `exp(x - y)`.
pub fn reduce_pointwise(ctx: &mut RuleCtx, kind: &str) -> Result<Grads> {
    let Some(Kept {
        x,
        sx,
        t,
        y_kept,
        dy_kept,
        ..
    }) = kept(ctx)?
    else {
        return Ok(vec![Some(ctx.dy(0)?), None]);
    };
    let factor = match kind {
        "ReduceL2" => {
            let ratio = ctx.e.op("Div", &[&x, &y_kept], vec![]);
            let zero = ctx.e.scalar(0.0, t);
            let at_zero = ctx.e.op("Equal", &[&y_kept, &zero], vec![]);
            ctx.e.op("Where", &[&at_zero, &zero, &ratio], vec![])
        }
        "ReduceL1" => ctx.e.op("Sign", &[&x], vec![]),
        "ReduceSumSquare" => ctx.e.scale(&x, 2.0, t),
        "ReduceLogSum" => {
            let sum = ctx.e.op("Exp", &[&y_kept], vec![]);
            let share = ctx.e.op("Reciprocal", &[&sum], vec![]);
            let s = ctx
                .e
                .ints(&sx.iter().map(|&d| d as i64).collect::<Vec<_>>());
            ctx.e.op("Expand", &[&share, &s], vec![])
        }
        _ => {
            let d = ctx.e.op("Sub", &[&x, &y_kept], vec![]);
            ctx.e.op("Exp", &[&d], vec![])
        }
    };
    Ok(vec![Some(ctx.e.mul(&factor, &dy_kept)), None])
}

/// ReduceProd: each input's gradient is `dY` times the product of the others, written
/// without dividing by a zero (ONNX Runtime's training build has none): with `P` the
/// product of the nonzero inputs and `z` how many are zero, an input gets `P / x` where
/// `z` is 0, `P` where it is the one zero, and 0 otherwise (PyTorch's `prod` backward).
pub fn reduce_prod(ctx: &mut RuleCtx) -> Result<Grads> {
    let Some(Kept {
        x,
        t,
        axes,
        dy_kept,
        ..
    }) = kept(ctx)?
    else {
        return Ok(vec![Some(ctx.dy(0)?), None]);
    };
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let e = &mut *ctx.e;
    let (zero, one) = (e.scalar(0.0, t), e.scalar(1.0, t));
    let is_zero = e.op("Equal", &[&x, &zero], vec![]);
    let zeros = e.op("Cast", &[&is_zero], vec![int_attr("to", t.onnx() as i64)]);
    let zeros = e.reduce_sum(&zeros, &ax, true);
    let nonzero = e.op("Where", &[&is_zero, &one, &x], vec![]);
    let product = match ctx.opset >= 18 {
        true => {
            let a = e.ints(&ax);
            e.op("ReduceProd", &[&nonzero, &a], vec![int_attr("keepdims", 1)])
        }
        false => e.op(
            "ReduceProd",
            &[&nonzero],
            vec![ints_attr("axes", &ax), int_attr("keepdims", 1)],
        ),
    };
    let none = e.op("Equal", &[&zeros, &zero], vec![]);
    let only = e.op("Equal", &[&zeros, &one], vec![]);
    let others = e.op("Div", &[&product, &nonzero], vec![]);
    let for_nonzero = e.op("Where", &[&none, &others, &zero], vec![]);
    let for_zero = e.op("Where", &[&only, &product, &zero], vec![]);
    let factor = e.op("Where", &[&is_zero, &for_zero, &for_nonzero], vec![]);
    Ok(vec![Some(e.mul(&factor, &dy_kept)), None])
}
