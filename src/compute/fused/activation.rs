//! Activations' kernels, float32.
//!
//! `ReluGrad`: `dY, X` in, `dX = X > 0 ? dY : 0` out: one kernel where the standard-op form
//! is two (`Greater`, `Where`); a selection, so bitwise the standard-op result.
//!
//! GELU as PyTorch exports `nn.GELU()`: `t = x / k` (or `x * c`), `e = erf(t)`, `y = (x *
//! (e + 1)) * 0.5`, five nodes.
//!
//! `ErfGelu`: `X` in, `Y, E` out (`E = erf(t)`, kept for the backward); attributes
//! `scale` (`k` or `c`) and `divide` (1: `t = x / scale`, 0: `t = x * scale`). One pass
//! where the exported form is five kernels; the exported form's arithmetic in its order,
//! with ONNX Runtime's own `erf` ([`super::math::erf`]), so bit for bit its values.
//!
//! `GeluGrad`: `dY, X, E` in, `dX = dY * ((E + 1) * 0.5 + t * exp(ln(1 / sqrt pi) - t * t))`
//! out (same attributes, `t` made again from `X` as the forward made it), one kernel where
//! the whole-function backward of `graph::autodiff::gelu` is seven, the standard-op form's
//! arithmetic in its order; only `exp` differs ([`super::math::exp`], within 3 ulp).

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::pointwise::Pointwise;
use super::{input, math, output, par_block_pairs, par_blocks};
use crate::graph::custom_ops::{ERF_GELU, GELU_GRAD, RELU_GRAD};

/// `ln(1 / sqrt pi)`: `exp(C - t^2) = exp(-t^2) / sqrt pi`.
const C: f32 = -0.572_364_9;

/// ReLU's backward as one kernel.
pub(crate) const RELU_GRAD_OP: Pointwise = Pointwise {
    name: RELU_GRAD,
    inputs: 2,
    rows: false,
    block: |i, dx, _| relu_grad(i[0], i[1], dx),
};

/// How a GELU makes `t` from `x`: the `ErfGelu` and `GeluGrad` attributes.
#[derive(Clone, Copy)]
struct Scale {
    by: f32,
    divide: bool,
}

impl Scale {
    fn of(info: &KernelContext<'_>, op: &str) -> ort::Result<Scale> {
        let by = info.get::<f32>("scale");
        let divide = info.get::<i64>("divide").unwrap_or(0) != 0;
        match by {
            Some(by) if by.is_finite() && (by != 0.0 || !divide) => Ok(Scale { by, divide }),
            _ => Err(ort::Error::new(format!(
                "{op}: attribute scale {by:?} (a finite number, not 0 when dividing)"
            ))),
        }
    }
}

/// PyTorch's erf GELU (`ErfGelu`), or its backward (`GeluGrad`), as one kernel.
#[derive(Clone, Copy)]
pub(crate) struct Gelu {
    pub grad: bool,
}

impl Operator for Gelu {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        if self.grad {
            GELU_GRAD
        } else {
            ERF_GELU
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let n = if self.grad { 3 } else { 1 };
        (0..n).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        let n = if self.grad { 1 } else { 2 };
        (0..n).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let (op, grad) = (self.name().to_string(), self.grad);
        let scale = Scale::of(info, &op)?;
        Ok(Box::new(move |ctx: &ComputeContext| match grad {
            false => forward(ctx, &op, scale),
            true => backward(ctx, &op, scale),
        }))
    }
}

/// `Y, E` from `X` in blocks on the intra-op threads.
fn forward(ctx: &ComputeContext, op: &str, s: Scale) -> ort::Result<()> {
    let x = input(ctx, op, 0)?;
    let (shape, x) = x.try_extract_tensor::<f32>()?;
    let (mut y, mut e) = (output(ctx, op, 0, shape)?, output(ctx, op, 1, shape)?);
    let (_, y) = y.try_extract_tensor_mut::<f32>()?;
    let (_, e) = e.try_extract_tensor_mut::<f32>()?;
    par_block_pairs(ctx, (y, e), |at, y, e| gelu(&x[at..at + y.len()], s, y, e))
}

/// `dX` from `dY, X, E` in blocks on the intra-op threads.
fn backward(ctx: &ComputeContext, op: &str, s: Scale) -> ort::Result<()> {
    let (dy, x, e) = (input(ctx, op, 0)?, input(ctx, op, 1)?, input(ctx, op, 2)?);
    let (shape, dy) = dy.try_extract_tensor::<f32>()?;
    let (_, x) = x.try_extract_tensor::<f32>()?;
    let (_, e) = e.try_extract_tensor::<f32>()?;
    if x.len() != dy.len() || e.len() != dy.len() {
        return Err(ort::Error::new(format!(
            "{op}: dY, X and E of {}, {} and {} values (equal lengths)",
            dy.len(),
            x.len(),
            e.len()
        )));
    }
    let mut dx = output(ctx, op, 0, shape)?;
    let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
    par_blocks(ctx, dx, 1, |at, dx| {
        let part = at..at + dx.len();
        gelu_grad(&dy[part.clone()], &x[part.clone()], &e[part], s, dx)
    })
}

/// `dx = x > 0 ? dy : 0`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn relu_grad(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = if x > 0.0 { dy } else { 0.0 };
    }
}

/// `e = erf(t)`, `y = (x * (e + 1)) * 0.5`, elementwise: the exported form's nodes.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu(x: &[f32], s: Scale, y: &mut [f32], e: &mut [f32]) {
    let by = s.by;
    match s.divide {
        true => gelu_with(x, |x| x / by, y, e),
        false => gelu_with(x, |x| x * by, y, e),
    }
}

#[inline(always)]
fn gelu_with(x: &[f32], t: impl Fn(f32) -> f32, y: &mut [f32], e: &mut [f32]) {
    for ((y, e), &x) in y.iter_mut().zip(e.iter_mut()).zip(x) {
        *e = math::erf(t(x));
        *y = (x * (*e + 1.0)) * 0.5;
    }
}

/// `dx = dy * ((e + 1) * 0.5 + t * exp(C - t * t))`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_grad(dy: &[f32], x: &[f32], e: &[f32], s: Scale, dx: &mut [f32]) {
    let by = s.by;
    match s.divide {
        true => gelu_grad_with(dy, x, e, |x| x / by, dx),
        false => gelu_grad_with(dy, x, e, |x| x * by, dx),
    }
}

#[inline(always)]
fn gelu_grad_with(dy: &[f32], x: &[f32], e: &[f32], t: impl Fn(f32) -> f32, dx: &mut [f32]) {
    for (((dx, &dy), &x), &e) in dx.iter_mut().zip(dy).zip(x).zip(e) {
        let t = t(x);
        *dx = dy * ((e + 1.0) * 0.5 + t * math::exp(C - t * t));
    }
}
