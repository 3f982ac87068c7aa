//! Where a `Split` of constant-position `Gather`s' tensor takes its parts from: the
//! tensor itself, or the input of the `Transpose` (and `Squeeze`) that makes it, where
//! each part holds the same values in the same order on both sides (see the parent
//! module's doc).

use std::collections::HashMap;

use crate::graph::ir::{attr_ints, axis_index, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// What [`untransposed`] reads of the graph: made once for all the tensors taken apart.
pub(super) struct Reads<'g> {
    g: &'g Graph,
    producers: HashMap<&'g str, usize>,
    consumers: HashMap<&'g str, Vec<usize>>,
    consts: &'g HashMap<String, Tensor>,
}

impl<'g> Reads<'g> {
    pub(super) fn of(g: &'g Graph, consts: &'g HashMap<String, Tensor>) -> Reads<'g> {
        Reads {
            g,
            producers: g.producers(),
            consumers: g.consumers(),
            consts,
        }
    }
}

/// What the `Split` takes apart: `data` along `axis`, and the axes each part loses
/// (`axis`, and those the transpose moved that are of size 1 in a part); the outputs of
/// the nodes it replaces (a transpose and its squeeze).
pub(super) struct Source {
    pub(super) data: String,
    pub(super) axis: usize,
    pub(super) squeezed: Vec<i64>,
    pub(super) replaced: Vec<String>,
}

impl Source {
    /// `data` itself along `axis`.
    pub(super) fn of(data: &str, axis: usize) -> Source {
        Source {
            data: data.to_string(),
            axis,
            squeezed: vec![axis as i64],
            replaced: Vec::new(),
        }
    }
}

/// `data` along `axis` as the parts of the transpose's input (see the module doc), where
/// `data` is a `Transpose`, or a `Squeeze` of one, read by the `readers` `Gather`s alone.
pub(super) fn untransposed(
    reads: &Reads,
    metas: &Metas,
    (data, axis): (&str, usize),
    readers: usize,
) -> Option<Source> {
    let Reads {
        g,
        producers,
        consumers,
        consts,
    } = reads;
    let only_read_by = |v: &str, n: usize| {
        consumers.get(v).is_some_and(|c| c.len() == n) && !g.outputs.iter().any(|o| o.name == v)
    };
    if !only_read_by(data, readers) {
        return None;
    }
    let standard = |i: usize, op: &str| g.nodes[i].op_type == op && g.nodes[i].domain.is_empty();
    let mut node = *producers.get(data)?;
    let mut squeezed: Vec<usize> = Vec::new();
    let mut replaced = vec![data.to_string()];
    if standard(node, "Squeeze") {
        let sq = &g.nodes[node];
        let rank = metas.get(sq.input.first()?)?.shape.len();
        squeezed = squeeze_axes(consts, sq)?
            .into_iter()
            .map(|a| axis_index(a, rank))
            .collect::<Option<_>>()?;
        if !only_read_by(&sq.input[0], 1) {
            return None;
        }
        replaced.push(sq.input[0].clone());
        node = *producers.get(sq.input[0].as_str())?;
    }
    let t = &g.nodes[node];
    if !standard(node, "Transpose") {
        return None;
    }
    let x = t.input.first()?;
    let rank = metas.get(x)?.shape.len();
    let perm: Vec<usize> = match attr_ints(t, "perm") {
        Some(p) => p
            .iter()
            .map(|&a| usize::try_from(a).ok())
            .collect::<Option<_>>()?,
        None => (0..rank).rev().collect(),
    };
    if perm.len() != rank || perm.iter().any(|&a| a >= rank) {
        return None;
    }
    // The gathered axis of the transpose's output, past the squeezed ones.
    let kept: Vec<usize> = (0..rank).filter(|a| !squeezed.contains(a)).collect();
    let source_axis = perm[*kept.get(axis)?];
    // The axes of size 1 in every part: the gathered one and the squeezed ones. The
    // others, read in the transpose's order, must be in their own order.
    let ones: Vec<usize> = squeezed
        .iter()
        .map(|&a| perm[a])
        .chain([source_axis])
        .collect();
    let moved: Vec<usize> = perm.iter().copied().filter(|a| !ones.contains(a)).collect();
    if !moved.windows(2).all(|w| w[0] < w[1]) {
        return None;
    }
    let mut squeezed: Vec<i64> = ones.iter().map(|&a| a as i64).collect();
    squeezed.sort_unstable();
    squeezed.dedup();
    Some(Source {
        data: x.clone(),
        axis: source_axis,
        squeezed,
        replaced,
    })
}

/// A `Squeeze` node's axes: its constant second input (opset 13 on) or attribute.
fn squeeze_axes(consts: &HashMap<String, Tensor>, n: &NodeProto) -> Option<Vec<i64>> {
    match n.input.get(1).filter(|a| !a.is_empty()) {
        Some(a) => consts.get(a)?.to_i64_vec(),
        None => attr_ints(n, "axes"),
    }
}
