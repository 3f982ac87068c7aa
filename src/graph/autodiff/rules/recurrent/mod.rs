//! LSTM, GRU and RNN: backpropagation through time, unrolled in standard ops.
//!
//! ONNX Runtime's training build replaces these nodes by its own `LSTMTraining` and
//! `GRUTraining` kernels, which also output every gate and cell state for its
//! `LSTMGrad`/`GRUGrad` kernels (orttraining `lstm_replacement.cc`, `gru_replacement.cc`).
//! Stock ONNX Runtime has neither, so the forward keeps the model's own node and the rule
//! reads the hidden states from its output `Y`: with `h[t-1]` known for every step, the
//! gates of all steps are one batched product (an LSTM's cell states are one cheap
//! elementwise recurrence more). Only the gradient's recurrence through `R` is a loop:
//! per step a few elementwise nodes and one `[batch, gates] x [gates, hidden]` product,
//! unrolled over the sequence length the shapes were measured at.
//!
//! Every direction is computed in the order it processes time (the reverse direction's
//! sequences flipped). Refused, each naming the node: a node without output `Y`,
//! `sequence_lens` that differ from the sequence length, `layout = 1` (batch first:
//! ONNX Runtime's CPU kernels refuse it too; `torch.onnx.export` writes `batch_first`
//! as layout 0 between transposes), `clip`, LSTM's `input_forget` and peepholes,
//! activations other than the defaults (RNN: `Tanh` or `Relu`).

mod cells;

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::{emit::Emitter, RuleCtx};
use crate::graph::ir::{attr_i, attr_s, attr_strings, int_attr};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor, TensorData};
use crate::Result;

/// Which recurrent operator a node is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Cell {
    Lstm,
    /// `linear_before_reset`: the reset gate scales `h R^T + Rb` (PyTorch's form), not `h`.
    Gru {
        linear_before_reset: bool,
    },
    /// The activation is `Relu` (else `Tanh`).
    Rnn {
        relu: bool,
    },
}

impl Cell {
    /// Gates stacked in `W` and `R`.
    fn gates(self) -> usize {
        match self {
            Cell::Lstm => 4,
            Cell::Gru { .. } => 3,
            Cell::Rnn { .. } => 1,
        }
    }
}

/// The sizes of one node: `X` is `[seq, batch, input]`, the states `[batch, hidden]`.
pub(super) struct Dims {
    pub seq: usize,
    pub batch: usize,
    pub hidden: usize,
    pub input: usize,
    /// Gates stacked in `W` and `R`.
    pub gates: usize,
    pub dtype: DType,
}

/// One direction's values in the order it processes time.
pub(super) struct Direction {
    /// `[T, B, I]`.
    pub x: String,
    /// `h[t-1]` of every step: `[T, B, H]`.
    pub h_prev: String,
    /// `h[t]` of every step (`Y`): `[T, B, H]`.
    pub y: String,
    /// `[G*H, I]`, `[G*H, H]`.
    pub w: String,
    pub r: String,
    /// The input and recurrence biases, `[G*H]` each (absent: zero).
    pub wb: Option<String>,
    pub rb: Option<String>,
    /// The initial cell state (LSTM), `[1, B, H]`.
    pub c0: Option<String>,
    /// The gradients reaching `Y` (`[T, B, H]`), the last hidden and cell state (`[1, B, H]`).
    pub dy: Option<String>,
    pub dy_last: Option<String>,
    pub dc_last: Option<String>,
}

/// What a cell's backward returns for one direction.
pub(super) struct CellGrads {
    /// The gradient of the input side's pre-activations `X W^T + Wb`: `[T, B, G*H]`.
    pub da_x: String,
    /// `R`'s gradient, `[G*H, H]`, and `Rb`'s (`None`: the same as `Wb`'s).
    pub dr: String,
    pub drb: Option<String>,
    /// The initial states' gradients, `[1, B, H]`.
    pub dh0: String,
    pub dc0: Option<String>,
}

pub fn lstm(ctx: &mut RuleCtx) -> Result<Grads> {
    if attr_i(ctx.node, "input_forget").unwrap_or(0) != 0 {
        return Err(ctx.unsupported("input_forget = 1"));
    }
    if !ctx.input(7).is_empty() {
        return Err(ctx.unsupported("peephole weights P"));
    }
    check_activations(ctx, &["Sigmoid", "Tanh", "Tanh"])?;
    recurrent(ctx, Cell::Lstm)
}

