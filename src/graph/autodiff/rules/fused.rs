//! Gradient rules that emit one of pipetrain's fused kernels (see
//! [`crate::graph::custom_ops`]) in place of the standard-op form, where the node fits
//! the kernel; otherwise the caller emits the standard ops.

use super::elementwise::shape;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::custom_ops::{
    ATTENTION, ATTENTION_GRAD, DEPTHWISE_CONV, DEPTHWISE_CONV_GRAD, DOMAIN, ERF_GELU, GELU_GRAD,
    LAYER_NORM_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD, RELU_GRAD, SOFTMAX,
    SOFTMAX_CROSS_ENTROPY, SOFTMAX_CROSS_ENTROPY_GRAD, SOFTMAX_GRAD, TANH_GELU, TANH_GELU_GRAD,
};
use crate::graph::ir::attr_i;
use crate::tensor::DType;
use crate::Result;

/// The gradient rule of one of pipetrain's fused forward kernels (`graph::fusion`): its
/// fused backward.
pub fn rule(op_type: &str) -> Option<super::Rule> {
    let rule: super::Rule = match op_type {
        // From `x` and the kept `erf(t)`; `t` is made again from `x` as the forward made it.
        ERF_GELU => |c| {
            let (dy, x, e) = (c.dy(0)?, c.input(0).to_string(), c.output(1).to_string());
            let attrs = c.node.attribute.clone();
            Ok(vec![Some(c.e.custom_op(GELU_GRAD, &[&dy, &x, &e], attrs))])
        },
        // One kernel for all three gradients; those not needed are left unread.
        DEPTHWISE_CONV => |c| {
            let dy = c.dy(0)?;
            let (x, w) = (c.input(0).to_string(), c.input(1).to_string());
            let outputs = [c.e.fresh("dX"), c.e.fresh("dW"), c.e.fresh("dB")];
            let out: Vec<&str> = outputs.iter().map(String::as_str).collect();
            let attrs = c.node.attribute.clone();
            c.e.node(DEPTHWISE_CONV_GRAD, DOMAIN, &[&dy, &x, &w], &out, attrs);
            let [dx, dw, db] = outputs;
            let bias = c.node.input.len() > 2 && !c.input(2).is_empty();
            let mut grads = vec![
                c.needs(0).then_some(dx),
                c.needs(1).then_some(dw),
                (bias && c.needs(2)).then_some(db),
            ];
            grads.truncate(c.node.input.len());
            Ok(grads)
        },
        // One kernel for the inputs' gradients from the kept probabilities; the mask
        // gets none (the fusion pass leaves masks computed from parameters alone).
        ATTENTION => |c| attention(c, false),
        PACKED_ATTENTION => |c| attention(c, true),
        TANH_GELU => |c| {
            let (dy, x) = (c.dy(0)?, c.input(0).to_string());
            let attrs = c.node.attribute.clone();
            Ok(vec![Some(c.e.custom_op(TANH_GELU_GRAD, &[&dy, &x], attrs))])
        },
        SOFTMAX => |c| {
            let (dy, y) = (c.dy(0)?, c.output(0).to_string());
            Ok(vec![Some(c.e.custom_op(SOFTMAX_GRAD, &[&dy, &y], vec![]))])
        },
        SOFTMAX_CROSS_ENTROPY => |c| {
            let dloss = c.dy(0)?;
            let (log_prob, labels) = (c.output(1).to_string(), c.input(1).to_string());
            let attrs = c.node.attribute.clone();
            let inputs = [dloss.as_str(), &log_prob, &labels];
            let dx = c.e.custom_op(SOFTMAX_CROSS_ENTROPY_GRAD, &inputs, attrs);
            Ok(vec![Some(dx), None])
        },
        _ => return None,
    };
    Some(rule)
}

