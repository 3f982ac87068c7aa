//! Data-movement operators: Reshape and friends, Transpose, Concat, Split, Slice,
//! Gather, Expand.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, int_attr, ints_attr, string_attr, tensor_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

fn norm(axis: i64, rank: usize) -> usize {
    if axis < 0 {
        (axis + rank as i64) as usize
    } else {
        axis as usize
    }
}

/// A zero tensor of a static shape, made at run time (no large constant in the graph).
fn zeros(ctx: &mut RuleCtx, dims: &[usize], t: DType) -> String {
    let s = ctx
        .e
        .ints(&dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
    let value = Tensor::zeros(t, vec![1]).to_proto("value");
    ctx.e
        .op("ConstantOfShape", &[&s], vec![tensor_attr("value", value)])
}

/// Reshape, Flatten, Squeeze, Unsqueeze: the gradient is dY in X's shape (X's measured
/// shape as a constant, as the training graph's other shapes are: no `Shape` kernel
/// each step; X's shape at run time where it was not measured).
pub fn reshape_like_input(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(match shape(ctx, &x) {
        Ok(sx) => ctx.e.reshape(&dy, &sx),
        Err(_) => ctx.e.reshape_like(&dy, &x),
    });
    Ok(g)
}

pub fn transpose(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let rank = shape(ctx, ctx.input(0))?.len();
    let perm = attr_ints(ctx.node, "perm").unwrap_or_else(|| (0..rank as i64).rev().collect());
    let mut inverse = vec![0i64; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inverse[norm(p, rank)] = i as i64;
    }
    Ok(vec![Some(ctx.e.op(
        "Transpose",
        &[&dy],
        vec![ints_attr("perm", &inverse)],
    ))])
}

pub fn concat(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let rank = shape(ctx, ctx.output(0))?.len();
    let axis = norm(attr_i(ctx.node, "axis").unwrap_or(0), rank);
    let sizes: Vec<i64> = ctx
        .node
        .input
        .iter()
        .map(|i| shape(ctx, i).map(|s| s[axis] as i64))
        .collect::<Result<_>>()?;
    let split = ctx.e.ints(&sizes);
    let parts = ctx.e.op_n(
        "Split",
        &[&dy, &split],
        sizes.len(),
        vec![int_attr("axis", axis as i64)],
    );
    Ok(parts.into_iter().map(Some).collect())
}

pub fn split(ctx: &mut RuleCtx) -> Result<Grads> {
    let rank = shape(ctx, ctx.input(0))?.len();
    let axis = norm(attr_i(ctx.node, "axis").unwrap_or(0), rank);
    let t = dtype(ctx, ctx.input(0))?;
    let mut parts = Vec::with_capacity(ctx.node.output.len());
    for i in 0..ctx.node.output.len() {
        parts.push(match ctx.dy.get(i).cloned().flatten() {
            Some(d) => d,
            None => {
                let s = shape(ctx, ctx.output(i))?;
                zeros(ctx, &s, t)
            }
        });
    }
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    let dx = ctx
        .e
        .op("Concat", &refs, vec![int_attr("axis", axis as i64)]);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(dx);
    Ok(g)
}

pub fn slice(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let rank = sx.len();
    let starts = ctx.const_ints(1)?.unwrap_or_default();
    let ends = ctx.const_ints(2)?.unwrap_or_default();
    let axes = ctx
        .const_ints(3)?
        .unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = ctx.const_ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
    if steps.iter().any(|&s| s != 1) {
        return Err(ctx.unsupported("steps other than 1"));
    }
    // Pad dY back to X's shape with zeros before and after the slice on each axis.
    let mut pads = vec![0i64; 2 * rank];
    for (k, &ax) in axes.iter().enumerate() {
        let a = norm(ax, rank);
        let dim = sx[a] as i64;
        let clamp = |v: i64| if v < 0 { v + dim } else { v }.clamp(0, dim);
        let (s, e) = (clamp(starts[k]), clamp(ends[k]).max(clamp(starts[k])));
        pads[a] = s;
        pads[rank + a] = dim - e;
    }
    let p = ctx.e.ints(&pads);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(ctx.e.op("Pad", &[&dy, &p], vec![]));
    Ok(g)
}

pub fn gather(ctx: &mut RuleCtx) -> Result<Grads> {
    if ctx.opset < 16 {
        return Err(ctx.unsupported("needs opset 16 or later (ScatterND with reduction=add)"));
    }
    let dy = ctx.dy(0)?;
    let (data, indices) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sd = shape(ctx, &data)?;
    let si = shape(ctx, &indices)?;
    let t = dtype(ctx, &data)?;
    let axis = norm(attr_i(ctx.node, "axis").unwrap_or(0), sd.len());
    let (q, r) = (si.len(), sd.len());

    // Indices as int64 in [0, dim): Gather accepts negative ones, ScatterND's are checked.
    let idx = if dtype(ctx, &indices)? == DType::I64 {
        indices
    } else {
        ctx.e.op(
            "Cast",
            &[&indices],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        )
    };
    let dim = ctx.e.constant(Tensor::i64(vec![], vec![sd[axis] as i64])?);
    let zero = ctx.e.constant(Tensor::i64(vec![], vec![0])?);
    let neg = ctx.e.op("Less", &[&idx, &zero], vec![]);
    let wrapped = ctx.e.op("Add", &[&idx, &dim], vec![]);
    let idx = ctx.e.op("Where", &[&neg, &wrapped, &idx], vec![]);
    let dy = match ctx.frozen_rows.get(&data).filter(|_| axis == 0).cloned() {
        Some(rows) => without_rows(ctx, &dy, &idx, &rows, &si, r, t)?,
        None => dy,
    };
    let last = ctx.e.ints(&[-1]);
    let idx = ctx.e.op("Unsqueeze", &[&idx, &last], vec![]);

    // Rows are scattered along the first axis, so bring `axis` to the front.
    let moved = axis != 0;
    let (updates, target) = if moved {
        let perm: Vec<i64> = (axis..axis + q)
            .chain(0..axis)
            .chain(axis + q..q + r - 1)
            .map(|v| v as i64)
            .collect();
        let u = ctx
            .e
            .op("Transpose", &[&dy], vec![ints_attr("perm", &perm)]);
        let mut target = vec![sd[axis]];
        target.extend(&sd[..axis]);
        target.extend(&sd[axis + 1..]);
        (u, target)
    } else {
        (dy, sd.clone())
    };
    let z = zeros(ctx, &target, t);
    let scattered = ctx.e.op(
        "ScatterND",
        &[&z, &idx, &updates],
        vec![string_attr("reduction", "add")],
    );
    let dx = if moved {
        // inverse of [axis, 0..axis, axis+1..]
        let perm: Vec<i64> = (1..=axis)
            .map(|v| v as i64)
            .chain(std::iter::once(0))
            .chain((axis + 1..r).map(|v| v as i64))
            .collect();
        ctx.e
            .op("Transpose", &[&scattered], vec![ints_attr("perm", &perm)])
    } else {
        scattered
    };
    Ok(vec![Some(dx), None])
}

/// `dY` of a lookup along axis 0 with the positions that read one of `rows` zeroed
/// (`idx`: the indices, of shape `si`, as non-negative int64; the table has rank `r`).
fn without_rows(
    ctx: &mut RuleCtx,
    dy: &str,
    idx: &str,
    rows: &[i64],
    si: &[usize],
    r: usize,
    t: DType,
) -> Result<String> {
    let mut hit: Option<String> = None;
    for &row in rows {
        let k = ctx.e.constant(Tensor::i64(vec![], vec![row])?);
        let eq = ctx.e.op("Equal", &[idx, &k], vec![]);
        hit = Some(match hit {
            Some(h) => ctx.e.op("Or", &[&h, &eq], vec![]),
            None => eq,
        });
    }
    let Some(hit) = hit else {
        return Ok(dy.to_string());
    };
    let mut mask_shape = si.to_vec();
    mask_shape.extend(std::iter::repeat_n(1, r - 1));
    let mask = ctx.e.reshape(&hit, &mask_shape);
    let zero = ctx.e.scalar(0.0, t);
    Ok(ctx.e.op("Where", &[&mask, &zero, dy], vec![]))
}

pub fn expand(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let from = shape(ctx, ctx.output(0))?;
    let to = shape(ctx, ctx.input(0))?;
    let t = dtype(ctx, ctx.input(0))?;
    Ok(vec![Some(ctx.e.unbroadcast(&dy, &from, &to, t)), None])
}
