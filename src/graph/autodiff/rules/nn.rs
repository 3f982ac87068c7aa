//! Softmax, LogSoftmax, SoftmaxCrossEntropyLoss and LayerNormalization.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i, attr_s, int_attr, ints_attr, string_attr};
use crate::tensor::DType;
use crate::Result;

/// An axis attribute made non-negative.
fn norm_axis(axis: i64, rank: usize) -> usize {
    if axis < 0 {
        (axis + rank as i64) as usize
    } else {
        axis as usize
    }
}

pub fn softmax(ctx: &mut RuleCtx, log: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let y = ctx.output(0).to_string();
    let rank = shape(ctx, &y)?.len();
    let axis = norm_axis(attr_i(ctx.node, "axis").unwrap_or(-1), rank) as i64;
    let fused = match log {
        true => None,
        false => super::fused::softmax(ctx, axis as usize)?,
    };
    if let Some(dx) = fused {
        return Ok(vec![Some(dx)]);
    }
    let dx = if log {
        // dX = dY - softmax(X) * sum(dY)
        let s = ctx.e.reduce_sum(&dy, &[axis], true);
        let p = ctx.e.op("Exp", &[&y], vec![]);
        let ps = ctx.e.mul(&p, &s);
        ctx.e.op("Sub", &[&dy, &ps], vec![])
    } else {
        // dX = Y * (dY - sum(dY * Y))
        let dyy = ctx.e.mul(&dy, &y);
        let s = ctx.e.reduce_sum(&dyy, &[axis], true);
        let diff = ctx.e.op("Sub", &[&dy, &s], vec![]);
        ctx.e.mul(&y, &diff)
    };
    Ok(vec![Some(dx)])
}

