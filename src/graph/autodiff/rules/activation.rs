//! Piecewise and trigonometric activations the exporters write for CNNs and language
//! models: Abs, Reciprocal, Sin, Cos, Softplus, Clip (PyTorch's ReLU6 and clamp),
//! HardSigmoid, HardSwish, Min and Max, Sum, Atan, and the piecewise-constant ops
//! (Sign, Floor, Ceil, Round) whose gradient is zero almost everywhere.
//!
//! Where PyTorch's backward and the mathematical derivative differ at a kink, the rule
//! follows PyTorch, since a model moved from PyTorch should train the same: ReLU6 and
//! hardsigmoid pass no gradient at their boundaries, `maximum`/`minimum` split a tie
//! evenly.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, int_attr};
use crate::tensor::DType;
use crate::Result;

/// `dY * local` for a one-input op.
fn times(ctx: &mut RuleCtx, local: &str) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    Ok(vec![Some(ctx.e.mul(&dy, local))])
}

pub fn abs(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let sign = ctx.e.op("Sign", &[&x], vec![]);
    times(ctx, &sign)
}

pub fn reciprocal(ctx: &mut RuleCtx) -> Result<Grads> {
    // d(1/x)/dx = -y^2
    let y = ctx.output(0).to_string();
    let y2 = ctx.e.mul(&y, &y);
    let dy = ctx.dy(0)?;
    let d = ctx.e.mul(&dy, &y2);
    Ok(vec![Some(ctx.e.op("Neg", &[&d], vec![]))])
}

pub fn sin(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let c = ctx.e.op("Cos", &[&x], vec![]);
    times(ctx, &c)
}

pub fn cos(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let s = ctx.e.op("Sin", &[&x], vec![]);
    let d = times(ctx, &s)?;
    let d = d[0].clone().expect("one gradient");
    Ok(vec![Some(ctx.e.op("Neg", &[&d], vec![]))])
}

pub fn softplus(ctx: &mut RuleCtx) -> Result<Grads> {
    // d log(1 + e^x)/dx = sigmoid(x)
    let x = ctx.input(0).to_string();
    let s = ctx.e.op("Sigmoid", &[&x], vec![]);
    times(ctx, &s)
}

/// Zero gradient almost everywhere: nothing flows back.
pub fn piecewise_constant(ctx: &mut RuleCtx) -> Result<Grads> {
    Ok(vec![None; ctx.node.input.len()])
}

/// `Where(lo < x < hi, dY, 0)` for the bounds that are given.
fn pass_between(
    ctx: &mut RuleCtx,
    x: &str,
    lo: Option<&str>,
    hi: Option<&str>,
    t: DType,
) -> Result<String> {
    let dy = ctx.dy(0)?;
    let inside = match (lo, hi) {
        (Some(l), Some(h)) => {
            let a = ctx.e.op("Greater", &[x, l], vec![]);
            let b = ctx.e.op("Less", &[x, h], vec![]);
            Some(ctx.e.op("And", &[&a, &b], vec![]))
        }
        (Some(l), None) => Some(ctx.e.op("Greater", &[x, l], vec![])),
        (None, Some(h)) => Some(ctx.e.op("Less", &[x, h], vec![])),
        (None, None) => None,
    };
    Ok(match inside {
        Some(mask) => {
            let zero = ctx.e.scalar(0.0, t);
            ctx.e.op("Where", &[&mask, &dy, &zero], vec![])
        }
        None => dy,
    })
}

/// Clip, its bounds as inputs (every supported opset, 13 on).
pub fn clip(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    if ctx.needs(1) || ctx.needs(2) {
        return Err(ctx.unsupported("trained clipping bounds"));
    }
    let lo = Some(ctx.input(1).to_string()).filter(|s| !s.is_empty());
    let hi = Some(ctx.input(2).to_string()).filter(|s| !s.is_empty());
    let dx = pass_between(ctx, &x, lo.as_deref(), hi.as_deref(), t)?;
    let mut g = vec![None; ctx.node.input.len()];
    g[0] = Some(dx);
    Ok(g)
}

