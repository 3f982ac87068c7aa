//! Elementwise operators: arithmetic with broadcasting, activations, Where, Cast,
//! Identity, Dropout.

use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_s, int_attr};
use crate::tensor::DType;
use crate::{Error, Result};

/// Shape of a forward value.
pub(super) fn shape(ctx: &RuleCtx, name: &str) -> Result<Vec<usize>> {
    Ok(ctx.meta(name)?.shape.clone())
}

/// Element type of a forward value.
pub(super) fn dtype(ctx: &RuleCtx, name: &str) -> Result<DType> {
    Ok(ctx.meta(name)?.dtype)
}

/// `g` summed down to the shape of input `i`.
fn to_input(ctx: &mut RuleCtx, g: &str, i: usize) -> Result<String> {
    let from = shape(ctx, ctx.output(0))?;
    let to = shape(ctx, ctx.input(i))?;
    let t = dtype(ctx, ctx.input(i))?;
    Ok(ctx.e.unbroadcast(g, &from, &to, t))
}

/// A rule for a one-input op whose gradient is `dY * f(X, Y)`.
fn unary(
    ctx: &mut RuleCtx,
    local: impl FnOnce(&mut RuleCtx, DType) -> Result<String>,
) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let t = dtype(ctx, ctx.input(0))?;
    let d = local(ctx, t)?;
    Ok(vec![Some(ctx.e.mul(&dy, &d))])
}

pub fn add_sub(ctx: &mut RuleCtx, sub: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let mut g = vec![None, None];
    if ctx.needs(0) {
        g[0] = Some(to_input(ctx, &dy, 0)?);
    }
    if ctx.needs(1) {
        let d = if sub {
            ctx.e.op("Neg", &[&dy], vec![])
        } else {
            dy
        };
        g[1] = Some(to_input(ctx, &d, 1)?);
    }
    Ok(g)
}

pub fn mul(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (a, b) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let mut g = vec![None, None];
    if ctx.needs(0) {
        let d = ctx.e.mul(&dy, &b);
        g[0] = Some(to_input(ctx, &d, 0)?);
    }
    if ctx.needs(1) {
        let d = ctx.e.mul(&dy, &a);
        g[1] = Some(to_input(ctx, &d, 1)?);
    }
    Ok(g)
}

pub fn div(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (b, y) = (ctx.input(1).to_string(), ctx.output(0).to_string());
    let mut g = vec![None, None];
    if ctx.needs(0) {
        let d = ctx.e.op("Div", &[&dy, &b], vec![]);
        g[0] = Some(to_input(ctx, &d, 0)?);
    }
    if ctx.needs(1) {
        // d(a/b)/db = -(a/b)/b = -y/b
        let dyy = ctx.e.mul(&dy, &y);
        let q = ctx.e.op("Div", &[&dyy, &b], vec![]);
        let d = ctx.e.op("Neg", &[&q], vec![]);
        g[1] = Some(to_input(ctx, &d, 1)?);
    }
    Ok(g)
}

pub fn neg(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    Ok(vec![Some(ctx.e.op("Neg", &[&dy], vec![]))])
}

pub fn pow(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (a, b, y) = (
        ctx.input(0).to_string(),
        ctx.input(1).to_string(),
        ctx.output(0).to_string(),
    );
    let t = dtype(ctx, &a)?;
    let mut g = vec![None, None];
    if ctx.needs(0) {
        // d(a^b)/da = b * a^(b-1); the exponent may be of another type than the base.
        let bt = if dtype(ctx, &b)? == t {
            b.clone()
        } else {
            ctx.e
                .op("Cast", &[&b], vec![int_attr("to", t.onnx() as i64)])
        };
        let one = ctx.e.scalar(1.0, t);
        let bm1 = ctx.e.op("Sub", &[&bt, &one], vec![]);
        let p = ctx.e.op("Pow", &[&a, &bm1], vec![]);
        let local = ctx.e.mul(&p, &bt);
        let d = ctx.e.mul(&dy, &local);
        g[0] = Some(to_input(ctx, &d, 0)?);
    }
    if ctx.needs(1) {
        // d(a^b)/db = a^b * ln(a)
        let ln = ctx.e.op("Log", &[&a], vec![]);
        let local = ctx.e.mul(&y, &ln);
        let d = ctx.e.mul(&dy, &local);
        g[1] = Some(to_input(ctx, &d, 1)?);
    }
    Ok(g)
}