pub fn softmax_cross_entropy(ctx: &mut RuleCtx) -> Result<Grads> {
    let dloss = ctx.dy(0)?;
    if ctx.needs(2) {
        return Err(ctx.unsupported("a gradient for the class weights (input 2)"));
    }
    let class_weights = Some(ctx.input(2).to_string()).filter(|w| !w.is_empty());
    let log_prob = ctx.output(1).to_string();
    if log_prob.is_empty() {
        return Err(
            ctx.unsupported("the log_prob output is needed (the training-graph builder adds it)")
        );
    }
    let (scores, labels) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let ss = shape(ctx, &scores)?;
    let t = dtype(ctx, &scores)?;
    let reduction = attr_s(ctx.node, "reduction").unwrap_or_else(|| "mean".into());
    let ignore = attr_i(ctx.node, "ignore_index");

    let labels64 = if dtype(ctx, &labels)? == DType::I64 {
        labels.clone()
    } else {
        ctx.e.op(
            "Cast",
            &[&labels],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        )
    };
    let one = ctx.e.ints(&[1]);
    let lab = ctx.e.op("Unsqueeze", &[&labels64, &one], vec![]);
    let prob = ctx.e.op("Exp", &[&log_prob], vec![]);

    // Ignored positions get no gradient and do not count in the mean.
    let ignored = ignore.map(|ii| {
        let iiv = ctx.e.constant(crate::tensor::Tensor {
            shape: vec![],
            data: crate::tensor::TensorData::I64(vec![ii]),
        });
        ctx.e.op("Equal", &[&lab, &iiv], vec![])
    });
    let mask = ignored.as_ref().map(|eq| {
        let keep = ctx.e.op("Not", &[eq], vec![]);
        ctx.e
            .op("Cast", &[&keep], vec![int_attr("to", t.onnx() as i64)])
    });
    // With class weights, each position counts its label's weight (the mean divides by
    // their sum), as ONNX defines the loss.
    let mask = match class_weights {
        None => mask,
        Some(w) => {
            let safe = match &ignored {
                Some(eq) => {
                    let zero = ctx.e.ints(&[0]);
                    ctx.e.op("Where", &[eq, &zero, &lab], vec![])
                }
                None => lab.clone(),
            };
            let per_position = ctx.e.op("Gather", &[&w, &safe], vec![]);
            Some(match mask {
                Some(m) => ctx.e.mul(&m, &per_position),
                None => per_position,
            })
        }
    };
    let scale = match reduction.as_str() {
        "mean" => {
            let count = match &mask {
                Some(m) => ctx.e.op("ReduceSum", &[m], vec![int_attr("keepdims", 0)]),
                None => {
                    let n: usize = ss.iter().product::<usize>() / ss[1];
                    ctx.e.scalar(n as f64, t)
                }
            };
            ctx.e.op("Div", &[&dloss, &count], vec![])
        }
        "sum" => dloss,
        "none" => ctx.e.op("Unsqueeze", &[&dloss, &one], vec![]),
        other => return Err(ctx.unsupported(format!("reduction=\"{other}\""))),
    };
    // Each position's weight: the scale, zero where ignored.
    let weight = match &mask {
        Some(m) => ctx.e.mul(m, &scale),
        None => scale,
    };
    if ctx.opset >= 16 {
        // d = weight * (softmax - one_hot(label)): the softmax part in one pass, then
        // `-weight` added at each position's label (`ScatterElements` with
        // `reduction = "add"`, opset 16), where a one-hot would take three passes over
        // every class (compare, cast, subtract).
        let d = ctx.e.mul(&prob, &weight);
        let mut lab_shape = ss.clone();
        lab_shape[1] = 1;
        let neg = ctx.e.op("Neg", &[&weight], vec![]);
        let shape = ctx
            .e
            .ints(&lab_shape.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let updates = ctx.e.op("Expand", &[&neg, &shape], vec![]);
        // An ignored label may be no class at all (-100): it points at class 0 instead,
        // with a zero update.
        let index = match &ignored {
            Some(eq) => {
                let zero = ctx.e.ints(&[0]);
                ctx.e.op("Where", &[eq, &zero, &lab], vec![])
            }
            None => lab,
        };
        let d = ctx.e.op(
            "ScatterElements",
            &[&d, &index, &updates],
            vec![int_attr("axis", 1), string_attr("reduction", "add")],
        );
        return Ok(vec![Some(d), None, None]);
    }
    let mut class_shape = vec![1usize; ss.len()];
    class_shape[1] = ss[1];
    let classes: Vec<i64> = (0..ss[1] as i64).collect();
    let classes = ctx.e.constant(crate::tensor::Tensor {
        shape: class_shape,
        data: crate::tensor::TensorData::I64(classes),
    });
    // Before opset 16: one_hot[n, c, ...] = (labels[n, ...] == c).
    let hit = ctx.e.op("Equal", &[&lab, &classes], vec![]);
    let onehot = ctx
        .e
        .op("Cast", &[&hit], vec![int_attr("to", t.onnx() as i64)]);
    let d = ctx.e.op("Sub", &[&prob, &onehot], vec![]);
    Ok(vec![Some(ctx.e.mul(&d, &weight)), None, None])
}

/// `ReduceMean(x, axes, keepdims = 1)`: the axes are an input from opset 18 on, an
/// attribute before.
pub(super) fn reduce_mean(ctx: &mut RuleCtx, x: &str, axes: &[i64]) -> String {
    let keep = int_attr("keepdims", 1);
    if ctx.opset >= 18 {
        let axes = ctx.e.ints(axes);
        ctx.e.op("ReduceMean", &[x, &axes], vec![keep])
    } else {
        ctx.e
            .op("ReduceMean", &[x], vec![ints_attr("axes", axes), keep])
    }
}

pub fn layer_norm(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, scale) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let r = sx.len();
    let a = norm_axis(attr_i(ctx.node, "axis").unwrap_or(-1), r);
    if let Some(g) = super::fused::layer_norm(ctx, a)? {
        return Ok(g);
    }
    let eps = attr_f(ctx.node, "epsilon").unwrap_or(1e-5) as f64;
    let norm_axes: Vec<i64> = (a as i64..r as i64).collect();
    let lead_axes: Vec<i64> = (0..a as i64).collect();
    let count: usize = sx[a..].iter().product();
    let inv_count = 1.0 / count as f64;

    // The forward node's Mean/InvStdDev outputs when it has them in X's type (ONNX
    // Runtime stashes float32 statistics by default), else recomputed from X.
    let stats_usable = |i: usize| {
        let name = ctx.output(i);
        !name.is_empty() && ctx.metas.get(name).is_some_and(|m| m.dtype == t)
    };
    let (mean, inv) = if stats_usable(1) && stats_usable(2) {
        (ctx.output(1).to_string(), ctx.output(2).to_string())
    } else {
        let s = ctx.e.reduce_sum(&x, &norm_axes, true);
        let mean = ctx.e.scale(&s, inv_count, t);
        let c = ctx.e.op("Sub", &[&x, &mean], vec![]);
        let c2 = ctx.e.mul(&c, &c);
        let vs = ctx.e.reduce_sum(&c2, &norm_axes, true);
        let var = ctx.e.scale(&vs, inv_count, t);
        let e = ctx.e.scalar(eps, t);
        let ve = ctx.e.op("Add", &[&var, &e], vec![]);
        let sd = ctx.e.op("Sqrt", &[&ve], vec![]);
        (mean, ctx.e.op("Reciprocal", &[&sd], vec![]))
    };
    let centered = ctx.e.op("Sub", &[&x, &mean], vec![]);
    let xhat = ctx.e.mul(&centered, &inv);

    let mut g = vec![None, None, None];
    let norm_shape = sx[a..].to_vec();
    let sum_lead = |ctx: &mut RuleCtx, v: &str, i: usize| -> Result<String> {
        let s = if lead_axes.is_empty() {
            v.to_string()
        } else {
            ctx.e.sum_leading(v, &sx, lead_axes.len(), t)
        };
        let to = shape(ctx, ctx.input(i))?;
        Ok(ctx.e.unbroadcast(&s, &norm_shape, &to, t))
    };
    if ctx.needs(2) {
        g[2] = Some(sum_lead(ctx, &dy, 2)?);
    }
    if ctx.needs(1) {
        let p = ctx.e.mul(&dy, &xhat);
        g[1] = Some(sum_lead(ctx, &p, 1)?);
    }
    if ctx.needs(0) {
        // dX = inv * (g - mean(g) - xhat * mean(g * xhat)), g = dY * scale
        // Means as `ReduceMean` (one kernel each, not a sum and a scale: every kernel
        // here costs ONNX Runtime about 10 us on rows this small).
        let gx = ctx.e.mul(&dy, &scale);
        let m1 = reduce_mean(ctx, &gx, &norm_axes);
        let gxh = ctx.e.mul(&gx, &xhat);
        let m2 = reduce_mean(ctx, &gxh, &norm_axes);
        let xm2 = ctx.e.mul(&xhat, &m2);
        let d1 = ctx.e.op("Sub", &[&gx, &m1], vec![]);
        let d2 = ctx.e.op("Sub", &[&d1, &xm2], vec![]);
        g[0] = Some(ctx.e.mul(&d2, &inv));
    }
    Ok(g)
}

