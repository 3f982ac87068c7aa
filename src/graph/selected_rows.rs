//! A position the model reads back alone, computed alone.
//!
//! A classifier on a transformer reads one position of its last layer: BERT's pooler and
//! ViT's head take token 0 (`hidden[:, 0]`, exported as a `Gather` of a constant position
//! on the sequence axis). What the last layer computes position by position after its
//! attention mixed them (the output projection, both norms, the feed-forward) and its
//! queries are computed for every position, forward and backward, and all but one row is
//! thrown away: in BERT-base and ViT-B/16 about 7% of the step's products. PyTorch eager
//! computes them too.
//!
//! Here the `Gather` moves up the graph. A value whose readers all take one position `k`
//! of one axis, made by a node that computes each position of that axis from the same
//! position of its inputs, is made for position `k` alone:
//! - element-wise operators, broadcasting (an input that is 1 along the axis is read whole);
//! - `MatMul` and `Gemm` along the rows of one operand or a batch axis;
//! - `LayerNormalization`, `Softmax` and `LogSoftmax` over other axes;
//! - `Transpose`; `Reshape` keeping the axes up to it; `Slice` of other axes;
//! - `Dropout` of ratio 0.
//!
//! The node reads position `k` of its inputs (a `Gather` that keeps the axis), and its
//! readers read the one row it now holds. Values keep their names, so a `cut_at` still
//! names the same place; only their shapes shrink. It stops at a value that something
//! else reads whole (the keys and values of the last attention), where the `Gather` stays.

use std::collections::HashMap;

use crate::graph::gathers::{i64_constant, position_read};
use crate::graph::ir::{attr_i, attr_ints, axis_index, int_attr, make_node, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// Moves every constant-position `Gather` of `g` up as far as it goes (see the module
/// doc), keeping `metas` the shapes of the values it shrinks and makes; returns how many
/// nodes now compute one position.
pub fn select_rows_early(g: &mut Graph, metas: &mut Metas) -> usize {
    let mut consts = g.constants();
    let mut moved = 0;
    // Each move shrinks one node's output, so this ends within the node count.
    for _ in 0..g.nodes.len() {
        let Some(found) = next(g, metas, &consts) else {
            break;
        };
        apply(g, metas, &mut consts, found);
        moved += 1;
    }
    moved
}

/// What one input of a node becomes when its output is made for one position.
#[derive(Debug, Clone, PartialEq)]
enum Read {
    /// The input as it is (it broadcasts along the axis, or does not have it).
    Whole,
    /// The position, of this axis of the input.
    Row(usize),
    /// In place of a `Reshape`'s shape: this shape.
    Shape(Vec<i64>),
}

/// A value to make for one position.
struct Found {
    value: String,
    axis: usize,
    position: usize,
    reads: Vec<Read>,
    /// Its readers' outputs, each with whether that reader keeps the axis.
    readers: Vec<(String, bool)>,
}

/// The first value that can be made for one position.
fn next(g: &Graph, metas: &Metas, consts: &HashMap<String, Tensor>) -> Option<Found> {
    let producers = g.producers();
    let consumers = g.consumers();
    let is_output = |v: &str| g.outputs.iter().any(|o| o.name == v);
    for n in &g.nodes {
        let Some(at) = position_read(n, metas, consts) else {
            continue;
        };
        let value = &n.input[0];
        let Some(&p) = producers.get(value.as_str()) else {
            continue;
        };
        if is_output(value) || metas.get(value).is_none_or(|m| m.shape[at.axis] < 2) {
            continue;
        }
        let made = &g.nodes[p];
        let others_unread = made.output[1..]
            .iter()
            .all(|o| o.is_empty() || (!consumers.contains_key(o.as_str()) && !is_output(o)));
        if made.output[0] != *value || !others_unread {
            continue;
        }
        let readers: Option<Vec<(String, bool)>> = consumers[value.as_str()]
            .iter()
            .map(|&c| {
                let r = &g.nodes[c];
                let same = position_read(r, metas, consts)
                    .filter(|o| o.axis == at.axis && o.position == at.position)
                    .filter(|_| r.input[1] != *value)?;
                Some((r.output[0].clone(), same.keeps_axis))
            })
            .collect();
        let Some(readers) = readers else { continue };
        let Some(reads) = row_reads(made, at.axis, metas, consts) else {
            continue;
        };
        return Some(Found {
            value: value.clone(),
            axis: at.axis,
            position: at.position,
            reads,
            readers,
        });
    }
    None
}

/// Operators that compute each element from the same element of their (broadcast)
/// inputs.
const ELEMENTWISE: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Where",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "And",
    "Or",
    "Not",
    "Erf",
    "Tanh",
    "Relu",
    "Sigmoid",
    "Sqrt",
    "Reciprocal",
    "Neg",
    "Exp",
    "Log",
    "Abs",
    "Cast",
    "Identity",
    "Softplus",
    "LeakyRelu",
    "Elu",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
    "Clip",
    "Sin",
    "Cos",
];

