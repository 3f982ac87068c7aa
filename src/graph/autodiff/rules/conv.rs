//! Convolutions: Conv's gradient as the orttraining builder computes it, in standard ops
//! where it calls ConvGrad (ConvTranspose for dX, a batch/channel-swapped Conv for dW),
//! and ConvTranspose's as the adjoint of Conv.

use super::elementwise::shape;
use super::pool::{geometry, ints_of, pads_of, transpose_walk, Axis};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, attr_s, int_attr, ints_attr};
use crate::Result;

/// The transposition swapping axes 0 and 1 of a rank-`rank` value.
fn swap01(rank: usize) -> Vec<i64> {
    let mut perm: Vec<i64> = (0..rank as i64).collect();
    perm.swap(0, 1);
    perm
}

pub fn conv(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, w) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sx = shape(ctx, &x)?;
    let sw = shape(ctx, &w)?;
    let sy = shape(ctx, ctx.output(0))?;
    if sw.len() < 3 || sx.len() != sw.len() {
        return Err(ctx.unsupported(format!("X of shape {sx:?} with W of shape {sw:?}")));
    }
    let kernel = sw[2..].to_vec();
    if let Some(ks) = attr_ints(ctx.node, "kernel_shape") {
        if ks.iter().map(|&k| k as usize).ne(kernel.iter().copied()) {
            return Err(ctx.unsupported(format!("kernel_shape={ks:?} unlike W's {kernel:?}")));
        }
    }
    let axes = geometry(ctx, &sx, &kernel, &sy)?;
    let group = attr_i(ctx.node, "group").unwrap_or(1);
    let (c, m) = (sx[1], sw[0]);
    let gu = usize::try_from(group).unwrap_or(0);
    if gu == 0 || c % gu != 0 || m % gu != 0 || sw[1] * gu != c {
        return Err(ctx.unsupported(format!(
            "group={group} with {c} input and {m} output channels"
        )));
    }
    let rank = sx.len();
    let spatial_axes: Vec<i64> = (2..rank as i64).collect();
    let mut g = vec![None; ctx.node.input.len()];

    if ctx.needs(0) {
        // ConvTranspose with Conv's own W (its [M, C/group, k...] layout is ConvTranspose's
        // [in, out/group, k...]) is Conv's adjoint.
        g[0] = Some(transpose_walk(ctx, &dy, &w, &axes, group));
    }
    if ctx.needs(1) {
        g[1] = Some(conv_weight_grad(ctx, (&x, &sx), &dy, &axes, group));
    }
    if ctx.needs(2) && !ctx.input(2).is_empty() {
        let mut sum_axes = vec![0];
        sum_axes.extend(&spatial_axes);
        g[2] = Some(ctx.e.reduce_sum(&dy, &sum_axes, false));
    }
    Ok(g)
}

