//! One direction of a recurrent node's values, in the order it processes time: its
//! input, hidden states, weights and the gradients reaching its outputs.

use super::{Cell, Dims, Direction};
use crate::graph::autodiff::{emit::Emitter, RuleCtx};
use crate::graph::ir::int_attr;
use crate::tensor::{Tensor, TensorData};

/// Direction `k`'s values (of `dirs`), in its processing order.
pub(super) fn direction(
    ctx: &mut RuleCtx,
    d: &Dims,
    cell: Cell,
    (k, dirs): (usize, usize),
    reverse: bool,
) -> Direction {
    let (t, b, h, gh) = (d.seq, d.batch, d.hidden, d.gates * d.hidden);
    let e = &mut *ctx.e;
    // Direction k's part of a value: a view where there is one direction, else a copy.
    let pick = |e: &mut Emitter, v: &str, axis: i64, part: &[usize]| match dirs {
        1 => e.reshape(v, part),
        _ => pick(e, v, k, axis),
    };
    let in_order = |e: &mut Emitter, v: String| if reverse { flip(e, &v, t) } else { v };
    let state = |e: &mut Emitter, v: &str| {
        let v = pick(e, v, 0, &[b, h]);
        e.reshape(&v, &[1, b, h])
    };

    let x = in_order(e, ctx.node.input[0].clone());
    let y = pick(e, &ctx.node.output[0], 1, &[t, b, h]);
    let y = in_order(e, y);
    let h0 = match ctx.node.input.get(5).filter(|s| !s.is_empty()) {
        Some(h0) => state(e, h0),
        None => e.zeros(&[1, b, h], d.dtype),
    };
    let h_prev = match t {
        1 => h0,
        _ => {
            let earlier = gather(e, &y, &(0..t as i64 - 1).collect::<Vec<_>>(), 0);
            e.concat(&[h0, earlier], 0)
        }
    };
    let w = pick(e, &ctx.node.input[1], 0, &[gh, d.input]);
    let r = pick(e, &ctx.node.input[2], 0, &[gh, h]);
    let (wb, rb) = match ctx.node.input.get(3).filter(|s| !s.is_empty()) {
        Some(bias) => {
            let bk = pick(e, bias, 0, &[2 * gh]);
            let halves = e.reshape(&bk, &[2, gh]);
            (
                Some(self::pick(e, &halves, 0, 0)),
                Some(self::pick(e, &halves, 1, 0)),
            )
        }
        None => (None, None),
    };
    let c0 = match ctx.node.input.get(6).filter(|s| !s.is_empty()) {
        Some(c0) if cell == Cell::Lstm => Some(state(e, c0)),
        _ => None,
    };
    let dy = ctx.dy.first().cloned().flatten().map(|g| {
        let g = pick(e, &g, 1, &[t, b, h]);
        in_order(e, g)
    });
    let dy_last = ctx.dy.get(1).cloned().flatten().map(|g| state(e, &g));
    let dc_last = match cell {
        Cell::Lstm => ctx.dy.get(2).cloned().flatten().map(|g| state(e, &g)),
        _ => None,
    };
    Direction {
        x,
        h_prev,
        y,
        w,
        r,
        wb,
        rb,
        c0,
        dy,
        dy_last,
        dc_last,
    }
}

/// `Gather(x, k)` on `axis`: index `k` of that axis, the axis dropped.
fn pick(e: &mut Emitter, x: &str, k: usize, axis: i64) -> String {
    let i = e.constant(Tensor {
        shape: vec![],
        data: TensorData::I64(vec![k as i64]),
    });
    e.op("Gather", &[x, &i], vec![int_attr("axis", axis)])
}

/// `Gather(x, indices)` on `axis`.
fn gather(e: &mut Emitter, x: &str, indices: &[i64], axis: i64) -> String {
    let i = e.ints(indices);
    e.op("Gather", &[x, &i], vec![int_attr("axis", axis)])
}

/// `x` with its first axis (time, `len` steps) reversed.
pub(super) fn flip(e: &mut Emitter, x: &str, len: usize) -> String {
    gather(e, x, &(0..len as i64).rev().collect::<Vec<_>>(), 0)
}