/// What each input of `n` becomes when its output is made for one position of `axis`;
/// `None` where `n` mixes positions of that axis (or is not known to keep them apart).
fn row_reads(
    n: &NodeProto,
    axis: usize,
    metas: &Metas,
    consts: &HashMap<String, Tensor>,
) -> Option<Vec<Read>> {
    if !n.domain.is_empty() {
        return None;
    }
    let out = &metas.get(n.output.first()?)?.shape;
    let rank = out.len();
    let broadcast = |i: &String| broadcast_read(i, axis, out, metas);
    let first_row = |first: Read| {
        std::iter::once(Some(first))
            .chain(n.input[1..].iter().map(|_| Some(Read::Whole)))
            .collect::<Option<Vec<Read>>>()
    };
    match n.op_type.as_str() {
        op if ELEMENTWISE.contains(&op) => n.input.iter().map(broadcast).collect(),
        "Dropout" => {
            // An identity: not training (the default), or a ratio of 0 (the default
            // ratio is 0.5).
            let constant = |i: usize, zero: bool| {
                n.input.get(i).filter(|v| !v.is_empty()).map_or(zero, |v| {
                    consts
                        .get(v)
                        .map(Tensor::to_f64_vec)
                        .is_some_and(|v| v.iter().all(|&x| x == 0.0))
                })
            };
            (constant(2, true) || constant(1, false)).then(|| first_row(broadcast(&n.input[0])?))?
        }
        "MatMul" => matmul_reads(n, axis, out, metas),
        "Gemm" => {
            let flag = |name| attr_i(n, name).unwrap_or(0) != 0;
            let (a, b) = match axis {
                0 => (Read::Row(usize::from(flag("transA"))), Read::Whole),
                _ => (Read::Whole, Read::Row(usize::from(!flag("transB")))),
            };
            let c = n.input.get(2).map(broadcast);
            let mut reads = vec![a, b];
            if let Some(c) = c {
                reads.push(c?);
            }
            Some(reads)
        }
        "LayerNormalization" => {
            let from = axis_index(attr_i(n, "axis").unwrap_or(-1), rank)?;
            (axis < from).then(|| first_row(Read::Row(axis)))?
        }
        "Softmax" | "LogSoftmax" => {
            let over = axis_index(attr_i(n, "axis").unwrap_or(-1), rank)?;
            (over != axis).then(|| first_row(Read::Row(axis)))?
        }
        "Transpose" => {
            let perm = attr_ints(n, "perm").unwrap_or_else(|| (0..rank as i64).rev().collect());
            first_row(Read::Row(usize::try_from(*perm.get(axis)?).ok()?))
        }
        "Reshape" => reshape_reads(n, axis, out, metas, consts),
        "Slice" => {
            let sliced: Vec<i64> = match n.input.get(3).filter(|a| !a.is_empty()) {
                Some(axes) => consts.get(axes)?.to_i64_vec()?,
                None => {
                    (0..consts.get(&n.input[1])?.shape.iter().product::<usize>() as i64).collect()
                }
            };
            let touches = sliced.iter().any(|&a| axis_index(a, rank) == Some(axis));
            (!touches).then(|| first_row(Read::Row(axis)))?
        }
        _ => None,
    }
}

/// An input broadcast to `out`: read at the position where it runs along `axis`, whole
/// where it is 1 there or has no such axis.
fn broadcast_read(input: &str, axis: usize, out: &[usize], metas: &Metas) -> Option<Read> {
    if input.is_empty() {
        return Some(Read::Whole);
    }
    broadcast_axis(&metas.get(input)?.shape, axis, out)
}

/// [`broadcast_read`] of an input of `shape`.
fn broadcast_axis(shape: &[usize], axis: usize, out: &[usize]) -> Option<Read> {
    let offset = out.len().checked_sub(shape.len())?;
    if axis < offset {
        return Some(Read::Whole);
    }
    match shape[axis - offset] {
        1 => Some(Read::Whole),
        d if d == out[axis] => Some(Read::Row(axis - offset)),
        _ => None,
    }
}

/// `MatMul`'s inputs: the rows of `A`, the columns of `B`, or a batch axis of both (which
/// broadcast as element-wise operands do, without their matrix axes).
fn matmul_reads(n: &NodeProto, axis: usize, out: &[usize], metas: &Metas) -> Option<Vec<Read>> {
    let shape_of = |i: &str| metas.get(i).map(|m| &m.shape[..]).filter(|s| s.len() >= 2);
    let (a, b) = (shape_of(&n.input[0])?, shape_of(&n.input[1])?);
    let r = out.len();
    if axis == r - 2 {
        Some(vec![Read::Row(a.len() - 2), Read::Whole])
    } else if axis == r - 1 {
        Some(vec![Read::Whole, Read::Row(b.len() - 1)])
    } else {
        let batch = |s: &[usize]| broadcast_axis(&s[..s.len() - 2], axis, &out[..r - 2]);
        Some(vec![batch(a)?, batch(b)?])
    }
}

