//! Activations' backward kernels, float32.
//!
//! `ReluGrad`: `dY, X` in, `dX = X > 0 ? dY : 0` out: one kernel where the standard-op form
//! is two (`Greater`, `Where`); a selection, so bitwise the standard-op result.
//!
//! GELU as PyTorch exports `nn.GELU()` (`x * (1 + erf(x / k)) / 2`, `k = sqrt 2`: five
//! nodes), whose `x / k` and `Erf` stay ONNX Runtime's:
//!
//! `GeluFromErf`: `X, T, E` in (`T = x / k`, `E = erf(T)`), `Y = (X * (E + 1)) * 0.5` out,
//! one kernel for the last three nodes, the same arithmetic in the same order, so `Y` is
//! bit for bit the exported form's.
//!
//! `GeluGrad`: `dY, T, E` in, `dX = dY * ((E + 1) * 0.5 + T * exp(ln(1 / sqrt pi) - T * T))`
//! out, one kernel where the whole-function backward of `graph::autodiff::gelu` is seven,
//! the standard-op form's arithmetic in its order; only `exp` differs
//! ([`super::math::exp`], within 3 ulp).

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, math, par_blocks};
use crate::graph::custom_ops::{GELU_FROM_ERF, GELU_GRAD, RELU_GRAD};

/// Values per block unit (any size works; whole cache lines).
const UNIT: usize = 64;

/// `ln(1 / sqrt pi)`: `exp(C - t^2) = exp(-t^2) / sqrt pi`.
const C: f32 = -0.572_364_9;

/// GELU's backward as one kernel.
pub(crate) struct GeluGrad;

impl Operator for GeluGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..3).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            let dy = input(ctx, GELU_GRAD, 0)?;
            let (t, e) = (input(ctx, GELU_GRAD, 1)?, input(ctx, GELU_GRAD, 2)?);
            let (shape, t) = t.try_extract_tensor::<f32>()?;
            let (_, e) = e.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            same_lengths(GELU_GRAD, &[dy.len(), t.len(), e.len()])?;
            let mut dx = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("GeluGrad: no dX"))?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, dx, UNIT, |at, dx| {
                let end = at + dx.len();
                gelu_grad(&dy[at..end], &t[at..end], &e[at..end], dx);
            })
        }))
    }
}

/// `dx = dy * ((e + 1) * 0.5 + t * exp(C - t * t))`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_grad(dy: &[f32], t: &[f32], e: &[f32], dx: &mut [f32]) {
    for (((dx, &dy), &t), &e) in dx.iter_mut().zip(dy).zip(t).zip(e) {
        *dx = dy * ((e + 1.0) * 0.5 + t * math::exp(C - t * t));
    }
}

/// An error naming `op` unless its inputs hold as many values each.
fn same_lengths(op: &str, lengths: &[usize]) -> ort::Result<()> {
    match lengths.iter().all(|&n| n == lengths[0]) {
        true => Ok(()),
        false => Err(ort::Error::new(format!(
            "{op}: inputs of {lengths:?} values (they must be equal)"
        ))),
    }
}

/// The end of GELU as one kernel.
pub(crate) struct GeluFromErf;

impl Operator for GeluFromErf {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU_FROM_ERF
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..3).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            // `T` is read by the backward only; here it just has to be there.
            let (x, e) = (input(ctx, GELU_FROM_ERF, 0)?, input(ctx, GELU_FROM_ERF, 2)?);
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let (_, e) = e.try_extract_tensor::<f32>()?;
            same_lengths(GELU_FROM_ERF, &[x.len(), e.len()])?;
            let mut y = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("GeluFromErf: no Y"))?;
            let (_, y) = y.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, y, UNIT, |at, y| {
                gelu_from_erf(&x[at..at + y.len()], &e[at..at + y.len()], y);
            })
        }))
    }
}

/// `y = (x * (e + 1)) * 0.5`, elementwise: the exported form's three nodes.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_from_erf(x: &[f32], e: &[f32], y: &mut [f32]) {
    for ((y, &x), &e) in y.iter_mut().zip(x).zip(e) {
        *y = (x * (e + 1.0)) * 0.5;
    }
}

/// ReLU's backward as one kernel.
pub(crate) struct ReluGrad;

impl Operator for ReluGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        RELU_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..2).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            let (dy, x) = (input(ctx, RELU_GRAD, 0)?, input(ctx, RELU_GRAD, 1)?);
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            same_lengths(RELU_GRAD, &[dy.len(), x.len()])?;
            let mut dx = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("ReluGrad: no dX"))?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, dx, UNIT, |at, dx| {
                let end = at + dx.len();
                relu_grad(&dy[at..end], &x[at..end], dx);
            })
        }))
    }
}

/// `dx = x > 0 ? dy : 0`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn relu_grad(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = if x > 0.0 { dy } else { 0.0 };
    }
}
