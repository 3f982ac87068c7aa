//! Tile, CumSum, DepthToSpace and SpaceToDepth: data movement whose gradient gathers
//! `dY` back (Pad: `pad.rs`).

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

/// DepthToSpace and SpaceToDepth move values without changing them: the gradient is `dY`
/// moved back, the forward's reshape, transpose and reshape undone (static shapes).
/// DepthToSpace (`mode` DCR or CRD) splits the channels as `[b, b, C']` (DCR) or
/// `[C', b, b]` (CRD) and interleaves them with the rows and columns; SpaceToDepth is DCR
/// the other way.
pub fn depth_space(ctx: &mut RuleCtx, to_space: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let sx = shape(ctx, ctx.input(0))?;
    let b = attr_i(ctx.node, "blocksize").unwrap_or(1).max(1) as usize;
    if sx.len() != 4 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (4-D only)")));
    }
    let [n, c, h, w] = [sx[0], sx[1], sx[2], sx[3]];
    let crd = attr_s(ctx.node, "mode").as_deref() == Some("CRD");
    // The forward as `reshape(view) -> transpose(perm) -> reshape(out)`; its gradient is
    // `reshape(dY, transposed view) -> transpose(inverse) -> reshape(X)`.
    let (view, perm): (Vec<usize>, Vec<i64>) = match (to_space, crd) {
        (true, false) => (vec![n, b, b, c / (b * b), h, w], vec![0, 3, 4, 1, 5, 2]),
        (true, true) => (vec![n, c / (b * b), b, b, h, w], vec![0, 1, 4, 2, 5, 3]),
        (false, _) => (vec![n, c, h / b, b, w / b, b], vec![0, 3, 5, 1, 2, 4]),
    };
    let transposed: Vec<usize> = perm.iter().map(|&p| view[p as usize]).collect();
    let mut inverse = vec![0i64; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inverse[p as usize] = i as i64;
    }
    let r = ctx.e.reshape(&dy, &transposed);
    let t = ctx.e.op(
        "Transpose",
        &[&r],
        vec![crate::graph::ir::ints_attr("perm", &inverse)],
    );
    Ok(vec![Some(ctx.e.reshape(&t, &sx))])
}