/// NegativeLogLikelihoodLoss, `loss = -w[t] x[n, t]` per position (`t` its target, `w`
/// the class weights or 1): `dX` is zero but at each position's target, where it is
/// `-w[t]` times `dLoss` (`sum`, `none`) or `dLoss / sum of w[t]` over the positions not
/// ignored (`mean`).
pub fn nll_loss(ctx: &mut RuleCtx) -> Result<Grads> {
    let dloss = ctx.dy(0)?;
    if ctx.needs(2) {
        return Err(ctx.unsupported("a gradient for the class weights (input 2)"));
    }
    let (x, target) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let reduction = attr_s(ctx.node, "reduction").unwrap_or_else(|| "mean".into());
    let one = ctx.e.ints(&[1]);
    let tgt = match dtype(ctx, &target)? {
        DType::I64 => target.clone(),
        _ => ctx.e.op(
            "Cast",
            &[&target],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        ),
    };
    let lab = ctx.e.op("Unsqueeze", &[&tgt, &one], vec![]);
    let ignored = attr_i(ctx.node, "ignore_index").map(|ii| {
        let iiv = ctx.e.constant(crate::tensor::Tensor {
            shape: vec![],
            data: crate::tensor::TensorData::I64(vec![ii]),
        });
        ctx.e.op("Equal", &[&lab, &iiv], vec![])
    });
    let safe = match &ignored {
        Some(eq) => {
            let zero = ctx.e.ints(&[0]);
            ctx.e.op("Where", &[eq, &zero, &lab], vec![])
        }
        None => lab.clone(),
    };
    // Each position's weight: its class's (or 1), 0 where ignored.
    let mut lab_shape = sx.clone();
    lab_shape[1] = 1;
    let ones = {
        let dims = ctx
            .e
            .ints(&lab_shape.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let one = ctx.e.scalar(1.0, t);
        ctx.e.op("Expand", &[&one, &dims], vec![])
    };
    let mut w = match ctx.input(2) {
        "" => ones,
        weights => {
            let weights = weights.to_string();
            ctx.e.op("Gather", &[&weights, &safe], vec![])
        }
    };
    if let Some(eq) = &ignored {
        let zero = ctx.e.scalar(0.0, t);
        w = ctx.e.op("Where", &[eq, &zero, &w], vec![]);
    }
    let scaled = match reduction.as_str() {
        "mean" => {
            let total = ctx.e.op("ReduceSum", &[&w], vec![int_attr("keepdims", 0)]);
            let s = ctx.e.op("Div", &[&dloss, &total], vec![]);
            ctx.e.mul(&w, &s)
        }
        "sum" => ctx.e.mul(&w, &dloss),
        "none" => {
            let d = ctx.e.op("Unsqueeze", &[&dloss, &one], vec![]);
            ctx.e.mul(&w, &d)
        }
        other => return Err(ctx.unsupported(format!("reduction=\"{other}\""))),
    };
    let updates = ctx.e.op("Neg", &[&scaled], vec![]);
    let dims = ctx
        .e
        .ints(&sx.iter().map(|&d| d as i64).collect::<Vec<_>>());
    let value = crate::tensor::Tensor::zeros(t, vec![1]).to_proto("value");
    let zeros = ctx.e.op(
        "ConstantOfShape",
        &[&dims],
        vec![crate::graph::ir::tensor_attr("value", value)],
    );
    let dx = ctx.e.op(
        "ScatterElements",
        &[&zeros, &safe, &updates],
        vec![int_attr("axis", 1)],
    );
    Ok(vec![Some(dx), None, None])
}
