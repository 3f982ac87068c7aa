//! Depthwise 2-D convolution (`Conv` with one filter per channel, `group` = channels),
//! forward and backward, float32, NCHW.
//!
//! Stock ONNX Runtime runs a grouped `Conv` as one small matrix product per channel
//! (expanding each channel's windows first), and its gradient as a `ConvTranspose` and
//! a batch/channel-swapped `Conv` of the same kind: on ConvNeXt's 7x7 depthwise layers
//! these three kernels were a third of the step.
//!
//! Here each channel plane is copied once into a zero-padded scratch plane. At that
//! plane's row pitch every kernel tap is one shift of the whole plane, so the stride-1
//! output is the sum over taps of the shifted plane times the tap's weight, 64 outputs
//! at a time in vector registers ([`plane::correlate`](plane)); strided outputs are picked from
//! it (a stride-2 layer computes four times the outputs it keeps). The backward spreads
//! `dY` onto the stride-1 output's places; `dX` is then the same correlation with the
//! kernel turned around, and `dW` each tap's dot product of the spread `dY` with the
//! shifted padded `X`.
//!
//! `DepthwiseConv(X, W[, B])`: each output sums its taps in kernel order (rows, then
//! columns) with fused multiply-adds and adds the bias last, as a product of the
//! expanded windows by the filter does (on the tests' undilated layers, the same loss
//! as ONNX Runtime's `Conv`, bit for bit). `DepthwiseConvGrad(dY, X, W)`: `dX`, `dW` and
//! `dB` in one pass over the planes; `dW` and `dB` are summed per plane, then over the
//! batch in batch order, so results do not depend on the thread count.
//!
//! Attributes (ONNX `Conv`'s): `strides`, `pads` (begin then end), `dilations`, two
//! spatial axes; `auto_pad` is not read (the fusion pass only rewrites explicit pads).

use std::sync::Mutex;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

mod plane;

use super::{input, output, par_blocks, BLOCKS};
use crate::graph::custom_ops::{DEPTHWISE_CONV, DEPTHWISE_CONV_GRAD};
use plane::{backward_plane, forward_plane, reduce_shares, Geometry, Scratch};

/// The attributes of a call (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Attributes {
    strides: [usize; 2],
    pads: [usize; 4],
    dilations: [usize; 2],
}

impl Attributes {
    fn of(info: &KernelContext<'_>, op: &str) -> ort::Result<Self> {
        let read = |name: &str, len: usize, default: usize| -> ort::Result<Vec<usize>> {
            let v = info
                .get::<Vec<i64>>(name)
                .unwrap_or_else(|| vec![default as i64; len]);
            let ok = v.len() == len && v.iter().all(|&x| x >= 0 && (default == 0 || x > 0));
            if !ok {
                return Err(ort::Error::new(format!(
                    "{op}: attribute {name} = {v:?} (want {len} values, {})",
                    if default == 0 { ">= 0" } else { "> 0" }
                )));
            }
            Ok(v.into_iter().map(|x| x as usize).collect())
        };
        let (s, p, d) = (
            read("strides", 2, 1)?,
            read("pads", 4, 0)?,
            read("dilations", 2, 1)?,
        );
        Ok(Self {
            strides: [s[0], s[1]],
            pads: [p[0], p[1], p[2], p[3]],
            dilations: [d[0], d[1]],
        })
    }

    /// The walk for input `x` (`[N, C, H, W]`) and filter `w` (`[C, 1, KH, KW]`).
    fn geometry(&self, op: &str, x: &[i64], w: &[i64]) -> ort::Result<Geometry> {
        let dims = |s: &[i64]| s.iter().map(|&d| d.max(0) as usize).collect::<Vec<_>>();
        let (x, w) = (dims(x), dims(w));
        if x.len() != 4 || w.len() != 4 || w[0] != x[1] || w[1] != 1 {
            return Err(ort::Error::new(format!(
                "{op}: X of shape {x:?} with W of shape {w:?} (want [N, C, H, W] and [C, 1, KH, KW])"
            )));
        }
        let out = |axis: usize| {
            let span = self.dilations[axis] * (w[2 + axis].max(1) - 1) + 1;
            let padded = x[2 + axis] + self.pads[axis] + self.pads[2 + axis];
            (padded >= span).then(|| (padded - span) / self.strides[axis] + 1)
        };
        let (Some(oh), Some(ow)) = (out(0), out(1)) else {
            return Err(ort::Error::new(format!(
                "{op}: a {}x{} kernel does not fit the padded {}x{} input",
                w[2], w[3], x[2], x[3]
            )));
        };
        Ok(Geometry {
            n: x[0],
            c: x[1],
            input: (x[2], x[3]),
            kernel: (w[2], w[3]),
            output: (oh, ow),
            stride: (self.strides[0], self.strides[1]),
            dilation: (self.dilations[0], self.dilations[1]),
            pad: (self.pads[0], self.pads[1]),
            pad_end: (self.pads[2], self.pads[3]),
        })
    }
}

