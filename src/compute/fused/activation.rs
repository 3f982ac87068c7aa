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

use super::math;
use super::pointwise::Pointwise;
use crate::graph::custom_ops::{GELU_FROM_ERF, GELU_GRAD, RELU_GRAD};

/// `ln(1 / sqrt pi)`: `exp(C - t^2) = exp(-t^2) / sqrt pi`.
const C: f32 = -0.572_364_9;

/// ReLU's backward as one kernel.
pub(crate) const RELU_GRAD_OP: Pointwise = Pointwise {
    name: RELU_GRAD,
    inputs: 2,
    rows: false,
    block: |i, dx, _| relu_grad(i[0], i[1], dx),
};

/// The end of GELU as one kernel (`T`, input 1, is read by the backward only).
pub(crate) const GELU_FROM_ERF_OP: Pointwise = Pointwise {
    name: GELU_FROM_ERF,
    inputs: 3,
    rows: false,
    block: |i, y, _| gelu_from_erf(i[0], i[2], y),
};

/// GELU's backward as one kernel.
pub(crate) const GELU_GRAD_OP: Pointwise = Pointwise {
    name: GELU_GRAD,
    inputs: 3,
    rows: false,
    block: |i, dx, _| gelu_grad(i[0], i[1], i[2], dx),
};

/// `dx = x > 0 ? dy : 0`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn relu_grad(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = if x > 0.0 { dy } else { 0.0 };
    }
}

/// `y = (x * (e + 1)) * 0.5`, elementwise: the exported form's three nodes.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_from_erf(x: &[f32], e: &[f32], y: &mut [f32]) {
    for ((y, &x), &e) in y.iter_mut().zip(x).zip(e) {
        *y = (x * (e + 1.0)) * 0.5;
    }
}

/// `dx = dy * ((e + 1) * 0.5 + t * exp(C - t * t))`, elementwise.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn gelu_grad(dy: &[f32], t: &[f32], e: &[f32], dx: &mut [f32]) {
    for (((dx, &dy), &t), &e) in dx.iter_mut().zip(dy).zip(t).zip(e) {
        *dx = dy * ((e + 1.0) * 0.5 + t * math::exp(C - t * t));
    }
}
