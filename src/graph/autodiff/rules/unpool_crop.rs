//! MaxUnpool, Compress, CenterCropPad and Col2Im: each moves its input's values to other
//! places (or drops or adds some), so each gradient reads `dY` back from those places. ONNX Runtime's
//! training build has no gradient for them.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, int_attr};
use crate::tensor::{Tensor, TensorData};
use crate::Result;

/// MaxUnpool writes `X` at `I`, indices into the whole output flattened (as MaxPool's
/// `Indices`): `dX = dY.flat[I]`. Where indices repeat (a MaxPool of overlapping windows
/// picking one input twice) one value reaches the output and both get its gradient,
/// as in PyTorch's `max_unpool2d` backward.
pub fn max_unpool(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let indices = ctx.input(1).to_string();
    let flat = ctx
        .e
        .reshape(&dy, &[shape(ctx, ctx.output(0))?.iter().product()]);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(ctx.e.op("Gather", &[&flat, &indices], vec![]));
    Ok(g)
}

/// Compress with a constant condition: `Gather(X, positions, axis)` (no axis: of `X`
/// flattened), whose gradient scatters `dY` back to those positions (each once).
pub fn compress(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let Some(cond) = ctx.consts.get(ctx.input(1)) else {
        return Err(ctx.unsupported("a condition computed from the data (not a constant)"));
    };
    let keep: Vec<bool> = match &cond.data {
        TensorData::Bool(v) => v.clone(),
        _ => cond.to_f64_vec().iter().map(|&v| v != 0.0).collect(),
    };
    let axis = attr_i(ctx.node, "axis").map(|a| if a < 0 { a + sx.len() as i64 } else { a });
    let (along, span) = match axis {
        Some(a) => (a as usize, sx[a as usize]),
        None => (0, sx.iter().product()),
    };
    let positions: Vec<i64> = (0..span.min(keep.len()))
        .filter(|&p| keep[p])
        .map(|p| p as i64)
        .collect();
    // The positions along `along`, broadcast to dY's shape.
    let target = match axis {
        Some(_) => sx.clone(),
        None => vec![span],
    };
    let mut out = target.clone();
    out[along] = positions.len();
    let mut dims = vec![1; out.len()];
    dims[along] = positions.len();
    let idx = ctx.e.constant(Tensor::i64(dims, positions)?);
    let to = ctx
        .e
        .ints(&out.iter().map(|&d| d as i64).collect::<Vec<_>>());
    let idx = ctx.e.op("Expand", &[&idx, &to], vec![]);
    let dy = ctx.e.reshape(&dy, &out);
    let zeros = ctx.e.zeros(&target, t);
    let dx = ctx.e.op(
        "ScatterElements",
        &[&zeros, &idx, &dy],
        vec![int_attr("axis", along as i64)],
    );
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(ctx.e.reshape(&dx, &sx));
    Ok(g)
}

/// CenterCropPad crops (or pads with zeros) each axis to its target about the centre,
/// the odd element at the end: `dX` is `dY` padded where X was cropped and cropped
/// where it was padded, one `Pad` with negative pads for the crops.
pub fn center_crop_pad(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let sy = shape(ctx, ctx.output(0))?;
    if sx.len() != sy.len() {
        return Err(ctx.unsupported(format!("X {sx:?} and Y {sy:?} of different ranks")));
    }
    let rank = sx.len();
    let mut pads = vec![0i64; 2 * rank];
    for a in 0..rank {
        let (from, to) = (sx[a] as i64, sy[a] as i64);
        // Cropped: Y starts (from - to) / 2 into X. Padded: X starts (to - from) / 2
        // into Y. Either way dX is dY shifted by that, cut or filled to X's size.
        let begin = (from - to) / 2;
        pads[a] = begin;
        pads[rank + a] = from - to - begin;
    }
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(match pads.iter().all(|&p| p == 0) {
        true => dy,
        false => {
            let p = ctx.e.ints(&pads);
            ctx.e.op("Pad", &[&dy, &p], vec![])
        }
    });
    Ok(g)
}

/// Col2Im (`F.fold`) adds each column of `X` into its block of the image; its gradient
/// reads every block back out (`F.unfold`): a grouped `Conv` of `dY` whose filters pick
/// one position of the block each, with Col2Im's strides, dilations and pads. Output
/// channel `c K + k` is channel `c` at block position `k`, as Col2Im's input orders them.
pub fn col2im(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let sy = shape(ctx, ctx.output(0))?;
    let t = dtype(ctx, ctx.input(0))?;
    let Some(block) = ctx.const_ints(2)? else {
        return Err(ctx.unsupported("no block_shape"));
    };
    if sy.len() != block.len() + 2 || sx.len() != 3 {
        return Err(ctx.unsupported(format!("X {sx:?}, image {sy:?}, block {block:?}")));
    }
    let (n, c) = (sy[0], sy[1]);
    let k: usize = block.iter().map(|&b| b as usize).product();
    let mut ones = vec![0.0; c * k * k];
    for ch in 0..c {
        for pos in 0..k {
            ones[(ch * k + pos) * k + pos] = 1.0;
        }
    }
    let mut wdims = vec![c * k, 1];
    wdims.extend(block.iter().map(|&b| b as usize));
    let data = match t {
        crate::tensor::DType::F64 => TensorData::F64(ones),
        _ => TensorData::F32(ones.into_iter().map(|v| v as f32).collect()),
    };
    let w = ctx.e.constant(Tensor::new(wdims, data)?);
    let mut attrs = vec![int_attr("group", c as i64)];
    for name in ["dilations", "pads", "strides"] {
        if let Some(a) = ctx.node.attribute.iter().find(|a| a.name == name) {
            attrs.push(a.clone());
        }
    }
    let cols = ctx.e.op("Conv", &[&dy, &w], attrs);
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(ctx.e.reshape(&cols, &[n, c * k, sx[2]]));
    Ok(g)
}
