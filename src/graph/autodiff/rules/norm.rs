//! BatchNormalization, in training mode (batch statistics, what `torch.onnx.export`
//! writes for a model exported with `training=TrainingMode.TRAINING`) and in inference
//! mode (the running statistics, constants of the step); InstanceNormalization
//! (statistics per sample and channel). Both scale and shift per channel (axis 1).
//! GroupNormalization (statistics per sample and group of channels).

use super::elementwise::{dtype, shape};
use super::nn::reduce_mean;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i};
use crate::Result;

/// Gradients of X, scale and B (the running mean and variance get none: they are state,
/// not parameters). The statistics are over every axis but the channels.
pub fn batch_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    if ctx.needs(3) || ctx.needs(4) {
        return Err(ctx.unsupported("a trained running mean or variance"));
    }
    let training = attr_i(ctx.node, "training_mode").unwrap_or(0) != 0;
    let running = (!training).then(|| (ctx.input(3).to_string(), ctx.input(4).to_string()));
    normalization(ctx, false, running)
}

/// InstanceNormalization: statistics over the spatial axes of each sample and channel.
pub fn instance_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    normalization(ctx, true, None)
}

/// `Y = scale (X - mean) / sqrt(var + eps) + B`, the statistics over the spatial axes
/// (and the batch unless `per_sample`) computed from X, or given (`running`, constants).
fn normalization(
    ctx: &mut RuleCtx,
    per_sample: bool,
    running: Option<(String, String)>,
) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, scale) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    if sx.len() < 2 || (per_sample && sx.len() < 3) {
        return Err(ctx.unsupported(format!("X of shape {sx:?}")));
    }
    let eps = attr_f(ctx.node, "epsilon").unwrap_or(1e-5) as f64;
    let mut stat_shape = vec![1usize; sx.len()];
    stat_shape[1] = sx[1];
    let first = if per_sample { 2 } else { 0 };
    let stat_axes: Vec<i64> = (first..sx.len() as i64).filter(|&a| a != 1).collect();
    let param_axes: Vec<i64> = (0..sx.len() as i64).filter(|&a| a != 1).collect();

    // The statistics the forward pass normalized with.
    let (mean, var) = match &running {
        None => {
            let mean = reduce_mean(ctx, &x, &stat_axes);
            let c = ctx.e.op("Sub", &[&x, &mean], vec![]);
            let c2 = ctx.e.mul(&c, &c);
            (mean, reduce_mean(ctx, &c2, &stat_axes))
        }
        Some((m, v)) => (ctx.e.reshape(m, &stat_shape), ctx.e.reshape(v, &stat_shape)),
    };
    let e = ctx.e.scalar(eps, t);
    let ve = ctx.e.op("Add", &[&var, &e], vec![]);
    let sd = ctx.e.op("Sqrt", &[&ve], vec![]);
    let inv = ctx.e.op("Reciprocal", &[&sd], vec![]);
    let centered = ctx.e.op("Sub", &[&x, &mean], vec![]);
    let xhat = ctx.e.mul(&centered, &inv);

    let mut g = vec![None; ctx.node.input.len()];
    if ctx.needs(2) {
        g[2] = Some(ctx.e.reduce_sum(&dy, &param_axes, false));
    }
    if ctx.needs(1) {
        let p = ctx.e.mul(&dy, &xhat);
        g[1] = Some(ctx.e.reduce_sum(&p, &param_axes, false));
    }
    if ctx.needs(0) {
        let sc = ctx.e.reshape(&scale, &stat_shape);
        let k = ctx.e.mul(&sc, &inv);
        g[0] = Some(if running.is_none() {
            // dX = scale inv (dY - mean(dY) - xhat mean(dY xhat)): the statistics
            // depend on X too.
            let m1 = reduce_mean(ctx, &dy, &stat_axes);
            let dxh = ctx.e.mul(&dy, &xhat);
            let m2 = reduce_mean(ctx, &dxh, &stat_axes);
            let xm2 = ctx.e.mul(&xhat, &m2);
            let d1 = ctx.e.op("Sub", &[&dy, &m1], vec![]);
            let d2 = ctx.e.op("Sub", &[&d1, &xm2], vec![]);
            ctx.e.mul(&d2, &k)
        } else {
            ctx.e.mul(&dy, &k)
        });
    }
    Ok(g)
}

