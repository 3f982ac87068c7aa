//! Operators that read or write at indices: GatherElements, GatherND, ScatterElements,
//! ScatterND, TopK, and Trilu (a mask by position). Each gradient moves `dY` back to the
//! places it was read from: the scatter that undoes a gather (adding where an index
//! repeats, `reduction = add`, opset 16 and later), the gather that undoes a scatter.
//! The formulas are ONNX Runtime's (`gradient_builder.cc`: `GatherElementsGrad` and
//! `GatherNDGrad` are scatters with addition, `TopKGrad` a scatter of the values'
//! gradient at the indices), written in standard ops.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_s, int_attr, string_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// An error unless the opset has scatters that add (16).
fn scatter_add_opset(ctx: &RuleCtx) -> Result<()> {
    match ctx.opset >= 16 {
        true => Ok(()),
        false => Err(ctx.unsupported("needs opset 16 or later (scatters with reduction=add)")),
    }
}

/// The node's `reduction` attribute (`none` when absent), refused unless `none` or `add`.
fn reduction(ctx: &RuleCtx) -> Result<String> {
    let r = attr_s(ctx.node, "reduction").unwrap_or_else(|| "none".into());
    match r.as_str() {
        "none" | "add" => Ok(r),
        other => Err(ctx.unsupported(format!("reduction=\"{other}\" (none and add have one)"))),
    }
}

/// GatherElements: `dData = ScatterElements(0, indices, dY, axis, add)`.
pub fn gather_elements(ctx: &mut RuleCtx) -> Result<Grads> {
    scatter_add_opset(ctx)?;
    let dy = ctx.dy(0)?;
    let data = ctx.input(0).to_string();
    let z = ctx.e.zeros(&shape(ctx, &data)?, dtype(ctx, &data)?);
    let axis = attr_i(ctx.node, "axis").unwrap_or(0);
    let indices = ctx.input(1).to_string();
    let dx = ctx.e.op(
        "ScatterElements",
        &[&z, &indices, &dy],
        vec![int_attr("axis", axis), string_attr("reduction", "add")],
    );
    Ok(vec![Some(dx), None])
}

/// GatherND: `dData = ScatterND(0, indices, dY, add)`, written as `rows_add` writes it
/// (the same sums every run); with `batch_dims = b`, the leading `b` axes are flattened
/// into one and each index gets its batch position in front.
pub fn gather_nd(ctx: &mut RuleCtx) -> Result<Grads> {
    scatter_add_opset(ctx)?;
    let dy = ctx.dy(0)?;
    let (data, indices) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let (sd, si) = (shape(ctx, &data)?, shape(ctx, &indices)?);
    let t = dtype(ctx, &data)?;
    let b = attr_i(ctx.node, "batch_dims").unwrap_or(0) as usize;
    let k = *si.last().unwrap_or(&0);
    let idx = nonnegative(ctx, &indices, &sd[b..b + k])?;
    let tuples: usize = si[..si.len() - 1].iter().product();
    if b == 0 {
        let dx = super::rows_add::add_rows(ctx, &sd, k, (&idx, tuples), &dy, t)?;
        return Ok(vec![Some(dx), None]);
    }
    // Batches flattened: data [B, rest], indices [B, Q, k] with the batch's position in
    // front: [B, Q, 1 + k]; dY [B, Q, slice].
    let batches: usize = sd[..b].iter().product();
    let per_batch: usize = si[b..si.len() - 1].iter().product();
    let positions: Vec<i64> = (0..batches as i64)
        .flat_map(|p| std::iter::repeat_n(p, per_batch))
        .collect();
    let pos = ctx
        .e
        .constant(Tensor::i64(vec![batches, per_batch, 1], positions)?);
    let idx = ctx.e.reshape(&idx, &[batches, per_batch, k]);
    let idx = ctx
        .e
        .op("Concat", &[&pos, &idx], vec![int_attr("axis", -1)]);
    let mut flat_data = vec![batches];
    flat_data.extend(&sd[b..]);
    let mut flat_dy = vec![batches, per_batch];
    flat_dy.extend(&sd[b + k..]);
    let updates = ctx.e.reshape(&dy, &flat_dy);
    let scattered = super::rows_add::add_rows(ctx, &flat_data, 1 + k, (&idx, tuples), &updates, t)?;
    Ok(vec![Some(ctx.e.reshape(&scattered, &sd)), None])
}

/// `indices` (the last axis indexing `dims`) as int64 within `[0, dim)`: negative ones
/// wrapped, as gathers read them.
fn nonnegative(ctx: &mut RuleCtx, indices: &str, dims: &[usize]) -> Result<String> {
    let idx = match dtype(ctx, indices)? {
        DType::I64 => indices.to_string(),
        _ => ctx.e.op(
            "Cast",
            &[indices],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        ),
    };
    let d = ctx
        .e
        .ints(&dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
    let zero = ctx.e.constant(Tensor::i64(vec![], vec![0])?);
    let neg = ctx.e.op("Less", &[&idx, &zero], vec![]);
    let wrapped = ctx.e.op("Add", &[&idx, &d], vec![]);
    Ok(ctx.e.op("Where", &[&neg, &wrapped, &idx], vec![]))
}

/// ScatterElements: the data's gradient is `dY` where nothing was written (with `add`,
/// everywhere); the updates' is `dY` read back at their indices.
pub fn scatter_elements(ctx: &mut RuleCtx) -> Result<Grads> {
    scatter_rule(ctx, "GatherElements", "ScatterElements")
}

/// ScatterND: as ScatterElements, with whole slices.
pub fn scatter_nd(ctx: &mut RuleCtx) -> Result<Grads> {
    scatter_rule(ctx, "GatherND", "ScatterND")
}

fn scatter_rule(ctx: &mut RuleCtx, gather: &str, scatter: &str) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let adds = reduction(ctx)? == "add";
    let axis = attr_i(ctx.node, "axis");
    let attrs = || axis.map(|a| vec![int_attr("axis", a)]).unwrap_or_default();
    let (indices, updates) = (ctx.input(1).to_string(), ctx.input(2).to_string());
    let mut g = vec![None, None, None];
    if ctx.needs(0) {
        g[0] = Some(match adds {
            true => dy.clone(),
            false => {
                let z = ctx.e.zeros(&shape(ctx, &updates)?, dtype(ctx, &updates)?);
                ctx.e.op(scatter, &[&dy, &indices, &z], attrs())
            }
        });
    }
    if ctx.needs(2) {
        g[2] = Some(ctx.e.op(gather, &[&dy, &indices], attrs()));
    }
    Ok(g)
}

/// TopK: the values' gradient scattered back to where they came from (the indices of one
/// slice are distinct, so no addition is needed).
pub fn top_k(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let z = ctx.e.zeros(&shape(ctx, &x)?, dtype(ctx, &x)?);
    let axis = attr_i(ctx.node, "axis").unwrap_or(-1);
    let indices = ctx.output(1).to_string();
    let dx = ctx.e.op(
        "ScatterElements",
        &[&z, &indices, &dy],
        vec![int_attr("axis", axis)],
    );
    Ok(vec![Some(dx), None])
}

/// Trilu keeps a triangle and zeroes the rest: the same mask on `dY`.
pub fn trilu(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let upper = attr_i(ctx.node, "upper").unwrap_or(1);
    let k = ctx.input(1).to_string();
    let inputs: Vec<&str> = match k.as_str() {
        "" => vec![&dy],
        k => vec![&dy, k],
    };
    let dx = ctx.e.op("Trilu", &inputs, vec![int_attr("upper", upper)]);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(dx);
    Ok(g)
}
