//! Fused CPU kernels registered with ONNX Runtime as custom operators of pipetrain's
//! domain (`graph::custom_ops`), for what stock ONNX Runtime runs as many small kernels:
//! one module per kernel family, `math` for the vectorizable `exp` they share.
//!
//! Written here because no crate offers ONNX Runtime kernels; vectorized for the machine
//! it runs on (`multiversion`), as the Adam loop is, and cut into a fixed number of
//! blocks for ONNX Runtime's intra-op threads, so that results do not depend on the
//! thread count.

mod accumulate;
mod activation;
mod attention;
mod cross_entropy;
mod depthwise;
mod dropout;
mod layer_norm;
mod math;
mod pointwise;
mod product;
mod rows_add;
mod softmax;
mod tanh_gelu;

use std::sync::Mutex;

use ort::operator::ComputeContext;
use ort::value::{ValueRef, ValueRefMut};

pub(crate) use accumulate::Accumulate;
pub(crate) use activation::{Gelu, RELU_GRAD_OP};
#[cfg(any(test, feature = "cuda"))]
pub(crate) use attention::View;
pub(crate) use attention::{
    attention_scratch, ATTENTION_GRAD_OP, ATTENTION_OP, PACKED_ATTENTION_GRAD_OP,
    PACKED_ATTENTION_OP,
};
#[cfg(feature = "cuda")]
pub(crate) use attention::{
    mask_strides as attention_mask_strides, views as attention_views,
    Attributes as AttentionAttributes,
};
pub(crate) use cross_entropy::{SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad};
pub(crate) use depthwise::{DepthwiseConv, DepthwiseConvGrad};
pub(crate) use dropout::KeyedDropout;
#[cfg(test)]
pub(crate) use dropout::{base as keyed_dropout_base, Draw as KeyedDraw};
#[cfg(feature = "cuda")]
pub(crate) use dropout::{inputs as keyed_dropout_inputs, outputs as keyed_dropout_outputs};
pub(crate) use layer_norm::LayerNormGrad;
pub(crate) use product::BlasMatMul;
pub(crate) use rows_add::RowsAdd;
#[cfg(feature = "cuda")]
pub(crate) use rows_add::{inputs as rows_add_inputs, rows_attribute};
pub(crate) use softmax::{SOFTMAX_GRAD_OP, SOFTMAX_OP};
#[cfg(feature = "cuda")]
pub(crate) use tanh_gelu::constants as tanh_gelu_constants;
pub(crate) use tanh_gelu::TanhGelu;

/// Blocks a kernel call is cut into for ONNX Runtime's intra-op threads: fixed, so that
/// sums over blocks (in block order) do not depend on the threads.
const BLOCKS: usize = 4;

/// Eight independent lanes: what vectorizes (a single running sum cannot be reordered).
const LANES: usize = 8;

/// Input `i` of `op`'s call, an error naming both where it is missing.
fn input<'a>(ctx: &'a ComputeContext, op: &str, i: usize) -> ort::Result<ValueRef<'a>> {
    ctx.input(i)?
        .ok_or_else(|| ort::Error::new(format!("{op}: no input {i}")))
}

/// Output `i` of `op`'s call, made with `shape`; an error naming both where the call has
/// no such output.
fn output<'a>(
    ctx: &'a ComputeContext,
    op: &str,
    i: usize,
    shape: &[i64],
) -> ort::Result<ValueRefMut<'a>> {
    ctx.output(i, shape.to_vec())?
        .ok_or_else(|| ort::Error::new(format!("{op}: no output {i}")))
}

/// `f(offset, block)` over [`BLOCKS`] blocks of `out` (block lengths multiples of
/// `unit`, the row length), on ONNX Runtime's intra-op threads.
fn par_blocks(
    ctx: &ComputeContext,
    out: &mut [f32],
    unit: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> ort::Result<()> {
    let unit = unit.max(1);
    let per = (out.len() / unit).div_ceil(BLOCKS).max(1) * unit;
    let blocks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per).map(Mutex::new).collect();
    ctx.par_for(blocks.len(), blocks.len(), |b| {
        if let Ok(mut block) = blocks[b].lock() {
            f(b * per, &mut block);
        }
    })
}

/// [`par_blocks`] over two outputs of one length, cut at the same places:
/// `f(offset, a's block, b's block)`.
fn par_block_pairs(
    ctx: &ComputeContext,
    (a, b): (&mut [f32], &mut [f32]),
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
) -> ort::Result<()> {
    let per = a.len().div_ceil(BLOCKS).max(1);
    let blocks: Vec<Mutex<(&mut [f32], &mut [f32])>> = a
        .chunks_mut(per)
        .zip(b.chunks_mut(per))
        .map(Mutex::new)
        .collect();
    ctx.par_for(blocks.len(), blocks.len(), |i| {
        if let Ok(mut block) = blocks[i].lock() {
            let (a, b) = &mut *block;
            f(i * per, a, b);
        }
    })
}

/// The sum of `v` in [`LANES`] partial sums (which vectorizes), then across them.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn lane_sum(v: &[f32]) -> f32 {
    let mut s = [0f32; LANES];
    let whole = v.len() / LANES * LANES;
    for c in v[..whole].chunks_exact(LANES) {
        for l in 0..LANES {
            s[l] += c[l];
        }
    }
    v[whole..].iter().fold(s.iter().sum::<f32>(), |a, b| a + b)
}
