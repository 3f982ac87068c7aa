//! BatchNormalization, in training mode (batch statistics, what `torch.onnx.export`
//! writes for a model exported with `training=TrainingMode.TRAINING`) and in inference
//! mode (the running statistics, constants of the step).

use super::elementwise::{dtype, shape};
use super::nn::reduce_mean;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i};
use crate::Result;

/// Gradients of X, scale and B (the running mean and variance get none: they are state,
/// not parameters). Channels are axis 1; the statistics are over every other axis.
pub fn batch_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, scale, mean_in, var_in) = (
        ctx.input(0).to_string(),
        ctx.input(1).to_string(),
        ctx.input(3).to_string(),
        ctx.input(4).to_string(),
    );
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    if sx.len() < 2 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (no channel axis)")));
    }
    if ctx.needs(3) || ctx.needs(4) {
        return Err(ctx.unsupported("a trained running mean or variance"));
    }
    let eps = attr_f(ctx.node, "epsilon").unwrap_or(1e-5) as f64;
    let training = attr_i(ctx.node, "training_mode").unwrap_or(0) != 0;
    let mut stat_shape = vec![1usize; sx.len()];
    stat_shape[1] = sx[1];
    let axes: Vec<i64> = (0..sx.len() as i64).filter(|&a| a != 1).collect();

    // The statistics the forward pass normalized with, in [1, C, 1, ...].
    let (mean, var) = if training {
        let mean = reduce_mean(ctx, &x, &axes);
        let c = ctx.e.op("Sub", &[&x, &mean], vec![]);
        let c2 = ctx.e.mul(&c, &c);
        (mean, reduce_mean(ctx, &c2, &axes))
    } else {
        (
            ctx.e.reshape(&mean_in, &stat_shape),
            ctx.e.reshape(&var_in, &stat_shape),
        )
    };
    let e = ctx.e.scalar(eps, t);
    let ve = ctx.e.op("Add", &[&var, &e], vec![]);
    let sd = ctx.e.op("Sqrt", &[&ve], vec![]);
    let inv = ctx.e.op("Reciprocal", &[&sd], vec![]);
    let centered = ctx.e.op("Sub", &[&x, &mean], vec![]);
    let xhat = ctx.e.mul(&centered, &inv);

    let mut g = vec![None; ctx.node.input.len()];
    if ctx.needs(2) {
        g[2] = Some(ctx.e.reduce_sum(&dy, &axes, false));
    }
    if ctx.needs(1) {
        let p = ctx.e.mul(&dy, &xhat);
        g[1] = Some(ctx.e.reduce_sum(&p, &axes, false));
    }
    if ctx.needs(0) {
        let sc = ctx.e.reshape(&scale, &stat_shape);
        let k = ctx.e.mul(&sc, &inv);
        g[0] = Some(if training {
            // dX = scale inv (dY - mean(dY) - xhat mean(dY xhat)): the batch statistics
            // depend on X too.
            let m1 = reduce_mean(ctx, &dy, &axes);
            let dxh = ctx.e.mul(&dy, &xhat);
            let m2 = reduce_mean(ctx, &dxh, &axes);
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