/// GroupNormalization: the channels in `num_groups` groups, each sample's group
/// normalized over its channels and spatial positions, then scaled and shifted per
/// channel (opset 21) or per group (opset 18). With X seen as `[N, G, K]`, K the values of
/// one group: `dX = inv (dXh - mean(dXh) - Xh mean(dXh Xh))`, `dXh = dY scale`.
pub fn group_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, scale) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let groups = attr_i(ctx.node, "num_groups").unwrap_or(0).max(0) as usize;
    if sx.len() < 2 || groups == 0 || sx[1] % groups != 0 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} in {groups} groups")));
    }
    let (n, c) = (sx[0], sx[1]);
    let k: usize = sx[1..].iter().product::<usize>() / groups;
    let per_channel = shape(ctx, &scale)?.iter().product::<usize>() == c;
    let eps = attr_f(ctx.node, "epsilon").unwrap_or(1e-5) as f64;
    let xr = ctx.e.reshape(&x, &[n, groups, k]);
    let mean = reduce_mean(ctx, &xr, &[2]);
    let centered = ctx.e.op("Sub", &[&xr, &mean], vec![]);
    let sq = ctx.e.mul(&centered, &centered);
    let var = reduce_mean(ctx, &sq, &[2]);
    let e = ctx.e.scalar(eps, t);
    let ve = ctx.e.op("Add", &[&var, &e], vec![]);
    let sd = ctx.e.op("Sqrt", &[&ve], vec![]);
    let inv = ctx.e.op("Reciprocal", &[&sd], vec![]);
    let xhat_r = ctx.e.mul(&centered, &inv);
    let xhat = ctx.e.reshape(&xhat_r, &sx);

    // Per channel: [1, C, 1, ...]; the sums over the batch and spatial axes.
    let mut channel_shape = vec![1usize; sx.len()];
    channel_shape[1] = c;
    let param_axes: Vec<i64> = (0..sx.len() as i64).filter(|&a| a != 1).collect();
    let per_group = |ctx: &mut RuleCtx, g: String| -> String {
        match per_channel {
            true => g,
            false => {
                let r = ctx.e.reshape(&g, &[groups, c / groups]);
                ctx.e.reduce_sum(&r, &[1], false)
            }
        }
    };
    let mut g = vec![None; ctx.node.input.len()];
    if ctx.needs(2) {
        let s = ctx.e.reduce_sum(&dy, &param_axes, false);
        g[2] = Some(per_group(ctx, s));
    }
    if ctx.needs(1) {
        let p = ctx.e.mul(&dy, &xhat);
        let s = ctx.e.reduce_sum(&p, &param_axes, false);
        g[1] = Some(per_group(ctx, s));
    }
    if ctx.needs(0) {
        let sc = match per_channel {
            true => ctx.e.reshape(&scale, &channel_shape),
            false => {
                let col = ctx.e.reshape(&scale, &[groups, 1]);
                let dims = ctx.e.ints(&[groups as i64, (c / groups) as i64]);
                let spread = ctx.e.op("Expand", &[&col, &dims], vec![]);
                ctx.e.reshape(&spread, &channel_shape)
            }
        };
        let dxh = ctx.e.mul(&dy, &sc);
        let dxh = ctx.e.reshape(&dxh, &[n, groups, k]);
        let m1 = reduce_mean(ctx, &dxh, &[2]);
        let p = ctx.e.mul(&dxh, &xhat_r);
        let m2 = reduce_mean(ctx, &p, &[2]);
        let xm2 = ctx.e.mul(&xhat_r, &m2);
        let d1 = ctx.e.op("Sub", &[&dxh, &m1], vec![]);
        let d2 = ctx.e.op("Sub", &[&d1, &xm2], vec![]);
        let dx = ctx.e.mul(&d2, &inv);
        g[0] = Some(ctx.e.reshape(&dx, &sx));
    }
    Ok(g)
}

