//! Activations' backward kernels, float32.
//!
//! `ReluGrad`: `dY, X` in, `dX = X > 0 ? dY : 0` out: one kernel where the standard-op form
//! is two (`Greater`, `Where`); a selection, so bitwise the standard-op result.
//!
//! GELU's backward as PyTorch exports `nn.GELU()` (`x * (1 + erf(x / k)) / 2`, `k = sqrt
//! 2`), from the forward's own values, float32: one kernel where the whole-function
//! backward of `graph::autodiff::gelu` is seven, each a full pass over the tensor.
//!
//! `GeluGrad`: `dY, T, A` in (`T = x / k` and `A = 1 + erf(T)`, kept from the forward),
//! `dX = dY * (A * 0.5 + T * exp(ln(1 / sqrt pi) - T * T))` out, the standard-op form's
//! arithmetic in its order; only `exp` differs ([`super::math::exp`], within 3 ulp). The
//! forward stays ONNX Runtime's: the values the loss sees are unchanged.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, math, par_blocks};
use crate::graph::custom_ops::{GELU_GRAD, RELU_GRAD};

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
            let (t, a) = (input(ctx, GELU_GRAD, 1)?, input(ctx, GELU_GRAD, 2)?);
            let (shape, t) = t.try_extract_tensor::<f32>()?;
            let (_, a) = a.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            if dy.len() != t.len() || a.len() != t.len() {
                return Err(ort::Error::new(format!(
                    "GeluGrad: dY, T and A of {}, {} and {} values",
                    dy.len(),
                    t.len(),
                    a.len()
                )));
            }
            let mut dx = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("GeluGrad: no dX"))?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, dx, UNIT, |at, dx| {
                let end = at + dx.len();
                gelu_grad(&dy[at..end], &t[at..end], &a[at..end], dx);
            })
        }))
    }
}

/// `dx = dy * (a * 0.5 + t * exp(C - t * t))`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_grad(dy: &[f32], t: &[f32], a: &[f32], dx: &mut [f32]) {
    for (((dx, &dy), &t), &a) in dx.iter_mut().zip(dy).zip(t).zip(a) {
        *dx = dy * (a * 0.5 + t * math::exp(C - t * t));
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
            if dy.len() != x.len() {
                return Err(ort::Error::new(format!(
                    "ReluGrad: dY of {} values for X of {}",
                    dy.len(),
                    x.len()
                )));
            }
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
