//! GridSample (`torch.nn.functional.grid_sample`, spatial transformers and deformable
//! attention): 4-D input, bilinear, `zeros` or `border` padding, either `align_corners`.
//! ONNX Runtime's training build has no gradient for it.
//!
//! Each output reads four corners of the input, `Y = sum_k w_k X[idx_k]`, with bilinear
//! weights `w_k` (zero for a corner outside the input). The input's gradient adds
//! `dY w_k` back at each corner (`ScatterElements` with `reduction = add`); the grid's
//! is `dY` times the weights' slopes across the corners' values (PyTorch's
//! `grid_sampler_2d_backward`): `dY/dix = wy0 (v01 - v00) + wy1 (v11 - v10)` and
//! `dY/diy = wx0 (v10 - v00) + wx1 (v11 - v01)`, summed over channels, times
//! `d ix / d gx` (zero where `border` clamps the coordinate).

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::emit::Emitter;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_i, attr_s, int_attr, string_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// One axis of the grid: the pixel coordinate, its corners, their weights and masks.
struct Axis {
    /// `d coordinate / d grid` (a scalar, or a mask times it under `border`).
    slope: String,
    /// The lower and upper corner, as int64 indices clamped into the axis.
    index: [String; 2],
    /// Their bilinear weights, zero where the corner is outside.
    weight: [String; 2],
    /// Their weights alone (for the grid's gradient).
    raw: [String; 2],
    /// Whether each corner is inside, as 0/1.
    inside: [String; 2],
}

pub fn grid_sample(ctx: &mut RuleCtx) -> Result<Grads> {
    let mode = attr_s(ctx.node, "mode").unwrap_or_else(|| "bilinear".into());
    let padding = attr_s(ctx.node, "padding_mode").unwrap_or_else(|| "zeros".into());
    if !matches!(mode.as_str(), "bilinear" | "linear") {
        return Err(ctx.unsupported(format!("mode `{mode}` (bilinear has one)")));
    }
    if !matches!(padding.as_str(), "zeros" | "border") {
        return Err(ctx.unsupported(format!("padding_mode `{padding}`")));
    }
    if ctx.opset < 16 {
        return Err(ctx.unsupported("needs opset 16 or later (scatters with reduction=add)"));
    }
    let (x, grid) = (ctx.input(0).to_string(), ctx.input(1).to_string());
    let (sx, sg) = (shape(ctx, &x)?, shape(ctx, &grid)?);
    if sx.len() != 4 || sg.len() != 4 || sg[3] != 2 {
        return Err(ctx.unsupported(format!("X {sx:?} and grid {sg:?} (4-D only)")));
    }
    let t = dtype(ctx, &x)?;
    let dy = ctx.dy(0)?;
    let align = attr_i(ctx.node, "align_corners").unwrap_or(0) != 0;
    let border = padding == "border";
    let (n, c, h, w) = (sx[0], sx[1], sx[2], sx[3]);
    let (ho, wo) = (sg[1], sg[2]);
    let needs = (ctx.needs(0), ctx.needs(1));
    let mut g = vec![None; ctx.node.input.len()];
    let e = &mut *ctx.e;

    let halves = e.ints(&[1, 1]);
    let parts = e.op_n("Split", &[&grid, &halves], 2, vec![int_attr("axis", 3)]);
    let gx = e.reshape(&parts[0], &[n, 1, ho, wo]);
    let gy = e.reshape(&parts[1], &[n, 1, ho, wo]);
    let ax = axis(e, &gx, w, align, border, t);
    let ay = axis(e, &gy, h, align, border, t);

    // The four corners (y, x): flat indices `[N, C, Ho*Wo]` and weights `[N, 1, Ho, Wo]`.
    let mut idx = Vec::with_capacity(4);
    let mut weights = Vec::with_capacity(4);
    for yi in 0..2 {
        for xi in 0..2 {
            let width = e.constant(Tensor::i64(vec![], vec![w as i64]).expect("a scalar"));
            let row = e.mul(&ay.index[yi], &width);
            let flat = e.op("Add", &[&row, &ax.index[xi]], vec![]);
            let flat = e.reshape(&flat, &[n, 1, ho * wo]);
            let shape = e.ints(&[n as i64, c as i64, (ho * wo) as i64]);
            idx.push(e.op("Expand", &[&flat, &shape], vec![]));
            weights.push(e.mul(&ay.weight[yi], &ax.weight[xi]));
        }
    }
    if needs.0 {
        let updates: Vec<String> = weights
            .iter()
            .map(|wk| {
                let u = e.mul(&dy, wk);
                e.reshape(&u, &[n, c, ho * wo])
            })
            .collect();
        let all_idx = e.concat(&idx, 2);
        let all_upd = e.concat(&updates, 2);
        let zeros = e.zeros(&[n, c, h * w], t);
        let dx = e.op(
            "ScatterElements",
            &[&zeros, &all_idx, &all_upd],
            vec![int_attr("axis", 2), string_attr("reduction", "add")],
        );
        g[0] = Some(e.reshape(&dx, &sx));
    }
    if needs.1 {
        let flat = e.reshape(&x, &[n, c, h * w]);
        let v: Vec<String> = (0..4)
            .map(|k| {
                let read = e.op(
                    "GatherElements",
                    &[&flat, &idx[k]],
                    vec![int_attr("axis", 2)],
                );
                let read = e.reshape(&read, &[n, c, ho, wo]);
                let inside = e.mul(&ay.inside[k / 2], &ax.inside[k % 2]);
                e.mul(&read, &inside)
            })
            .collect();
        // v[k]: k = 2 y + x.
        let across = |e: &mut Emitter, a: usize, b: usize, wgt: &str| {
            let diff = e.op("Sub", &[&v[b], &v[a]], vec![]);
            e.mul(&diff, wgt)
        };
        let dx0 = across(e, 0, 1, &ay.raw[0]);
        let dx1 = across(e, 2, 3, &ay.raw[1]);
        let d_ix = e.op("Add", &[&dx0, &dx1], vec![]);
        let dy0 = across(e, 0, 2, &ax.raw[0]);
        let dy1 = across(e, 1, 3, &ax.raw[1]);
        let d_iy = e.op("Add", &[&dy0, &dy1], vec![]);
        let to_grid = |e: &mut Emitter, d: &str, a: &Axis| {
            let p = e.mul(&dy, d);
            let s = e.reduce_sum(&p, &[1], true);
            let s = e.mul(&s, &a.slope);
            e.reshape(&s, &[n, ho, wo, 1])
        };
        let gx_grad = to_grid(e, &d_ix, &ax);
        let gy_grad = to_grid(e, &d_iy, &ay);
        g[1] = Some(e.concat(&[gx_grad, gy_grad], 3));
    }
    Ok(g)
}

