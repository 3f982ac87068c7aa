//! BatchNormalization, in training mode (batch statistics, what `torch.onnx.export`
//! writes for a model exported with `training=TrainingMode.TRAINING`) and in inference
//! mode (the running statistics, constants of the step); InstanceNormalization
//! (statistics per sample and channel). Both scale and shift per channel (axis 1).

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