/// HardSigmoid `max(0, min(1, alpha x + beta))`: `alpha dY` where `0 < alpha x + beta < 1`.
pub fn hard_sigmoid(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    let alpha = attr_f(ctx.node, "alpha").unwrap_or(0.2) as f64;
    let beta = attr_f(ctx.node, "beta").unwrap_or(0.5) as f64;
    let ax = ctx.e.scale(&x, alpha, t);
    let b = ctx.e.scalar(beta, t);
    let u = ctx.e.op("Add", &[&ax, &b], vec![]);
    let (zero, one) = (ctx.e.scalar(0.0, t), ctx.e.scalar(1.0, t));
    let passed = pass_between(ctx, &u, Some(&zero), Some(&one), t)?;
    Ok(vec![Some(ctx.e.scale(&passed, alpha, t))])
}

/// HardSwish `x * hardsigmoid(x)` (alpha 1/6, beta 1/2), as PyTorch differentiates it:
/// 0 below -3, `dY (x/3 + 1/2)` up to 3 inclusive, `dY` above.
pub fn hard_swish(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    let x3 = ctx.e.scale(&x, 1.0 / 3.0, t);
    let half = ctx.e.scalar(0.5, t);
    let slope = ctx.e.op("Add", &[&x3, &half], vec![]);
    let middle = ctx.e.mul(&dy, &slope);
    let three = ctx.e.scalar(3.0, t);
    let above = ctx.e.op("Greater", &[&x, &three], vec![]);
    let upper = ctx.e.op("Where", &[&above, &dy, &middle], vec![]);
    let minus_three = ctx.e.scalar(-3.0, t);
    let below = ctx.e.op("Less", &[&x, &minus_three], vec![]);
    let zero = ctx.e.scalar(0.0, t);
    Ok(vec![Some(ctx.e.op(
        "Where",
        &[&below, &zero, &upper],
        vec![],
    ))])
}

/// Min and Max of two inputs (or one, the identity): the gradient goes to the input
/// that was chosen, half to each on a tie (PyTorch's `maximum`/`minimum`).
/// Min and Max of any number of inputs (broadcasting): each input gets `dY` where it is
/// the result, shared evenly among the inputs tied there (PyTorch's `maximum` splits a
/// two-way tie in halves).
pub fn min_max(ctx: &mut RuleCtx, _max: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let inputs: Vec<String> = ctx.node.input.clone();
    if inputs.len() == 1 {
        return Ok(vec![Some(dy)]);
    }
    let y = ctx.output(0).to_string();
    let t = dtype(ctx, &y)?;
    let from = shape(ctx, &y)?;
    // Which inputs hold the result, and how many at each position.
    let hits: Vec<String> = inputs
        .iter()
        .map(|x| {
            let eq = ctx.e.op("Equal", &[x, &y], vec![]);
            ctx.e
                .op("Cast", &[&eq], vec![int_attr("to", t.onnx() as i64)])
        })
        .collect();
    let refs: Vec<&str> = hits.iter().map(String::as_str).collect();
    let count = ctx.e.op("Sum", &refs, vec![]);
    let share = ctx.e.op("Div", &[&dy, &count], vec![]);
    let mut g = vec![None; inputs.len()];
    for (i, x) in inputs.iter().enumerate() {
        if ctx.needs(i) {
            let d = ctx.e.mul(&hits[i], &share);
            let to = shape(ctx, x)?;
            g[i] = Some(ctx.e.unbroadcast(&d, &from, &to, t));
        }
    }
    Ok(g)
}

/// Atan: `dY / (1 + x^2)`.
pub fn atan(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    let sq = ctx.e.mul(&x, &x);
    let one = ctx.e.scalar(1.0, t);
    let den = ctx.e.op("Add", &[&sq, &one], vec![]);
    let dy = ctx.dy(0)?;
    Ok(vec![Some(ctx.e.op("Div", &[&dy, &den], vec![]))])
}

/// Sum of any number of inputs, broadcasting: each gets `dY` summed to its shape.
pub fn sum(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let from = shape(ctx, ctx.output(0))?;
    let mut g = vec![None; ctx.node.input.len()];
    for (i, slot) in g.iter_mut().enumerate() {
        if ctx.needs(i) {
            let name = ctx.input(i).to_string();
            let (to, t) = (shape(ctx, &name)?, dtype(ctx, &name)?);
            *slot = Some(ctx.e.unbroadcast(&dy, &from, &to, t));
        }
    }
    Ok(g)
}
