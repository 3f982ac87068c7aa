//! LRN, local response normalization across channels (AlexNet's, GoogLeNet's):
//! `y = x d^-beta` with `d = bias + alpha / size * sum_window x^2`, the window the
//! channels `[c - floor((size-1)/2), c + ceil((size-1)/2)]`. Its gradient,
//! `dX = dY d^-beta - 2 alpha beta / size * x * sum_window' (dY x d^(-beta-1))`, sums
//! over the transposed window: the channels whose window holds `c`. ONNX Runtime's
//! training build has no gradient for it.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_f, attr_i};
use crate::Result;

pub fn lrn(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let t = dtype(ctx, &x)?;
    let size = attr_i(ctx.node, "size").unwrap_or(0);
    if size < 1 || sx.len() < 2 {
        return Err(ctx.unsupported(format!("size {size} over X of shape {sx:?}")));
    }
    let size = size as usize;
    let alpha = attr_f(ctx.node, "alpha").unwrap_or(1e-4) as f64;
    let beta = attr_f(ctx.node, "beta").unwrap_or(0.75) as f64;
    let bias = attr_f(ctx.node, "bias").unwrap_or(1.0) as f64;
    let (below, above) = ((size - 1) / 2, size / 2);

    let sq = ctx.e.mul(&x, &x);
    let sums = channel_window(ctx, &sq, &sx, (below, above));
    let scaled = ctx.e.scale(&sums, alpha / size as f64, t);
    let b = ctx.e.scalar(bias, t);
    let d = ctx.e.op("Add", &[&scaled, &b], vec![]);
    let neg_beta = ctx.e.scalar(-beta, t);
    let d_pow = ctx.e.op("Pow", &[&d, &neg_beta], vec![]);
    let direct = ctx.e.mul(&dy, &d_pow);
    // dY x d^(-beta-1) = dY x d^-beta / d.
    let dyx = ctx.e.mul(&dy, &x);
    let dyx = ctx.e.mul(&dyx, &d_pow);
    let v = ctx.e.op("Div", &[&dyx, &d], vec![]);
    let back = channel_window(ctx, &v, &sx, (above, below));
    let back = ctx.e.mul(&back, &x);
    let back = ctx.e.scale(&back, 2.0 * alpha * beta / size as f64, t);
    Ok(vec![Some(ctx.e.op("Sub", &[&direct, &back], vec![]))])
}

/// `sum_{k = c - below}^{c + above} v[k]` for every channel `c` (zero outside): `v`
/// padded on the channel axis, then the `below + above + 1` shifted copies added.
fn channel_window(
    ctx: &mut RuleCtx,
    v: &str,
    sx: &[usize],
    (below, above): (usize, usize),
) -> String {
    let rank = sx.len();
    let mut pads = vec![0i64; 2 * rank];
    pads[1] = below as i64;
    pads[rank + 1] = above as i64;
    let p = ctx.e.ints(&pads);
    let padded = ctx.e.op("Pad", &[v, &p], vec![]);
    let c = sx[1] as i64;
    let axis = ctx.e.ints(&[1]);
    let shifted: Vec<String> = (0..=(below + above) as i64)
        .map(|m| {
            let (s, e) = (ctx.e.ints(&[m]), ctx.e.ints(&[m + c]));
            ctx.e.op("Slice", &[&padded, &s, &e, &axis], vec![])
        })
        .collect();
    let refs: Vec<&str> = shifted.iter().map(String::as_str).collect();
    match refs.len() {
        1 => shifted[0].clone(),
        _ => ctx.e.op("Sum", &refs, vec![]),
    }
}
