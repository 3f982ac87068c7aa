//! The rest of ONNX's elementwise functions whose derivative is a formula of `x` and `y`:
//! the inverse and hyperbolic trigonometric functions, Tan, Elu, Celu, Selu, Mish,
//! Softsign, ThresholdedRelu, Shrink, PRelu, Mod and Mean. At a kink the rule follows
//! PyTorch's backward (Elu, Celu and Selu take the `x > 0` branch only for `x > 0`).

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i};
use crate::tensor::DType;
use crate::Result;

/// `dY * local` for a one-input op.
fn times(ctx: &mut RuleCtx, local: &str) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    Ok(vec![Some(ctx.e.mul(&dy, local))])
}

/// `x`, `y` and their type.
fn xy(ctx: &RuleCtx) -> Result<(String, String, DType)> {
    let x = ctx.input(0).to_string();
    let t = dtype(ctx, &x)?;
    Ok((x, ctx.output(0).to_string(), t))
}

/// `1 + s * x^2` (`s` = 1 or -1), or `x^2 - 1` where `minus_one`.
fn square_plus(ctx: &mut RuleCtx, x: &str, s: f64, minus_one: bool, t: DType) -> String {
    let sq = ctx.e.mul(x, x);
    let scaled = ctx.e.scale(&sq, s, t);
    let c = ctx.e.scalar(if minus_one { -1.0 } else { 1.0 }, t);
    ctx.e.op("Add", &[&scaled, &c], vec![])
}

/// Asin, Acos, Atanh, Asinh, Acosh, Sinh, Cosh and Tan.
pub fn trig(ctx: &mut RuleCtx, op: &str) -> Result<Grads> {
    let (x, y, t) = xy(ctx)?;
    let local = match op {
        // 1 / sqrt(1 - x^2), negated for Acos.
        "Asin" | "Acos" => {
            let d = square_plus(ctx, &x, -1.0, false, t);
            let r = ctx.e.op("Sqrt", &[&d], vec![]);
            let inv = ctx.e.op("Reciprocal", &[&r], vec![]);
            ctx.e.scale(&inv, if op == "Acos" { -1.0 } else { 1.0 }, t)
        }
        "Atanh" => {
            let d = square_plus(ctx, &x, -1.0, false, t);
            ctx.e.op("Reciprocal", &[&d], vec![])
        }
        "Asinh" | "Acosh" => {
            let d = square_plus(ctx, &x, 1.0, op == "Acosh", t);
            let r = ctx.e.op("Sqrt", &[&d], vec![]);
            ctx.e.op("Reciprocal", &[&r], vec![])
        }
        "Sinh" => ctx.e.op("Cosh", &[&x], vec![]),
        "Cosh" => ctx.e.op("Sinh", &[&x], vec![]),
        // Tan: 1 + y^2.
        _ => square_plus(ctx, &y, 1.0, false, t),
    };
    times(ctx, &local)
}

/// `where x > 0 { positive } else { negative }`.
fn by_sign(ctx: &mut RuleCtx, x: &str, positive: &str, negative: &str, t: DType) -> String {
    let zero = ctx.e.scalar(0.0, t);
    let pos = ctx.e.op("Greater", &[x, &zero], vec![]);
    ctx.e.op("Where", &[&pos, positive, negative], vec![])
}

/// Elu (`alpha (e^x - 1)` below 0), Celu (`alpha (e^(x/alpha) - 1)`) and Selu (`gamma` times
/// Elu with its own `alpha`): below 0 the derivative is `y + alpha` (Elu), `y / alpha + 1`
/// (Celu), `y + gamma alpha` (Selu); above, 1 (`gamma` for Selu).
pub fn exponential_linear(ctx: &mut RuleCtx, op: &str) -> Result<Grads> {
    let (x, y, t) = xy(ctx)?;
    let alpha = f64::from(attr_f(ctx.node, "alpha").unwrap_or(match op {
        "Selu" => 1.673_263_2,
        _ => 1.0,
    }));
    let gamma = f64::from(attr_f(ctx.node, "gamma").unwrap_or(1.050_701));
    let (above, below) = match op {
        "Elu" => (1.0, {
            let a = ctx.e.scalar(alpha, t);
            ctx.e.op("Add", &[&y, &a], vec![])
        }),
        "Celu" => (1.0, {
            let s = ctx.e.scale(&y, 1.0 / alpha, t);
            let one = ctx.e.scalar(1.0, t);
            ctx.e.op("Add", &[&s, &one], vec![])
        }),
        _ => (gamma, {
            let a = ctx.e.scalar(gamma * alpha, t);
            ctx.e.op("Add", &[&y, &a], vec![])
        }),
    };
    let above = ctx.e.scalar(above, t);
    let local = by_sign(ctx, &x, &above, &below, t);
    times(ctx, &local)
}

/// Mish, `x tanh(softplus(x))`: `tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)`.
pub fn mish(ctx: &mut RuleCtx) -> Result<Grads> {
    let (x, _, t) = xy(ctx)?;
    let sp = ctx.e.op("Softplus", &[&x], vec![]);
    let th = ctx.e.op("Tanh", &[&sp], vec![]);
    let th2 = ctx.e.mul(&th, &th);
    let one = ctx.e.scalar(1.0, t);
    let sech2 = ctx.e.op("Sub", &[&one, &th2], vec![]);
    let sig = ctx.e.op("Sigmoid", &[&x], vec![]);
    let xs = ctx.e.mul(&x, &sech2);
    let second = ctx.e.mul(&xs, &sig);
    let local = ctx.e.op("Add", &[&th, &second], vec![]);
    times(ctx, &local)
}