/// The gradient of a Conv's weight from its input `x` (of shape `sx`) and its output's
/// gradient `dy`, for the window walk `axes`:
/// dW[m, c, k] = sum_{n, o} dY[n, m, o] X_pad[n, c, o*stride + k*dilation]: a Conv of
/// X (batch and channels swapped) by dY (likewise), stride and dilation swapped. For
/// group > 1, X's channels become C/group images of group*N channels each, so that group
/// j of that Conv sees only X's group j.
fn conv_weight_grad(
    ctx: &mut RuleCtx,
    (x, sx): (&str, &[usize]),
    dy: &str,
    axes: &[Axis],
    group: i64,
) -> String {
    let rank = sx.len();
    let (n, c) = (sx[0], sx[1]);
    let gu = group as usize;
    let cg = c / gu;
    let xt = if gu == 1 {
        ctx.e
            .op("Transpose", &[x], vec![ints_attr("perm", &swap01(rank))])
    } else {
        let mut split = vec![n, gu, cg];
        split.extend(&sx[2..]);
        let xr = ctx.e.reshape(x, &split);
        let mut perm = vec![2, 1, 0];
        perm.extend(3..rank as i64 + 1);
        let xp = ctx
            .e
            .op("Transpose", &[&xr], vec![ints_attr("perm", &perm)]);
        let mut merged = vec![cg, gu * n];
        merged.extend(&sx[2..]);
        ctx.e.reshape(&xp, &merged)
    };
    let dyt = ctx
        .e
        .op("Transpose", &[dy], vec![ints_attr("perm", &swap01(rank))]);
    let corr = ctx.e.op(
        "Conv",
        &[&xt, &dyt],
        vec![
            ints_attr("strides", &ints_of(axes, |a| a.dilation)),
            ints_attr("dilations", &ints_of(axes, |a| a.stride)),
            ints_attr("pads", &pads_of(axes)),
            int_attr("group", group),
        ],
    );
    let dw = ctx.e.op(
        "Transpose",
        &[&corr],
        vec![ints_attr("perm", &swap01(rank))],
    );
    // Pad elements past the last window's reach add kernel taps that W lacks.
    let reach = |a: &Axis| (a.padded() - a.stride * (a.output - 1) - 1) / a.dilation + 1;
    if axes.iter().all(|a| reach(a) == a.kernel) {
        return dw;
    }
    let spatial_axes: Vec<i64> = (2..rank as i64).collect();
    let starts = ctx.e.ints(&vec![0; axes.len()]);
    let ends = ctx.e.ints(&ints_of(axes, |a| a.kernel));
    let which = ctx.e.ints(&spatial_axes);
    ctx.e.op("Slice", &[&dw, &starts, &ends, &which], vec![])
}

/// ConvTranspose is the adjoint of the Conv with its W, strides, pads, dilations and
/// group (a Conv from Y's shape to X's): dX is that Conv of dY, and dW that Conv's weight
/// gradient with dY as its input and X as its output's gradient.
pub fn conv_transpose(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, w) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let (sx, sw) = (shape(ctx, &x)?, shape(ctx, &w)?);
    let sy = shape(ctx, ctx.output(0))?;
    if attr_ints(ctx.node, "output_shape").is_some() {
        return Err(ctx.unsupported("output_shape (give pads and output_padding instead)"));
    }
    if attr_s(ctx.node, "auto_pad").is_some_and(|p| p != "NOTSET") {
        return Err(ctx.unsupported("auto_pad (give pads instead)"));
    }
    if sw.len() < 3 || sx.len() != sw.len() {
        return Err(ctx.unsupported(format!("X of shape {sx:?} with W of shape {sw:?}")));
    }
    let group = attr_i(ctx.node, "group").unwrap_or(1);
    let gu = usize::try_from(group).unwrap_or(0);
    let cout = sy[1];
    if gu == 0 || sx[1] != sw[0] || cout % gu != 0 || sw[1] * gu != cout {
        return Err(ctx.unsupported(format!(
            "group={group} with {} input and {cout} output channels",
            sx[1]
        )));
    }
    // The Conv this node is the adjoint of reads Y's shape and writes X's.
    let axes = geometry(ctx, &sy, &sw[2..], &sx)?;
    let mut g = vec![None; ctx.node.input.len()];
    if ctx.needs(0) {
        g[0] = Some(ctx.e.op(
            "Conv",
            &[&dy, &w],
            vec![
                ints_attr("strides", &ints_of(&axes, |a| a.stride)),
                ints_attr("dilations", &ints_of(&axes, |a| a.dilation)),
                ints_attr("pads", &pads_of(&axes)),
                int_attr("group", group),
            ],
        ));
    }
    if ctx.needs(1) {
        g[1] = Some(conv_weight_grad(ctx, (&dy, &sy), &x, &axes, group));
    }
    if ctx.needs(2) && !ctx.input(2).is_empty() {
        let mut sum_axes = vec![0];
        sum_axes.extend(2..sy.len() as i64);
        g[2] = Some(ctx.e.reduce_sum(&dy, &sum_axes, false));
    }
    Ok(g)
}