/// `Attention`'s (or `PackedAttention`'s) backward: the gradients of `Q, K, V` (of the
/// packed tensor), none for the mask.
fn attention(c: &mut RuleCtx, packed: bool) -> Result<Grads> {
    let parts = if packed { 1 } else { 3 };
    if c.node.input.len() > parts && c.needs(parts) {
        return Err(crate::Error::graph(format!(
            "{}: the attention mask {} needs a gradient, which the fused kernel does not \
             give (train with runtime.fused_kernels = false)",
            c.node.name,
            c.input(parts)
        )));
    }
    let mut inputs = vec![c.dy(0)?];
    inputs.extend((0..parts).map(|i| c.input(i).to_string()));
    inputs.push(c.output(1).to_string());
    // Keeping the rows' log-sum-exps instead of P: the backward also reads O and the mask.
    if attr_i(c.node, "lse") == Some(1) {
        inputs.push(c.output(0).to_string());
        if c.node.input.len() > parts {
            inputs.push(c.input(parts).to_string());
        }
    }
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let outputs: Vec<String> = ["dQ", "dK", "dV"][..parts]
        .iter()
        .map(|n| c.e.fresh(n))
        .collect();
    let out: Vec<&str> = outputs.iter().map(String::as_str).collect();
    let op = if packed {
        PACKED_ATTENTION_GRAD
    } else {
        ATTENTION_GRAD
    };
    let attrs = c.node.attribute.clone();
    c.e.node(op, DOMAIN, &inputs, &out, attrs);
    let mut grads: Vec<Option<String>> = outputs
        .into_iter()
        .enumerate()
        .map(|(i, g)| c.needs(i).then_some(g))
        .collect();
    grads.resize(c.node.input.len(), None);
    Ok(grads)
}

/// Whether `name` is a float32 value.
fn is_f32(ctx: &RuleCtx, name: &str) -> bool {
    !name.is_empty() && ctx.metas.get(name).is_some_and(|m| m.dtype == DType::F32)
}

/// ReLU's backward as `ReluGrad`, when fused kernels are on and the input is float32.
/// `None`: emit the standard ops.
pub fn relu(ctx: &mut RuleCtx) -> Result<Option<String>> {
    let x = ctx.input(0).to_string();
    if !ctx.e.fused || !is_f32(ctx, &x) {
        return Ok(None);
    }
    let dy = ctx.dy(0)?;
    Ok(Some(ctx.e.custom_op(RELU_GRAD, &[&dy, &x], vec![])))
}

/// Softmax's backward as `SoftmaxGrad`, when fused kernels are on, the output is
/// float32 and the softmax runs over the last axis. `None`: emit the standard ops.
pub fn softmax(ctx: &mut RuleCtx, axis: usize) -> Result<Option<String>> {
    let y = ctx.output(0).to_string();
    let kernel = ctx.e.fused || ctx.e.cuda;
    if !kernel || !is_f32(ctx, &y) || axis + 1 != shape(ctx, &y)?.len() {
        return Ok(None);
    }
    let dy = ctx.dy(0)?;
    Ok(Some(ctx.e.custom_op(SOFTMAX_GRAD, &[&dy, &y], vec![])))
}

/// LayerNormalization's backward as `LayerNormGrad`, when fused kernels are on (on a
/// GPU, with `runtime.cuda_kernels_untried`) and the node fits the kernel: float32, the forward's statistics saved (its `Mean` and
/// `InvStdDev` outputs), and `scale` (and `B`) spanning exactly the normalized axes
/// from `axis` on. `None`: emit the standard ops.
pub fn layer_norm(ctx: &mut RuleCtx, axis: usize) -> Result<Option<Grads>> {
    if !(ctx.e.fused || ctx.e.cuda_untried) {
        return Ok(None);
    }
    let (x, scale, mean, inv) = (ctx.input(0), ctx.input(1), ctx.output(1), ctx.output(2));
    if ![x, scale, mean, inv].iter().all(|v| is_f32(ctx, v)) {
        return Ok(None);
    }
    let sx = shape(ctx, x)?;
    let normalized = &sx[axis.min(sx.len())..];
    let spans = |ctx: &RuleCtx, v: &str| shape(ctx, v).is_ok_and(|s| s == normalized);
    if !spans(ctx, scale) || (ctx.needs(2) && !spans(ctx, ctx.input(2))) {
        return Ok(None);
    }
    let dy = ctx.dy(0)?;
    let (x, scale, mean, inv) = (
        x.to_string(),
        scale.to_string(),
        mean.to_string(),
        inv.to_string(),
    );
    let dx = ctx.e.fresh("dX");
    let ds = ctx.e.fresh("dscale");
    let db = ctx.e.fresh("dbias");
    ctx.e.node(
        LAYER_NORM_GRAD,
        DOMAIN,
        &[&dy, &x, &scale, &mean, &inv],
        &[&dx, &ds, &db],
        vec![],
    );
    Ok(Some(vec![
        ctx.needs(0).then_some(dx),
        ctx.needs(1).then_some(ds),
        ctx.needs(2).then_some(db),
    ]))
}
