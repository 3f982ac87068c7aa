//! Pooling, and the window geometry that convolutions (`conv.rs`) share.
//!
//! Shapes are static, so the window geometry (explicit pads for `auto_pad`, the
//! `output_padding` that gives a ConvTranspose exactly the input's size, AveragePool's
//! divisors) is computed here, and checked against the forward output's measured shape.
//! The math is that of ONNX Runtime's orttraining gradient builder; where it calls
//! training-only kernels (MaxPoolGrad, AveragePoolGrad) the same sums are written here in
//! standard ops: a scatter-add over the Indices output for MaxPool. GlobalAveragePool's is
//! the builder's own (scale, then Expand).

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_ints, attr_s, int_attr, ints_attr, string_attr, tensor_attr};
use crate::tensor::{DType, Tensor, TensorData};
use crate::Result;

/// The window geometry of one spatial axis, pads made explicit.
#[derive(Debug, Clone, Copy)]
pub(super) struct Axis {
    pub(super) input: usize,
    pub(super) kernel: usize,
    pub(super) stride: usize,
    pub(super) dilation: usize,
    pub(super) begin: usize,
    pub(super) end: usize,
    pub(super) output: usize,
}

impl Axis {
    /// The span of one (dilated) window.
    fn extent(&self) -> usize {
        (self.kernel - 1) * self.dilation + 1
    }

    /// The input length with its pads.
    pub(super) fn padded(&self) -> usize {
        self.input + self.begin + self.end
    }

    /// The `output_padding` that makes a ConvTranspose undoing this window walk produce
    /// exactly `input` elements: the trailing elements no window reached (in [0, stride)).
    pub(super) fn output_padding(&self) -> i64 {
        (self.padded() - self.extent() - self.stride * (self.output - 1)) as i64
    }

    /// AveragePool's divisor for window `o` along this axis: the kernel size, or with
    /// `count_include_pad=0` how many of the window's elements lie in the input.
    fn count(&self, o: usize, include_pad: bool) -> usize {
        if include_pad {
            return self.kernel;
        }
        (0..self.kernel)
            .map(|j| o * self.stride + j * self.dilation)
            .filter(|&p| p >= self.begin && p < self.begin + self.input)
            .count()
    }
}

/// An integer-list attribute of one entry per spatial axis (`per_axis` entries), each at
/// least `min`, or `default` on every axis when absent.
fn axis_attr(
    ctx: &RuleCtx,
    name: &str,
    per_axis: usize,
    default: usize,
    min: i64,
) -> Result<Vec<usize>> {
    let Some(v) = attr_ints(ctx.node, name) else {
        return Ok(vec![default; per_axis]);
    };
    if v.len() != per_axis || v.iter().any(|&x| x < min) {
        return Err(ctx.unsupported(format!(
            "{name}={v:?} (expected {per_axis} values of at least {min})"
        )));
    }
    Ok(v.into_iter().map(|x| x as usize).collect())
}

/// The geometry of every spatial axis of a window op with input shape `x`, kernel
/// `kernel` and measured output shape `y`.
pub(super) fn geometry(
    ctx: &RuleCtx,
    x: &[usize],
    kernel: &[usize],
    y: &[usize],
) -> Result<Vec<Axis>> {
    let r = kernel.len();
    if r == 0 || x.len() != r + 2 || y.len() != r + 2 {
        return Err(ctx.unsupported(format!(
            "input rank {} and output rank {} do not fit a kernel of rank {r}",
            x.len(),
            y.len()
        )));
    }
    let strides = axis_attr(ctx, "strides", r, 1, 1)?;
    let dilations = axis_attr(ctx, "dilations", r, 1, 1)?;
    let pads = axis_attr(ctx, "pads", 2 * r, 0, 0)?;
    let auto_pad = attr_s(ctx.node, "auto_pad").unwrap_or_else(|| "NOTSET".into());
    let mut axes = Vec::with_capacity(r);
    for i in 0..r {
        let mut a = Axis {
            input: x[i + 2],
            kernel: kernel[i],
            stride: strides[i],
            dilation: dilations[i],
            begin: pads[i],
            end: pads[i + r],
            output: y[i + 2],
        };
        if a.kernel == 0 {
            return Err(ctx.unsupported(format!("an empty kernel on spatial axis {i}")));
        }
        match auto_pad.as_str() {
            "NOTSET" | "" => {}
            "VALID" => (a.begin, a.end) = (0, 0),
            // ONNX: the output is ceil(input / stride), the odd pad going at the end
            // (SAME_UPPER) or at the start (SAME_LOWER).
            "SAME_UPPER" | "SAME_LOWER" => {
                let out = a.input.div_ceil(a.stride);
                let total = ((out.max(1) - 1) * a.stride + a.extent()).saturating_sub(a.input);
                let (small, large) = (total / 2, total - total / 2);
                (a.begin, a.end) = if auto_pad == "SAME_UPPER" {
                    (small, large)
                } else {
                    (large, small)
                };
            }
            other => return Err(ctx.unsupported(format!("auto_pad=\"{other}\""))),
        }
        let floor_out =
            (a.padded() >= a.extent()).then(|| (a.padded() - a.extent()) / a.stride + 1);
        if floor_out != Some(a.output) {
            // ceil_mode=1 lets a last, partial window hang past the pads; only the case
            // where it adds no window (then it is plain floor mode) is handled.
            let why = if attr_i(ctx.node, "ceil_mode").unwrap_or(0) != 0 {
                "ceil_mode=1 where it adds a partial window"
            } else {
                "attributes that do not give the measured output size"
            };
            return Err(ctx.unsupported(format!(
                "{why} (spatial axis {i}: output {}, expected {floor_out:?})",
                a.output
            )));
        }
        axes.push(a);
    }
    Ok(axes)
}