pub fn gru(ctx: &mut RuleCtx) -> Result<Grads> {
    check_activations(ctx, &["Sigmoid", "Tanh"])?;
    let linear_before_reset = attr_i(ctx.node, "linear_before_reset").unwrap_or(0) != 0;
    recurrent(
        ctx,
        Cell::Gru {
            linear_before_reset,
        },
    )
}

pub fn rnn(ctx: &mut RuleCtx) -> Result<Grads> {
    let relu = activations(ctx.node).first().is_some_and(|a| a == "Relu");
    check_activations(ctx, &[if relu { "Relu" } else { "Tanh" }])?;
    recurrent(ctx, Cell::Rnn { relu })
}

/// The node's `activations`, one list for every direction.
fn activations(node: &NodeProto) -> Vec<String> {
    attr_strings(node, "activations").unwrap_or_default()
}

/// Refuses activations (and their parameters) other than `expected` for each direction.
fn check_activations(ctx: &RuleCtx, expected: &[&str]) -> Result<()> {
    let given = activations(ctx.node);
    let matches = given.is_empty()
        || (given.len() % expected.len() == 0
            && given
                .iter()
                .zip(expected.iter().cycle())
                .all(|(g, e)| g == e));
    let params = ["activation_alpha", "activation_beta"]
        .iter()
        .any(|p| ctx.node.attribute.iter().any(|a| a.name == *p));
    if !matches || params {
        return Err(ctx.unsupported(format!(
            "activations {given:?} (only {expected:?}, without alpha or beta)"
        )));
    }
    if ctx.node.attribute.iter().any(|a| a.name == "clip") {
        return Err(ctx.unsupported("clip"));
    }
    Ok(())
}

/// The rule: the node's values per direction, each direction's cell backward, and the
/// gradients with the directions stacked.
fn recurrent(ctx: &mut RuleCtx, cell: Cell) -> Result<Grads> {
    if ctx.output(0).is_empty() {
        return Err(ctx.unsupported(
            "the backward reads the hidden states from output Y, which this node leaves out",
        ));
    }
    if attr_i(ctx.node, "layout").unwrap_or(0) != 0 {
        return Err(ctx.unsupported("layout = 1 (batch first)"));
    }
    let dirs = match attr_s(ctx.node, "direction").as_deref() {
        None | Some("forward") => vec![false],
        Some("reverse") => vec![true],
        Some("bidirectional") => vec![false, true],
        Some(other) => return Err(ctx.unsupported(format!("direction `{other}`"))),
    };
    let sx = shape(ctx, ctx.input(0))?;
    let sr = shape(ctx, ctx.input(2))?;
    if sx.len() != 3 || sr.len() != 3 {
        return Err(ctx.unsupported(format!("X of shape {sx:?} and R of shape {sr:?}")));
    }
    let d = Dims {
        seq: sx[0],
        batch: sx[1],
        hidden: sr[2],
        input: sx[2],
        gates: cell.gates(),
        dtype: dtype(ctx, ctx.input(0))?,
    };
    if let Some(lens) = ctx.const_ints(4)? {
        if lens.iter().any(|&l| l != d.seq as i64) {
            return Err(ctx.unsupported(format!(
                "sequence_lens {lens:?}: sequences shorter than the {} steps of X",
                d.seq
            )));
        }
    }
    let mut grads = Vec::new();
    for (k, &reverse) in dirs.iter().enumerate() {
        let dir = direction(ctx, &d, cell, (k, dirs.len()), reverse);
        let cg = cells::backward(ctx.e, &d, cell, &dir);
        grads.push(finish(ctx, &d, &dir, cg, reverse));
    }
    assemble(ctx, &d, cell, grads)
}