/// One axis of `size` pixels read at grid values `g`: `i = a g + (size - 1) / 2` with
/// `a = (size - 1) / 2` (`align_corners`) or `size / 2`, clamped into the axis under
/// `border`; its corners `floor(i)` and `floor(i) + 1`.
fn axis(e: &mut Emitter, g: &str, size: usize, align: bool, border: bool, t: DType) -> Axis {
    let last = size as f64 - 1.0;
    let a = if align { last / 2.0 } else { size as f64 / 2.0 };
    let scaled = e.scale(g, a, t);
    let half = e.scalar(last / 2.0, t);
    let mut i = e.op("Add", &[&scaled, &half], vec![]);
    let (zero, top) = (e.scalar(0.0, t), e.scalar(last, t));
    let mut slope = e.scalar(a, t);
    if border {
        // PyTorch's clip_coordinates_set_grad: no gradient where the clamp holds it.
        let above = e.op("Greater", &[&i, &zero], vec![]);
        let below = e.op("Less", &[&i, &top], vec![]);
        let within = e.op("And", &[&above, &below], vec![]);
        let within = e.op("Cast", &[&within], vec![int_attr("to", t.onnx() as i64)]);
        slope = e.mul(&within, &slope);
        i = e.op("Clip", &[&i, &zero, &top], vec![]);
    }
    let lo = e.op("Floor", &[&i], vec![]);
    let one = e.scalar(1.0, t);
    let hi = e.op("Add", &[&lo, &one], vec![]);
    let w_hi = e.op("Sub", &[&i, &lo], vec![]);
    let w_lo = e.op("Sub", &[&one, &w_hi], vec![]);
    let corner = |e: &mut Emitter, p: &str| {
        let ge = e.op("GreaterOrEqual", &[p, &zero], vec![]);
        let le = e.op("LessOrEqual", &[p, &top], vec![]);
        let ok = e.op("And", &[&ge, &le], vec![]);
        let ok = e.op("Cast", &[&ok], vec![int_attr("to", t.onnx() as i64)]);
        let clamped = e.op("Clip", &[p, &zero, &top], vec![]);
        let index = e.op(
            "Cast",
            &[&clamped],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        );
        (ok, index)
    };
    let (in_lo, i_lo) = corner(e, &lo);
    let (in_hi, i_hi) = corner(e, &hi);
    let weight = [e.mul(&w_lo, &in_lo), e.mul(&w_hi, &in_hi)];
    Axis {
        slope,
        index: [i_lo, i_hi],
        weight,
        raw: [w_lo, w_hi],
        inside: [in_lo, in_hi],
    }
}