/// LpNormalization, `y = x / ||x||_p` along `axis` (p = 1 or 2): `dX = (dY - s * sum(dY
/// y)) / ||x||_p`, `s = y` for p = 2 and `sign(x)` for p = 1.
pub fn lp_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, y) = (ctx.input(0).to_string(), ctx.output(0).to_string());
    let rank = shape(ctx, &x)?.len() as i64;
    let axis = attr_i(ctx.node, "axis").unwrap_or(-1);
    let axis = if axis < 0 { axis + rank } else { axis };
    let p = attr_i(ctx.node, "p").unwrap_or(2);
    let (reduce, s) = match p {
        1 => ("ReduceL1", ctx.e.op("Sign", &[&x], vec![])),
        2 => ("ReduceL2", y.clone()),
        other => return Err(ctx.unsupported(format!("p = {other}"))),
    };
    let norm = reduce_axes(ctx, reduce, &x, axis);
    let dyy = ctx.e.mul(&dy, &y);
    let dot = ctx.e.reduce_sum(&dyy, &[axis], true);
    let along = ctx.e.mul(&s, &dot);
    let d = ctx.e.op("Sub", &[&dy, &along], vec![]);
    Ok(vec![Some(ctx.e.op("Div", &[&d, &norm], vec![]))])
}

/// `op(x)` over `axis` with kept dims: the axes an attribute before opset 18, an input
/// from then on.
fn reduce_axes(ctx: &mut RuleCtx, op: &str, x: &str, axis: i64) -> String {
    let keep = crate::graph::ir::int_attr("keepdims", 1);
    match ctx.opset >= 18 {
        true => {
            let a = ctx.e.ints(&[axis]);
            ctx.e.op(op, &[x, &a], vec![keep])
        }
        false => ctx.e.op(
            op,
            &[x],
            vec![crate::graph::ir::ints_attr("axes", &[axis]), keep],
        ),
    }
}

/// MeanVarianceNormalization, `y = (x - mean) / sqrt(var)` over `axes` (default N, H, W):
/// `dX = (dY - mean(dY) - y mean(dY y)) / sqrt(var)`.
pub fn mean_variance_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, y) = (ctx.input(0).to_string(), ctx.output(0).to_string());
    let rank = shape(ctx, &x)?.len() as i64;
    let axes: Vec<i64> = crate::graph::ir::attr_ints(ctx.node, "axes")
        .unwrap_or_else(|| vec![0, 2, 3])
        .iter()
        .map(|&a| if a < 0 { a + rank } else { a })
        .collect();
    let mean = reduce_mean(ctx, &x, &axes);
    let c = ctx.e.op("Sub", &[&x, &mean], vec![]);
    let c2 = ctx.e.mul(&c, &c);
    let var = reduce_mean(ctx, &c2, &axes);
    let sd = ctx.e.op("Sqrt", &[&var], vec![]);
    let m1 = reduce_mean(ctx, &dy, &axes);
    let dyy = ctx.e.mul(&dy, &y);
    let m2 = reduce_mean(ctx, &dyy, &axes);
    let ym2 = ctx.e.mul(&y, &m2);
    let d1 = ctx.e.op("Sub", &[&dy, &m1], vec![]);
    let d2 = ctx.e.op("Sub", &[&d1, &ym2], vec![]);
    Ok(vec![Some(ctx.e.op("Div", &[&d2, &sd], vec![]))])
}