/// Direction `k`'s values (of `dirs`), in its processing order.
fn direction(
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
            concat(e, &[h0, earlier], 0)
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

/// One direction's gradients of the node's inputs, in the node's time order.
struct DirGrads {
    dx: String,
    dw: String,
    dr: String,
    db: String,
    dh0: String,
    dc0: Option<String>,
}

/// The input side's gradients from `da_x`: `dX = da_x W`, `dW = da_x^T X`, `dWb = sum da_x`.
fn finish(ctx: &mut RuleCtx, d: &Dims, dir: &Direction, cg: CellGrads, reverse: bool) -> DirGrads {
    let e = &mut *ctx.e;
    let rows = d.seq * d.batch;
    let gh = d.gates * d.hidden;
    let dx = e.matmul_t((&cg.da_x, 3), (&dir.w, 2), false, false, 1.0, d.dtype);
    let dx = if reverse { flip(e, &dx, d.seq) } else { dx };
    let da2 = e.reshape(&cg.da_x, &[rows, gh]);
    let x2 = e.reshape(&dir.x, &[rows, d.input]);
    let dw = e.matmul_t((&da2, 2), (&x2, 2), true, false, 1.0, d.dtype);
    let dwb = e.sum_leading(&cg.da_x, &[d.seq, d.batch, gh], 2, d.dtype);
    let drb = cg.drb.unwrap_or_else(|| dwb.clone());
    let db = e.op("Concat", &[&dwb, &drb], vec![int_attr("axis", 0)]);
    DirGrads {
        dx,
        dw,
        dr: cg.dr,
        db,
        dh0: cg.dh0,
        dc0: cg.dc0,
    }
}

/// The gradients of the node's inputs, directions stacked on axis 0.
fn assemble(ctx: &mut RuleCtx, d: &Dims, cell: Cell, grads: Vec<DirGrads>) -> Result<Grads> {
    let mut g: Grads = vec![None; ctx.node.input.len()];
    let needs: Vec<bool> = (0..ctx.node.input.len()).map(|i| ctx.needs(i)).collect();
    let e = &mut *ctx.e;
    let (gh, b, h) = (d.gates * d.hidden, d.batch, d.hidden);
    let stack = |e: &mut Emitter, parts: Vec<String>, each: &[usize]| {
        let mut one = vec![1];
        one.extend_from_slice(each);
        let parts: Vec<String> = parts.iter().map(|p| e.reshape(p, &one)).collect();
        concat(e, &parts, 0)
    };
    if needs[0] {
        let mut dx = grads[0].dx.clone();
        for other in &grads[1..] {
            dx = e.op("Add", &[&dx, &other.dx], vec![]);
        }
        g[0] = Some(dx);
    }
    if needs.get(1) == Some(&true) {
        g[1] = Some(stack(
            e,
            grads.iter().map(|x| x.dw.clone()).collect(),
            &[gh, d.input],
        ));
    }
    if needs.get(2) == Some(&true) {
        g[2] = Some(stack(
            e,
            grads.iter().map(|x| x.dr.clone()).collect(),
            &[gh, h],
        ));
    }
    if needs.get(3) == Some(&true) {
        g[3] = Some(stack(
            e,
            grads.iter().map(|x| x.db.clone()).collect(),
            &[2 * gh],
        ));
    }
    if needs.get(5) == Some(&true) {
        let dh0 = stack(e, grads.iter().map(|x| x.dh0.clone()).collect(), &[b, h]);
        g[5] = Some(dh0);
    }
    if needs.get(6) == Some(&true) && cell == Cell::Lstm {
        let dc0: Vec<String> = grads.iter().filter_map(|x| x.dc0.clone()).collect();
        let dc0 = stack(e, dc0, &[b, h]);
        g[6] = Some(dc0);
    }
    Ok(g)
}

/// `Gather(x, k)` on `axis`: index `k` of that axis, the axis dropped.
pub(super) fn pick(e: &mut Emitter, x: &str, k: usize, axis: i64) -> String {
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
fn flip(e: &mut Emitter, x: &str, len: usize) -> String {
    gather(e, x, &(0..len as i64).rev().collect::<Vec<_>>(), 0)
}

/// `x` split on `axis` into parts of `sizes`; one part is `x` itself.
pub(super) fn split(e: &mut Emitter, x: &str, axis: i64, sizes: &[usize]) -> Vec<String> {
    if sizes.len() == 1 {
        return vec![x.to_string()];
    }
    let s = e.ints(&sizes.iter().map(|&n| n as i64).collect::<Vec<_>>());
    e.op_n("Split", &[x, &s], sizes.len(), vec![int_attr("axis", axis)])
}

/// `parts` joined on `axis`; one part is itself.
pub(super) fn concat(e: &mut Emitter, parts: &[String], axis: i64) -> String {
    match parts {
        [one] => one.clone(),
        _ => {
            let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
            e.op("Concat", &refs, vec![int_attr("axis", axis)])
        }
    }
}