pub fn sqrt(ctx: &mut RuleCtx) -> Result<Grads> {
    let y = ctx.output(0).to_string();
    unary(ctx, |ctx, t| {
        let half = ctx.e.scalar(0.5, t);
        Ok(ctx.e.op("Div", &[&half, &y], vec![]))
    })
}

pub fn exp(ctx: &mut RuleCtx) -> Result<Grads> {
    let y = ctx.output(0).to_string();
    unary(ctx, |_, _| Ok(y))
}

pub fn log(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    Ok(vec![Some(ctx.e.op("Div", &[&dy, &x], vec![]))])
}

pub fn erf(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    unary(ctx, |ctx, t| {
        // d erf(x)/dx = 2/sqrt(pi) * exp(-x^2)
        let x2 = ctx.e.mul(&x, &x);
        let n = ctx.e.op("Neg", &[&x2], vec![]);
        let ex = ctx.e.op("Exp", &[&n], vec![]);
        Ok(ctx.e.scale(&ex, std::f64::consts::FRAC_2_SQRT_PI, t))
    })
}

pub fn tanh(ctx: &mut RuleCtx) -> Result<Grads> {
    let y = ctx.output(0).to_string();
    unary(ctx, |ctx, t| {
        let y2 = ctx.e.mul(&y, &y);
        let one = ctx.e.scalar(1.0, t);
        Ok(ctx.e.op("Sub", &[&one, &y2], vec![]))
    })
}

pub fn sigmoid(ctx: &mut RuleCtx) -> Result<Grads> {
    let y = ctx.output(0).to_string();
    unary(ctx, |ctx, t| {
        let one = ctx.e.scalar(1.0, t);
        let omy = ctx.e.op("Sub", &[&one, &y], vec![]);
        Ok(ctx.e.mul(&y, &omy))
    })
}

/// `Where(x > 0, dY, dY * slope)`.
fn rectifier(ctx: &mut RuleCtx, slope: f64) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    let zero = ctx.e.scalar(0.0, t);
    let pos = ctx.e.op("Greater", &[&x, &zero], vec![]);
    let neg = if slope == 0.0 {
        zero
    } else {
        ctx.e.scale(&dy, slope, t)
    };
    Ok(vec![Some(ctx.e.op("Where", &[&pos, &dy, &neg], vec![]))])
}

pub fn relu(ctx: &mut RuleCtx) -> Result<Grads> {
    match super::fused::relu(ctx)? {
        Some(dx) => Ok(vec![Some(dx)]),
        None => rectifier(ctx, 0.0),
    }
}

pub fn leaky_relu(ctx: &mut RuleCtx) -> Result<Grads> {
    let alpha = attr_f(ctx.node, "alpha").unwrap_or(0.01) as f64;
    rectifier(ctx, alpha)
}

