//! Data-movement operators: Reshape and friends, Transpose, Concat, Split, Slice,
//! Gather, Expand.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, int_attr, ints_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

fn norm(axis: i64, rank: usize) -> usize {
    if axis < 0 {
        (axis + rank as i64) as usize
    } else {
        axis as usize
    }
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
                ctx.e.zeros(&s, t)
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

/// Slice: `dY` put back where the slice read, zeros elsewhere, axis by axis. A step of
/// `s` spreads the `n` read positions `p, p + s, ...` out: `dY` with `s - 1` zeros after
/// each element (a new axis padded, then merged), padded to the axis's length. A negative
/// step reads backwards: `dY` reversed is the same spread from the lowest position read.
pub fn slice(ctx: &mut RuleCtx) -> Result<Grads> {
    let mut g = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let rank = sx.len();
    let starts = ctx.const_ints(1)?.unwrap_or_default();
    let ends = ctx.const_ints(2)?.unwrap_or_default();
    let axes = ctx
        .const_ints(3)?
        .unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = ctx.const_ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
    let mut now = shape(ctx, ctx.output(0))?;
    let mut pads = vec![0i64; 2 * rank];
    for (k, &ax) in axes.iter().enumerate() {
        let a = norm(ax, rank);
        let Some(read) = SliceAxis::new(starts[k], ends[k], steps[k], sx[a] as i64) else {
            return Err(ctx.unsupported("step 0"));
        };
        if read.count == 0 {
            // The slice read nothing: nothing flows back.
            let t = dtype(ctx, ctx.input(0))?;
            let mut grads = vec![None; ctx.node.input.len()];
            grads[0] = Some(ctx.e.zeros(&sx, t));
            return Ok(grads);
        }
        if read.step < 0 {
            g = reversed(ctx, &g, a);
        }
        let stride = read.step.unsigned_abs() as usize;
        if stride > 1 {
            g = spread(ctx, &g, &mut now, a, stride);
        }
        // `now[a]` is count * stride, the last stride - 1 of them zeros.
        let spread_len = (read.count - 1) * stride as i64 + 1;
        if now[a] as i64 > spread_len {
            g = crop(ctx, &g, a, spread_len);
            now[a] = spread_len as usize;
        }
        pads[a] = read.lowest;
        pads[rank + a] = sx[a] as i64 - read.lowest - spread_len;
    }
    let mut grads = vec![None; ctx.node.input.len()];
    grads[0] = Some(match pads.iter().all(|&p| p == 0) {
        true => g,
        false => ctx.e.pad(&g, &pads, &sx),
    });
    Ok(grads)
}

/// The positions one axis of a Slice reads, as ONNX defines them (starts and ends
/// counted from the end when negative, then clamped).
struct SliceAxis {
    /// The lowest position read.
    lowest: i64,
    /// How many.
    count: i64,
    step: i64,
}

impl SliceAxis {
    fn new(start: i64, end: i64, step: i64, dim: i64) -> Option<SliceAxis> {
        if step == 0 {
            return None;
        }
        let from_end = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
        let (start, end) = (from_end(start), from_end(end));
        let (start, count) = if step > 0 {
            let (s, e) = (start.clamp(0, dim), end.clamp(0, dim));
            (s, ((e - s).max(0) + step - 1) / step)
        } else {
            let (s, e) = (start.clamp(0, dim - 1), end.clamp(-1, dim - 1));
            (s, ((s - e).max(0) + (-step) - 1) / (-step))
        };
        let lowest = match step > 0 {
            true => start,
            false => start + (count - 1).max(0) * step,
        };
        Some(SliceAxis {
            lowest,
            count,
            step,
        })
    }
}

/// `g` reversed along axis `a`.
fn reversed(ctx: &mut RuleCtx, g: &str, a: usize) -> String {
    let (s, e) = (ctx.e.ints(&[-1]), ctx.e.ints(&[i64::MIN]));
    let (ax, st) = (ctx.e.ints(&[a as i64]), ctx.e.ints(&[-1]));
    ctx.e.op("Slice", &[g, &s, &e, &ax, &st], vec![])
}

/// `g` (shape `now`) with `stride - 1` zeros after each element along axis `a`; `now[a]`
/// grows to `now[a] * stride`.
fn spread(ctx: &mut RuleCtx, g: &str, now: &mut [usize], a: usize, stride: usize) -> String {
    let mut with_axis = now[..=a].to_vec();
    with_axis.push(1);
    with_axis.extend(&now[a + 1..]);
    let u = ctx.e.reshape(g, &with_axis);
    let mut pads = vec![0i64; 2 * with_axis.len()];
    pads[with_axis.len() + a + 1] = stride as i64 - 1;
    let p = ctx.e.ints(&pads);
    let padded = ctx.e.op("Pad", &[&u, &p], vec![]);
    now[a] *= stride;
    ctx.e.reshape(&padded, now)
}

/// The first `len` positions of `g` along axis `a`.
fn crop(ctx: &mut RuleCtx, g: &str, a: usize, len: i64) -> String {
    let (s, e, ax) = (
        ctx.e.ints(&[0]),
        ctx.e.ints(&[len]),
        ctx.e.ints(&[a as i64]),
    );
    ctx.e.op("Slice", &[g, &s, &e, &ax], vec![])
}

pub fn gather(ctx: &mut RuleCtx) -> Result<Grads> {
    if ctx.opset < 16 {
        return Err(ctx.unsupported("needs opset 16 or later (ScatterElements with reduction=add)"));
    }
    let dy = ctx.dy(0)?;
    let (data, indices) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sd = shape(ctx, &data)?;
    let si = shape(ctx, &indices)?;
    let t = dtype(ctx, &data)?;
    let axis = norm(attr_i(ctx.node, "axis").unwrap_or(0), sd.len());
    let (q, r) = (si.len(), sd.len());

    // Indices as int64 in [0, dim): Gather accepts negative ones, scatters' are checked.
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
    let n: usize = si.iter().product();
    let scattered = super::rows_add::add_rows(ctx, &target, 1, (&idx, n), &updates, t)?;
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