/// A pooling node's `kernel_shape`, every entry at least 1.
pub(super) fn kernel_shape(ctx: &RuleCtx) -> Result<Vec<usize>> {
    let Some(kernel) = attr_ints(ctx.node, "kernel_shape") else {
        return Err(ctx.unsupported("no kernel_shape"));
    };
    if kernel.iter().any(|&k| k < 1) {
        return Err(ctx.unsupported(format!("kernel_shape={kernel:?}")));
    }
    Ok(kernel.into_iter().map(|k| k as usize).collect())
}

/// `[begin..., end...]` pads of the axes.
pub(super) fn pads_of(axes: &[Axis]) -> Vec<i64> {
    let begins = axes.iter().map(|a| a.begin as i64);
    begins.chain(axes.iter().map(|a| a.end as i64)).collect()
}

/// One integer per axis.
pub(super) fn ints_of(axes: &[Axis], f: impl Fn(&Axis) -> usize) -> Vec<i64> {
    axes.iter().map(|a| f(a) as i64).collect()
}

/// A float tensor of `t` (F32 or F64; gradients flow only through those).
fn float_tensor(t: DType, shape: Vec<usize>, v: Vec<f64>) -> Tensor {
    let data = match t {
        DType::F64 => TensorData::F64(v),
        _ => TensorData::F32(v.into_iter().map(|x| x as f32).collect()),
    };
    Tensor { shape, data }
}

/// The ConvTranspose that is the adjoint of a window walk over `axes` (the Conv or pool
/// reading X), so its output has X's spatial size exactly.
pub(super) fn transpose_walk(
    ctx: &mut RuleCtx,
    g: &str,
    w: &str,
    axes: &[Axis],
    group: i64,
) -> String {
    ctx.e.op(
        "ConvTranspose",
        &[g, w],
        vec![
            ints_attr("strides", &ints_of(axes, |a| a.stride)),
            ints_attr("dilations", &ints_of(axes, |a| a.dilation)),
            ints_attr("pads", &pads_of(axes)),
            ints_attr(
                "output_padding",
                &axes.iter().map(Axis::output_padding).collect::<Vec<_>>(),
            ),
            int_attr("group", group),
        ],
    )
}

pub fn max_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    if attr_i(ctx.node, "storage_order").unwrap_or(0) != 0 {
        return Err(ctx.unsupported("storage_order=1 (column-major Indices)"));
    }
    let indices = ctx.output(1).to_string();
    if indices.is_empty() {
        return Err(
            ctx.unsupported("the Indices output is needed (the training-graph builder adds it)")
        );
    }
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let ny = ctx.meta(ctx.output(0))?.numel();
    let reduction = if ctx.opset >= 16 {
        vec![string_attr("reduction", "add")]
    } else if disjoint_windows(ctx)? {
        // No input element is in two windows, so no index repeats: a plain scatter adds.
        vec![]
    } else {
        return Err(ctx.unsupported(
            "overlapping windows (kernel_shape/strides/dilations) need opset 16 or later \
             (ScatterElements with reduction=add)",
        ));
    };
    // ONNX Runtime's Indices address the whole flattened X, batch and channel included,
    // so one scatter into flat X adds each dY element onto its window's maximum.
    let numel: usize = sx.iter().product();
    let dims = ctx.e.ints(&[numel as i64]);
    let value = Tensor::zeros(t, vec![1]).to_proto("value");
    let zeros = ctx.e.op(
        "ConstantOfShape",
        &[&dims],
        vec![tensor_attr("value", value)],
    );
    let flat_idx = ctx.e.reshape(&indices, &[ny]);
    let flat_dy = ctx.e.reshape(&dy, &[ny]);
    let mut attrs = vec![int_attr("axis", 0)];
    attrs.extend(reduction);
    let scattered = ctx
        .e
        .op("ScatterElements", &[&zeros, &flat_idx, &flat_dy], attrs);
    Ok(vec![Some(ctx.e.reshape(&scattered, &sx))])
}

