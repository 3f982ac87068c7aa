//! GELU as PyTorch exports `nn.GELU()` (`x * (1 + erf(x / sqrt 2)) / 2`), forward and
//! backward, float32: each one kernel where the exported form is five (forward) and the
//! whole-function backward of `graph::autodiff::gelu` seven, every one a full pass over
//! the tensor.
//!
//! `Gelu`: `X` in, `Y` out. `GeluGrad`: `dY, X` in, `dX = dY * ((1 + erf(t)) / 2 + t *
//! exp(-t^2) / sqrt(pi))` out, `t = X / sqrt 2`; it recomputes `erf(t)` rather than
//! keeping the forward's, which costs less than writing and reading it back. Within the
//! error of [`super::math`] (2.5e-7 absolute in `erf`) of ONNX Runtime's `Erf`.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, math, par_blocks};
use crate::graph::custom_ops::{GELU, GELU_GRAD};

/// Values per block unit (any size works; whole cache lines).
const UNIT: usize = 64;

/// `1 / sqrt 2`.
const C: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// `1 / sqrt pi`.
const INV_SQRT_PI: f32 = 0.564_189_6;

/// GELU (erf form) as one kernel.
pub(crate) struct Gelu;

impl Operator for Gelu {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            let x = input(ctx, GELU, 0)?;
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let mut y = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("Gelu: no output"))?;
            let (_, y) = y.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, y, UNIT, |at, y| gelu(&x[at..at + y.len()], y))
        }))
    }
}

/// GELU's backward (erf form) as one kernel.
pub(crate) struct GeluGrad;

impl Operator for GeluGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..2).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            let (dy, x) = (input(ctx, GELU_GRAD, 0)?, input(ctx, GELU_GRAD, 1)?);
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            if dy.len() != x.len() {
                return Err(ort::Error::new(format!(
                    "GeluGrad: dY of {} values for X of {}",
                    dy.len(),
                    x.len()
                )));
            }
            let mut dx = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("GeluGrad: no dX"))?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, dx, UNIT, |at, dx| {
                let end = at + dx.len();
                gelu_grad(&dy[at..end], &x[at..end], dx);
            })
        }))
    }
}

/// `y = x * (1 + erf(x / sqrt 2)) / 2`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub(crate) fn gelu(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let (e, _) = math::erf_and_gauss(x * C);
        *y = x * (1.0 + e) * 0.5;
    }
}

/// GELU's derivative times `dy`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub(crate) fn gelu_grad(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        let t = x * C;
        let (e, gauss) = math::erf_and_gauss(t);
        *dx = dy * ((1.0 + e) * 0.5 + t * gauss * INV_SQRT_PI);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_and_its_derivative_match_float64() {
        let x: Vec<f32> = (-4000..4000).map(|k| k as f32 * 0.002).collect();
        let dy: Vec<f32> = x.iter().map(|v| 1.0 + 0.1 * v).collect();
        let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        gelu(&x, &mut y);
        gelu_grad(&dy, &x, &mut dx);
        for k in 0..x.len() {
            let v = x[k] as f64;
            let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
            let pdf = (-v * v / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let (want_y, want_dx) = (v * cdf, dy[k] as f64 * (cdf + v * pdf));
            assert!(
                (y[k] as f64 - want_y).abs() < 4e-7 * v.abs().max(1.0),
                "y({v})"
            );
            assert!(
                (dx[k] as f64 - want_dx).abs() < 4e-7 * want_dx.abs().max(1.0),
                "dx({v})"
            );
        }
    }
}
