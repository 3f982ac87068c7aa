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
mod direction;

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::{emit::Emitter, RuleCtx};
use crate::graph::ir::{attr_i, attr_s, attr_strings, int_attr};
use crate::onnx::proto::NodeProto;
use crate::tensor::DType;
use crate::Result;
use direction::{direction, flip};

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
    /// `R`'s gradient as `sum_t a[t]^T b[t]` of each `(a, b)`, the parts stacked on
    /// the gates' axis (`a` is `[T, B, gates of the part]`, `b` `[T, B, H]`).
    pub dr: Vec<(String, String)>,
    /// What sums to `Rb`'s gradient over time and batch (`None`: the same as `Wb`'s).
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
    let needs: Vec<bool> = (0..ctx.node.input.len()).map(|i| ctx.needs(i)).collect();
    let mut grads = Vec::new();
    for (k, &reverse) in dirs.iter().enumerate() {
        let dir = direction(ctx, &d, cell, (k, dirs.len()), reverse);
        let cg = cells::backward(ctx.e, &d, cell, &dir);
        grads.push(finish(ctx.e, &d, &dir, cg, (reverse, &needs)));
    }
    Ok(assemble(ctx.e, &d, grads, &needs))
}

/// One direction's gradients of the node's inputs (those asked for), in the node's
/// time order.
struct DirGrads {
    dx: Option<String>,
    dw: Option<String>,
    dr: Option<String>,
    db: Option<String>,
    dh0: String,
    dc0: Option<String>,
}

/// The products that make the inputs' gradients, each only where `needs` asks for it:
/// `dX = da_x W`, `dW = da_x^T X`, `dR` from the cell's parts, and the biases' sums.
fn finish(
    e: &mut Emitter,
    d: &Dims,
    dir: &Direction,
    cg: CellGrads,
    (reverse, needs): (bool, &[bool]),
) -> DirGrads {
    let asked = |i: usize| needs.get(i) == Some(&true);
    let gh = d.gates * d.hidden;
    let dx = asked(0).then(|| {
        let dx = e.matmul_t((&cg.da_x, 3), (&dir.w, 2), false, false, 1.0, d.dtype);
        if reverse {
            flip(e, &dx, d.seq)
        } else {
            dx
        }
    });
    let dw = asked(1).then(|| outer_sum(e, d, (&cg.da_x, gh), (&dir.x, d.input)));
    let dr = asked(2).then(|| {
        let parts: Vec<String> = (cg.dr.iter())
            .map(|(a, b)| outer_sum(e, d, (a, 0), (b, d.hidden)))
            .collect();
        e.concat(&parts, 0)
    });
    let db = asked(3).then(|| {
        let dwb = e.sum_leading(&cg.da_x, &[d.seq, d.batch, gh], 2, d.dtype);
        let drb = match &cg.drb {
            Some(r) => e.sum_leading(r, &[d.seq, d.batch, gh], 2, d.dtype),
            None => dwb.clone(),
        };
        e.concat(&[dwb, drb], 0)
    });
    DirGrads {
        dx,
        dw,
        dr,
        db,
        dh0: cg.dh0,
        dc0: cg.dc0,
    }
}

/// `sum_t a[t]^T b[t]` over `[T, B, M]` and `[T, B, N]`: `[M, N]` (`M` 0: whatever is
/// left of `a` once `T B` rows are taken).
fn outer_sum(e: &mut Emitter, d: &Dims, (a, m): (&str, usize), (b, n): (&str, usize)) -> String {
    let rows = d.seq * d.batch;
    let a2 = match m {
        0 => e.op("Flatten", &[a], vec![int_attr("axis", 2)]),
        _ => e.reshape(a, &[rows, m]),
    };
    let b2 = e.reshape(b, &[rows, n]);
    e.matmul_t((&a2, 2), (&b2, 2), true, false, 1.0, d.dtype)
}

/// The gradients of the node's inputs, directions stacked on axis 0.
fn assemble(e: &mut Emitter, d: &Dims, grads: Vec<DirGrads>, needs: &[bool]) -> Grads {
    let mut g: Grads = vec![None; needs.len()];
    let (gh, b, h) = (d.gates * d.hidden, d.batch, d.hidden);
    let mut stack = |parts: Vec<Option<String>>, each: &[usize]| -> Option<String> {
        let mut one = vec![1];
        one.extend_from_slice(each);
        let parts: Option<Vec<String>> = parts.into_iter().collect();
        let parts: Vec<String> = parts?.iter().map(|p| e.reshape(p, &one)).collect();
        Some(e.concat(&parts, 0))
    };
    let asked = |i: usize| needs.get(i) == Some(&true);
    let stacked = [
        (
            1,
            grads.iter().map(|x| x.dw.clone()).collect(),
            vec![gh, d.input],
        ),
        (2, grads.iter().map(|x| x.dr.clone()).collect(), vec![gh, h]),
        (
            3,
            grads.iter().map(|x| x.db.clone()).collect(),
            vec![2 * gh],
        ),
        (
            5,
            grads.iter().map(|x| Some(x.dh0.clone())).collect(),
            vec![b, h],
        ),
        (6, grads.iter().map(|x| x.dc0.clone()).collect(), vec![b, h]),
    ];
    for (i, parts, each) in stacked {
        if asked(i) {
            g[i] = stack(parts, &each);
        }
    }
    let mut dx = grads.iter().filter_map(|x| x.dx.clone());
    g[0] = dx
        .next()
        .map(|first| dx.fold(first, |acc, other| e.op("Add", &[&acc, &other], vec![])));
    g
}