/// Whether MaxPool's windows never share an input element (stride >= window span).
fn disjoint_windows(ctx: &RuleCtx) -> Result<bool> {
    let Some(kernel) = attr_ints(ctx.node, "kernel_shape") else {
        return Err(ctx.unsupported("no kernel_shape"));
    };
    let r = kernel.len();
    let strides = axis_attr(ctx, "strides", r, 1, 1)?;
    let dilations = axis_attr(ctx, "dilations", r, 1, 1)?;
    Ok((0..r).all(|i| {
        let span = kernel[i]
            .saturating_sub(1)
            .saturating_mul(dilations[i] as i64);
        strides[i] as i64 > span
    }))
}

/// What the gradient of a pool over windows (AveragePool, LpPool) reads of its node:
/// X, its shape and Y's, X's type, the kernel and each spatial axis's windows.
pub(super) struct Windows {
    pub x: String,
    pub sx: Vec<usize>,
    pub sy: Vec<usize>,
    pub t: DType,
    pub kernel: Vec<usize>,
    pub axes: Vec<Axis>,
}

/// The node's [`Windows`].
pub(super) fn windows(ctx: &RuleCtx) -> Result<Windows> {
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let sy = shape(ctx, ctx.output(0))?;
    let t = dtype(ctx, &x)?;
    let kernel = kernel_shape(ctx)?;
    let axes = geometry(ctx, &sx, &kernel, &sy)?;
    Ok(Windows {
        x,
        sx,
        sy,
        t,
        kernel,
        axes,
    })
}

pub fn average_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let w = windows(ctx)?;
    let (sx, axes, t) = (&w.sx, &w.axes, w.t);
    let include_pad = attr_i(ctx.node, "count_include_pad").unwrap_or(0) != 0;

    // Each output's share is dY / (its window's count). Windows are boxes, so the count
    // is a product of per-axis counts: one scalar for the axes where it is the same
    // everywhere, one broadcast vector per axis where pads make it vary.
    let rank = sx.len();
    let mut uniform = 1.0;
    let mut share = dy;
    for (i, a) in axes.iter().enumerate() {
        let counts: Vec<usize> = (0..a.output).map(|o| a.count(o, include_pad)).collect();
        if counts.iter().all(|&k| k == counts[0]) {
            uniform *= counts[0] as f64;
            continue;
        }
        // A window wholly in the pads reads no input: nothing to send back.
        let recip = counts
            .iter()
            .map(|&k| if k == 0 { 0.0 } else { 1.0 / k as f64 })
            .collect();
        let mut dims = vec![1; rank];
        dims[i + 2] = a.output;
        let r = ctx.e.constant(float_tensor(t, dims, recip));
        share = ctx.e.mul(&share, &r);
    }
    let share = ctx
        .e
        .scale(&share, if uniform > 0.0 { 1.0 / uniform } else { 0.0 }, t);

    Ok(vec![Some(spread(ctx, &share, &w))])
}

/// Each output's `share` added to every input of its window: ConvTranspose by an
/// all-ones kernel, with every (batch, channel) plane as its own one-channel image.
pub(super) fn spread(ctx: &mut RuleCtx, share: &str, w: &Windows) -> String {
    let (sx, sy, kernel, axes, t) = (&w.sx, &w.sy, &w.kernel, &w.axes, w.t);
    let (n, c) = (sx[0], sx[1]);
    let mut planes = vec![n * c, 1];
    planes.extend(&sy[2..]);
    let flat = ctx.e.reshape(share, &planes);
    let mut kdims = vec![1, 1];
    kdims.extend(kernel);
    let count = kernel.iter().product();
    let ones = ctx.e.constant(float_tensor(t, kdims, vec![1.0; count]));
    let spread = transpose_walk(ctx, &flat, &ones, axes, 1);
    ctx.e.reshape(&spread, sx)
}

pub fn global_average_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    if sx.len() < 3 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (no spatial axes)")));
    }
    let count: usize = sx[2..].iter().product();
    if count == 0 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (empty spatial axes)")));
    }
    let share = ctx.e.scale(&dy, 1.0 / count as f64, t);
    let dims = ctx
        .e
        .ints(&sx.iter().map(|&d| d as i64).collect::<Vec<_>>());
    Ok(vec![Some(ctx.e.op("Expand", &[&share, &dims], vec![]))])
}

/// GlobalMaxPool: `dY` shared evenly among each plane's positions equal to its maximum
/// (as ReduceMax over the spatial axes).
pub fn global_max_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let (x, y) = (ctx.input(0).to_string(), ctx.output(0).to_string());
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    if sx.len() < 3 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} (no spatial axes)")));
    }
    let hit = ctx.e.op("Equal", &[&x, &y], vec![]);
    let hit = ctx
        .e
        .op("Cast", &[&hit], vec![int_attr("to", t.onnx() as i64)]);
    let spatial: Vec<i64> = (2..sx.len() as i64).collect();
    let count = ctx.e.reduce_sum(&hit, &spatial, true);
    let share = ctx.e.op("Div", &[&dy, &count], vec![]);
    Ok(vec![Some(ctx.e.mul(&hit, &share))])
}
