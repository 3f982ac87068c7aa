//! GPT-2's tanh GELU (`TanhGelu`: `X` in, `Y` out) and its backward (`TanhGeluGrad`:
//! `dY, X` in, `dX` out), attributes `scale` and `coef`, float32, on the CPU: the
//! formulas of `graph::tanh_gelu` and `graph::tanh_gelu_slope`, elementwise, with a
//! `tanh` that vectorizes ([`math::tanh`]). One pass each where the exported form is
//! eight forward and about fifteen backward kernels (`graph::fusion::fuse_tanh_gelu`,
//! with `runtime.fused_kernels`); a graph built for a GPU holds them too, and its CUDA
//! kernels are `compute/cuda_fused.rs`.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, math, output, par_blocks};
use crate::graph::custom_ops::{TANH_GELU, TANH_GELU_GRAD};

/// `TanhGelu` (`grad` false) or `TanhGeluGrad`.
#[derive(Clone, Copy)]
pub(crate) struct TanhGelu {
    pub grad: bool,
}

/// The attributes `scale` and `coef` of a `TanhGelu` or `TanhGeluGrad` node.
pub(crate) fn constants(info: &KernelContext<'_>, op: &str) -> ort::Result<(f32, f32)> {
    match (info.get::<f32>("scale"), info.get::<f32>("coef")) {
        (Some(s), Some(c)) if s.is_finite() && c.is_finite() => Ok((s, c)),
        (s, c) => Err(ort::Error::new(format!(
            "{op}: attributes scale {s:?} and coef {c:?} (finite numbers)"
        ))),
    }
}

impl Operator for TanhGelu {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        if self.grad {
            TANH_GELU_GRAD
        } else {
            TANH_GELU
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let n = if self.grad { 2 } else { 1 };
        (0..n).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let (op, grad) = (self.name().to_string(), self.grad);
        let (scale, coef) = constants(info, &op)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let x = input(ctx, &op, usize::from(grad))?;
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let dy = match grad {
                true => Some(input(ctx, &op, 0)?),
                false => None,
            };
            let dy = dy
                .as_ref()
                .map(|v| v.try_extract_tensor::<f32>())
                .transpose()?;
            if dy.is_some_and(|(_, d)| d.len() != x.len()) {
                return Err(ort::Error::new(format!(
                    "{op}: dY and X of different lengths"
                )));
            }
            let mut out = output(ctx, &op, 0, shape)?;
            let (_, out) = out.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, out, 1, |at, out| {
                let xs = &x[at..at + out.len()];
                match dy {
                    Some((_, dy)) => backward(&dy[at..at + out.len()], xs, scale, coef, out),
                    None => forward(xs, scale, coef, out),
                }
            })
        }))
    }
}

/// `y = 0.5 x (1 + tanh(scale (x + coef x^3)))`, elementwise, with the vectorizing
/// [`math::tanh`].
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn forward(x: &[f32], scale: f32, coef: f32, y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let t = math::tanh(scale * (x + coef * (x * x * x)));
        *y = 0.5 * x * (1.0 + t);
    }
}

/// `dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) scale (1 + 3 coef x^2))`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn backward(dy: &[f32], x: &[f32], scale: f32, coef: f32, dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        let x2 = x * x;
        let t = math::tanh(scale * (x + coef * (x2 * x)));
        *dx = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * scale * (1.0 + 3.0 * coef * x2));
    }
}