pub fn gelu(ctx: &mut RuleCtx) -> Result<Grads> {
    let x = ctx.input(0).to_string();
    let approximate = attr_s(ctx.node, "approximate").unwrap_or_else(|| "none".into());
    unary(ctx, |ctx, t| match approximate.as_str() {
        "none" => {
            // gelu(x) = x * Phi(x): derivative Phi(x) + x * phi(x)
            let xs = ctx.e.scale(&x, std::f64::consts::FRAC_1_SQRT_2, t);
            let erf = ctx.e.op("Erf", &[&xs], vec![]);
            let one = ctx.e.scalar(1.0, t);
            let ep1 = ctx.e.op("Add", &[&erf, &one], vec![]);
            let cdf = ctx.e.scale(&ep1, 0.5, t);
            let x2 = ctx.e.mul(&x, &x);
            let nh = ctx.e.scale(&x2, -0.5, t);
            let ex = ctx.e.op("Exp", &[&nh], vec![]);
            let pdf = ctx
                .e
                .scale(&ex, 1.0 / (2.0 * std::f64::consts::PI).sqrt(), t);
            let xpdf = ctx.e.mul(&x, &pdf);
            Ok(ctx.e.op("Add", &[&cdf, &xpdf], vec![]))
        }
        "tanh" => {
            // gelu(x) = 0.5 x (1 + tanh(u)), u = k (x + c x^3)
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let c = 0.044715;
            let x2 = ctx.e.mul(&x, &x);
            let x3 = ctx.e.mul(&x2, &x);
            let cx3 = ctx.e.scale(&x3, c, t);
            let inner = ctx.e.op("Add", &[&x, &cx3], vec![]);
            let u = ctx.e.scale(&inner, k, t);
            let th = ctx.e.op("Tanh", &[&u], vec![]);
            let one = ctx.e.scalar(1.0, t);
            let a = ctx.e.op("Add", &[&one, &th], vec![]);
            let left = ctx.e.scale(&a, 0.5, t);
            let th2 = ctx.e.mul(&th, &th);
            let sech2 = ctx.e.op("Sub", &[&one, &th2], vec![]);
            let three_c_x2 = ctx.e.scale(&x2, 3.0 * c, t);
            let du = ctx.e.op("Add", &[&one, &three_c_x2], vec![]);
            let du = ctx.e.scale(&du, k * 0.5, t);
            let r = ctx.e.mul(&sech2, &du);
            let right = ctx.e.mul(&x, &r);
            Ok(ctx.e.op("Add", &[&left, &right], vec![]))
        }
        other => Err(ctx.unsupported(format!("approximate=\"{other}\""))),
    })
}

pub fn where_(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let cond = ctx.input(0).to_string();
    let t = dtype(ctx, ctx.output(0))?;
    let mut g = vec![None, None, None];
    for (i, take_true) in [(1, true), (2, false)] {
        if ctx.needs(i) {
            let zero = ctx.e.scalar(0.0, t);
            let (a, b) = if take_true {
                (&dy, &zero)
            } else {
                (&zero, &dy)
            };
            let d = ctx.e.op("Where", &[&cond, a, b], vec![]);
            g[i] = Some(to_input(ctx, &d, i)?);
        }
    }
    Ok(g)
}

pub fn cast(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let t = dtype(ctx, ctx.input(0))?;
    Ok(vec![Some(ctx.e.op(
        "Cast",
        &[&dy],
        vec![int_attr("to", t.onnx() as i64)],
    ))])
}

/// CastLike: `dY` cast back to the input's type; the type donor gets none.
pub fn cast_like(ctx: &mut RuleCtx) -> Result<Grads> {
    let mut g = cast(ctx)?;
    g.push(None);
    Ok(g)
}

pub fn identity(ctx: &mut RuleCtx) -> Result<Grads> {
    Ok(vec![Some(ctx.dy(0)?)])
}

pub fn dropout(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let training = match ctx.input(2) {
        "" => false,
        name => ctx
            .consts
            .get(name)
            .map(|t| t.to_f64_vec().first().copied().unwrap_or(0.0) != 0.0)
            .ok_or_else(|| ctx.unsupported("training_mode must be a constant"))?,
    };
    if !training {
        return Ok(vec![Some(dy)]);
    }
    let mask = ctx.output(1).to_string();
    if mask.is_empty() {
        return Err(Error::graph(
            "Dropout in training mode needs its mask output (added by the training-graph builder)",
        ));
    }
    let ratio = ctx.const_scalar(1).unwrap_or(0.5);
    let t = dtype(ctx, ctx.input(0))?;
    let m = ctx
        .e
        .op("Cast", &[&mask], vec![int_attr("to", t.onnx() as i64)]);
    let kept = ctx.e.mul(&dy, &m);
    Ok(vec![Some(ctx.e.scale(&kept, 1.0 / (1.0 - ratio), t))])
}