/// The forward over all planes, in [`BLOCKS`] blocks of planes on ONNX Runtime's threads.
fn forward(
    ctx: &ComputeContext,
    g: &Geometry,
    (x, w, b): (&[f32], &[f32], Option<&[f32]>),
    y: &mut [f32],
) -> ort::Result<()> {
    let (ip, op, t) = (g.in_plane(), g.out_plane().max(1), g.taps());
    par_blocks(ctx, y, op, |at, y| {
        let mut scratch = Scratch::new(g, false);
        for (i, y) in y.chunks_exact_mut(op).enumerate() {
            let p = at / op + i;
            let c = p % g.c;
            let bias = b.map_or(0.0, |b| b[c]);
            let plane = (&x[p * ip..(p + 1) * ip], &w[c * t..(c + 1) * t], bias);
            forward_plane(g, plane, &mut scratch, y);
        }
    })
}

/// The backward over all planes (blocks of planes as [`forward`]), then `dW` and `dB`
/// summed over the batch in batch order.
fn backward(
    ctx: &ComputeContext,
    g: &Geometry,
    (dy, x, w): (&[f32], &[f32], &[f32]),
    (dx, dw, db): (&mut [f32], &mut [f32], &mut [f32]),
) -> ort::Result<()> {
    let (ip, op, t) = (g.in_plane().max(1), g.out_plane(), g.taps());
    let planes = g.n * g.c;
    let per = planes.div_ceil(BLOCKS).max(1);
    let sl = t + 1;
    let mut shares = vec![0f32; planes * sl];
    let blocks: Vec<Mutex<(&mut [f32], &mut [f32])>> = dx
        .chunks_mut(per * ip)
        .zip(shares.chunks_mut(per * sl))
        .map(Mutex::new)
        .collect();
    ctx.par_for(blocks.len(), blocks.len(), |b| {
        let Ok(mut block) = blocks[b].lock() else {
            return;
        };
        let (dx, shares) = &mut *block;
        let mut scratch = Scratch::new(g, true);
        let planes = dx.chunks_exact_mut(ip).zip(shares.chunks_exact_mut(sl));
        for (i, (dx, share)) in planes.enumerate() {
            let p = b * per + i;
            let c = p % g.c;
            let (dy, x) = (&dy[p * op..(p + 1) * op], &x[p * ip..(p + 1) * ip]);
            let w = &w[c * t..(c + 1) * t];
            backward_plane(g, (dy, x, w), &mut scratch, dx, share);
        }
    })?;
    drop(blocks);
    reduce_shares(g, &shares, dw, db);
    Ok(())
}

/// Depthwise convolution (forward) as one kernel.
pub(crate) struct DepthwiseConv;

impl Operator for DepthwiseConv {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        DEPTHWISE_CONV
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::optional(TensorElementType::Float32),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        const OP: &str = DEPTHWISE_CONV;
        let attrs = Attributes::of(info, OP)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let (x, w) = (input(ctx, OP, 0)?, input(ctx, OP, 1)?);
            let (sx, x) = x.try_extract_tensor::<f32>()?;
            let (sw, w) = w.try_extract_tensor::<f32>()?;
            let g = attrs.geometry(OP, sx, sw)?;
            let b = ctx.input(2)?;
            let b = match &b {
                Some(b) => Some(b.try_extract_tensor::<f32>()?.1),
                None => None,
            };
            if b.is_some_and(|b| b.len() != g.c) {
                return Err(ort::Error::new(format!(
                    "{OP}: B is not one value per channel"
                )));
            }
            let shape = [g.n, g.c, g.output.0, g.output.1].map(|d| d as i64);
            let mut y = output(ctx, OP, 0, &shape)?;
            let (_, y) = y.try_extract_tensor_mut::<f32>()?;
            forward(ctx, &g, (x, w, b), y)
        }))
    }
}

/// Depthwise convolution's backward as one kernel: `dY, X, W` in, `dX, dW, dB` out.
pub(crate) struct DepthwiseConvGrad;

impl Operator for DepthwiseConvGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        DEPTHWISE_CONV_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..3).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..3).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        const OP: &str = DEPTHWISE_CONV_GRAD;
        let attrs = Attributes::of(info, OP)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let (dy, x, w) = (input(ctx, OP, 0)?, input(ctx, OP, 1)?, input(ctx, OP, 2)?);
            let (sx, x) = x.try_extract_tensor::<f32>()?;
            let (sw, w) = w.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            let g = attrs.geometry(OP, sx, sw)?;
            if dy.len() != g.n * g.c * g.out_plane() {
                return Err(ort::Error::new(format!(
                    "{OP}: dY of {} values for an output of shape [{}, {}, {}, {}]",
                    dy.len(),
                    g.n,
                    g.c,
                    g.output.0,
                    g.output.1
                )));
            }
            let (mut dx, mut dw) = (output(ctx, OP, 0, sx)?, output(ctx, OP, 1, sw)?);
            let mut db = output(ctx, OP, 2, &[g.c as i64])?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            let (_, dw) = dw.try_extract_tensor_mut::<f32>()?;
            let (_, db) = db.try_extract_tensor_mut::<f32>()?;
            backward(ctx, &g, (dy, x, w), (dx, dw, db))
        }))
    }
}