/// `Reshape`'s inputs where it keeps the axes up to `axis` as they are: the data's row,
/// and its shape with 1 at `axis` (a 0 there copies the data's 1 as it copied `n`).
fn reshape_reads(
    n: &NodeProto,
    axis: usize,
    out: &[usize],
    metas: &Metas,
    consts: &HashMap<String, Tensor>,
) -> Option<Vec<Read>> {
    let data = &metas.get(&n.input[0])?.shape;
    let mut shape = consts.get(n.input.get(1)?)?.to_i64_vec()?;
    let kept = data.len() > axis && shape.len() == out.len() && data[..=axis] == out[..=axis];
    // A 0 copies the data's dimension, or with `allowzero` is one of 0 (not read here).
    if !kept || (shape[axis] == 0 && attr_i(n, "allowzero").unwrap_or(0) != 0) {
        return None;
    }
    if shape[axis] != 0 {
        shape[axis] = 1;
    }
    Some(vec![Read::Row(axis), Read::Shape(shape)])
}

/// Makes `f.value` for its one position: its node reads that position of its inputs,
/// its readers the one row.
fn apply(g: &mut Graph, metas: &mut Metas, consts: &mut HashMap<String, Tensor>, f: Found) {
    let index = constant(
        g,
        metas,
        consts,
        &format!("rows/position{}", f.position),
        f.position as i64,
    );
    let p = producer(g, &f.value);
    let inputs = g.nodes[p].input.clone();
    for (j, (input, read)) in inputs.iter().zip(&f.reads).enumerate() {
        let replacement = match read {
            Read::Whole => continue,
            Read::Row(axis) => row_of(g, metas, (input, *axis), &index),
            Read::Shape(shape) => {
                let name = format!("{input}/rows{}", f.axis);
                insert_constant(g, metas, consts, &name, shape.clone());
                name
            }
        };
        let p = producer(g, &f.value);
        g.nodes[p].input[j] = replacement;
    }
    if let Some(m) = metas.get_mut(&f.value) {
        m.shape[f.axis] = 1;
    }
    let axes = format!("rows/axis{}", f.axis);
    let axes = constant(g, metas, consts, &axes, f.axis as i64);
    let is_output = |g: &Graph, v: &str| g.outputs.iter().any(|o| o.name == v);
    for (out, keeps_axis) in f.readers {
        let r = producer(g, &out);
        let name = g.nodes[r].name.clone();
        if keeps_axis && !is_output(g, &out) {
            // The reader's output is the value itself now.
            g.nodes.remove(r);
            for n in &mut g.nodes {
                for i in n.input.iter_mut().filter(|i| **i == out) {
                    i.clone_from(&f.value);
                }
            }
        } else if keeps_axis {
            g.nodes[r] = make_node("Identity", &name, &[&f.value], &[&out], vec![]);
        } else {
            g.nodes[r] = make_node("Squeeze", &name, &[&f.value, &axes], &[&out], vec![]);
        }
    }
}

/// The `Gather` of `index` (a position, as `[k]`) along `axis` of `input`, made once,
/// right after `input`'s producer and the index (so before every reader it may get).
fn row_of(g: &mut Graph, metas: &mut Metas, (input, axis): (&str, usize), index: &str) -> String {
    let name = format!("{input}/{index}@{axis}");
    if g.nodes.iter().any(|n| n.output.first() == Some(&name)) {
        return name;
    }
    if let Some(m) = metas.get(input) {
        let mut m = m.clone();
        m.shape[axis] = 1;
        metas.insert(name.clone(), m);
    }
    let gather = make_node(
        "Gather",
        &name,
        &[input, index],
        &[&name],
        vec![int_attr("axis", axis as i64)],
    );
    let at = g
        .nodes
        .iter()
        .rposition(|n| n.output.iter().any(|o| o == input || o == index))
        .map_or(0, |i| i + 1);
    g.nodes.insert(at, gather);
    name
}

/// The `[value]` int64 constant named `name`, made once at the graph's start.
fn constant(
    g: &mut Graph,
    metas: &mut Metas,
    consts: &mut HashMap<String, Tensor>,
    name: &str,
    value: i64,
) -> String {
    if !consts.contains_key(name) {
        insert_constant(g, metas, consts, name, vec![value]);
    }
    name.to_string()
}

/// A `Constant` node of the 1-D `values` named `name`, at the graph's start.
fn insert_constant(
    g: &mut Graph,
    metas: &mut Metas,
    consts: &mut HashMap<String, Tensor>,
    name: &str,
    values: Vec<i64>,
) {
    let t = Tensor::i64(vec![values.len()], values.clone()).expect("a 1-D tensor");
    g.nodes.insert(0, i64_constant(metas, name, values));
    consts.insert(name.to_string(), t);
}

/// The node making `value` (which the caller knows exists).
fn producer(g: &Graph, value: &str) -> usize {
    g.nodes
        .iter()
        .position(|n| n.output.iter().any(|o| o == value))
        .expect("a value's producer")
}

#[cfg(test)]
mod tests;