/// Softsign, `x / (1 + |x|)`: `1 / (1 + |x|)^2`.
pub fn softsign(ctx: &mut RuleCtx) -> Result<Grads> {
    let (x, _, t) = xy(ctx)?;
    let a = ctx.e.op("Abs", &[&x], vec![]);
    let one = ctx.e.scalar(1.0, t);
    let d = ctx.e.op("Add", &[&a, &one], vec![]);
    let d2 = ctx.e.mul(&d, &d);
    let local = ctx.e.op("Reciprocal", &[&d2], vec![]);
    times(ctx, &local)
}

/// ThresholdedRelu (`x` above `alpha`) and Shrink (`x - bias` above `lambd`, `x + bias`
/// below `-lambd`): `dY` where the output follows `x`, 0 elsewhere.
pub fn thresholded(ctx: &mut RuleCtx, shrink: bool) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, _, t) = xy(ctx)?;
    let zero = ctx.e.scalar(0.0, t);
    let pass = match shrink {
        false => {
            let alpha = ctx
                .e
                .scalar(f64::from(attr_f(ctx.node, "alpha").unwrap_or(1.0)), t);
            ctx.e.op("Greater", &[&x, &alpha], vec![])
        }
        true => {
            let lambd = f64::from(attr_f(ctx.node, "lambd").unwrap_or(0.5));
            let a = ctx.e.op("Abs", &[&x], vec![]);
            let l = ctx.e.scalar(lambd, t);
            ctx.e.op("Greater", &[&a, &l], vec![])
        }
    };
    Ok(vec![Some(ctx.e.op("Where", &[&pass, &dy, &zero], vec![]))])
}

/// PRelu, `x` above 0 and `slope x` below: `dX = dY` or `slope dY`; `dSlope = dY x` where
/// `x < 0`, summed to the slope's shape.
pub fn prelu(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, slope) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let t = dtype(ctx, &x)?;
    let (sy, ss, sx) = (
        shape(ctx, ctx.output(0))?,
        shape(ctx, &slope)?,
        shape(ctx, &x)?,
    );
    let zero = ctx.e.scalar(0.0, t);
    let pos = ctx.e.op("Greater", &[&x, &zero], vec![]);
    let mut g = vec![None, None];
    if ctx.needs(0) {
        let scaled = ctx.e.mul(&dy, &slope);
        let d = ctx.e.op("Where", &[&pos, &dy, &scaled], vec![]);
        g[0] = Some(ctx.e.unbroadcast(&d, &sy, &sx, t));
    }
    if ctx.needs(1) {
        let p = ctx.e.mul(&dy, &x);
        let d = ctx.e.op("Where", &[&pos, &zero, &p], vec![]);
        g[1] = Some(ctx.e.unbroadcast(&d, &sy, &ss, t));
    }
    Ok(g)
}

/// Mod, `a - b q` with `q` the quotient rounded down (`fmod = 1`: toward zero), constant
/// almost everywhere: `dA = dY`, `dB = -q dY`.
pub fn modulo(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (a, b) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let t = dtype(ctx, &a)?;
    if !t.is_float() {
        return Ok(vec![None, None]);
    }
    let sy = shape(ctx, ctx.output(0))?;
    let mut g = vec![None, None];
    if ctx.needs(0) {
        let sa = shape(ctx, &a)?;
        g[0] = Some(ctx.e.unbroadcast(&dy, &sy, &sa, t));
    }
    if ctx.needs(1) {
        let q = ctx.e.op("Div", &[&a, &b], vec![]);
        let q = match attr_i(ctx.node, "fmod").unwrap_or(0) {
            0 => ctx.e.op("Floor", &[&q], vec![]),
            // Toward zero: floor for positive quotients, ceil for negative.
            _ => {
                let f = ctx.e.op("Floor", &[&q], vec![]);
                let c = ctx.e.op("Ceil", &[&q], vec![]);
                by_sign(ctx, &q, &f, &c, t)
            }
        };
        let p = ctx.e.mul(&q, &dy);
        let n = ctx.e.op("Neg", &[&p], vec![]);
        let sb = shape(ctx, &b)?;
        g[1] = Some(ctx.e.unbroadcast(&n, &sy, &sb, t));
    }
    Ok(g)
}

/// Mean of any number of inputs (broadcasting): each gets `dY / n` summed to its shape.
pub fn mean(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let n = ctx.node.input.len();
    let from = shape(ctx, ctx.output(0))?;
    let t = dtype(ctx, ctx.output(0))?;
    let share = ctx.e.scale(&dy, 1.0 / n as f64, t);
    let mut g = vec![None; n];
    for (i, slot) in g.iter_mut().enumerate() {
        if ctx.needs(i) {
            let to = shape(ctx, ctx.input(i))?;
            *slot = Some(ctx.e.unbroadcast(&share, &from, &to, t));
        }
    }
    Ok(g)
}
