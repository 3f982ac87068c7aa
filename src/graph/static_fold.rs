//! Folding the values a model computes from constants and shapes alone.
//!
//! Exporters write shape arithmetic into the graph: Llama's rotary embedding slices with
//! bounds computed as `Shape -> Gather -> Div -> Unsqueeze -> Slice`, attention masks come
//! from `Range`, `Trilu`, `Equal` and `Where` on shapes, a ViT's class token is `Expand`ed
//! to a shape read off the batch. pipetrain builds its backward graphs for one
//! micro-batch shape (the shapes it measures), so every such value is a constant of the
//! training graph: it is computed once, with ONNX Runtime on the example micro-batch,
//! and put in as an initializer before autodiff and partitioning. The gradient rules then
//! see constant axes, bounds and shapes, and a stage boundary never has to carry a value
//! that has no gradient.
//!
//! A value is static when its node is deterministic and every input is static: constants,
//! initializers that are not trained, and the output of `Shape` or `Size` of any value
//! whose shape does not depend on the data (everything downstream of `NonZero`,
//! `Compress`, `Unique` or a control-flow node does, but a scatter's output, which has its
//! data's shape). The original model, which the
//! exported inference model is made from, keeps its dynamic shapes.

use std::collections::HashSet;

use crate::graph::ir::{Graph, Metas};
use crate::graph::shape_probe::ShapeProbe;
use crate::tensor::Tensor;
use crate::Result;

/// Operators whose result is random or whose output shape depends on the data.
fn random(op: &str) -> bool {
    op.starts_with("Random") || matches!(op, "Bernoulli" | "Multinomial" | "Dropout")
}
fn data_shaped(op: &str) -> bool {
    matches!(
        op,
        "NonZero" | "Compress" | "Unique" | "Loop" | "If" | "Scan"
    )
}

/// What folding did, for the log.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct FoldReport {
    /// Nodes removed (their values became constants or were no longer read).
    pub removed_nodes: usize,
    /// Values now initializers.
    pub folded: Vec<String>,
}

/// Which nodes of `g` compute static values, given the initializers that are trained.
pub fn static_nodes(g: &Graph, trained: &HashSet<&str>) -> Vec<bool> {
    let mut known: HashSet<&str> = g
        .initializers
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !trained.contains(n))
        .collect();
    // Values whose shape is not fixed by the input shapes.
    let mut shape_varies: HashSet<&str> = HashSet::new();
    let mut out = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        // A scatter's output has its data's shape, whatever its indices and updates are
        // (a mixture of experts scatters each expert's rows, picked by `NonZero`, back into
        // a tensor of fixed shape).
        let shaping: &[String] = match n.op_type.as_str() {
            "ScatterND" | "ScatterElements" | "Scatter" => &n.input[..1.min(n.input.len())],
            _ => &n.input,
        };
        let varies =
            data_shaped(&n.op_type) || shaping.iter().any(|v| shape_varies.contains(v.as_str()));
        if varies {
            shape_varies.extend(n.output.iter().map(String::as_str));
        }
        let is_static = if random(&n.op_type) || data_shaped(&n.op_type) || !n.domain.is_empty() {
            false
        } else if matches!(n.op_type.as_str(), "Shape" | "Size") {
            !varies
        } else {
            n.input
                .iter()
                .all(|v| v.is_empty() || known.contains(v.as_str()))
        };
        if is_static {
            out[i] = true;
            known.extend(n.output.iter().map(String::as_str));
        }
    }
    out
}

/// The static values a non-static node (or the graph's output) reads: what folding
/// computes; empty when there is nothing to fold. `is_static` is [`static_nodes`].
fn frontier(g: &Graph, is_static: &[bool]) -> Vec<String> {
    let folds_something = g
        .nodes
        .iter()
        .zip(is_static)
        .any(|(n, &s)| s && n.op_type != "Constant");
    if !folds_something {
        return Vec::new();
    }
    let produced_static: HashSet<&str> = g
        .nodes
        .iter()
        .zip(is_static)
        .filter(|(n, &s)| s && n.op_type != "Constant")
        .flat_map(|(n, _)| n.output.iter().map(String::as_str))
        .collect();
    let mut frontier: Vec<String> = Vec::new();
    let mut seen = HashSet::new();
    let readers = g
        .nodes
        .iter()
        .zip(is_static)
        .filter(|(_, &s)| !s)
        .flat_map(|(n, _)| n.input.iter())
        .chain(g.outputs.iter().map(|o| &o.name));
    for v in readers {
        if produced_static.contains(v.as_str()) && seen.insert(v.clone()) {
            frontier.push(v.clone());
        }
    }
    frontier
}

/// Puts `values` (of `frontier`, in order) into `g` as initializers and removes the
/// static nodes.
fn apply_fold(
    g: &mut Graph,
    is_static: Vec<bool>,
    frontier: Vec<String>,
    values: &[Tensor],
) -> FoldReport {
    let mut keep = Vec::with_capacity(g.nodes.len());
    let mut removed = 0;
    for (n, s) in std::mem::take(&mut g.nodes).into_iter().zip(is_static) {
        if s && n.op_type != "Constant" {
            removed += 1;
        } else {
            keep.push(n);
        }
    }
    g.nodes = keep;
    for (name, value) in frontier.iter().zip(values) {
        g.initializers.push(value.to_proto(name));
    }
    removed += drop_unread_constants(g);
    FoldReport {
        removed_nodes: removed,
        folded: frontier,
    }
}

/// Every value of `g` measured on `feeds` ([`ShapeProbe::probe`]), and every static value
/// that a non-static node (or the graph's output) reads replaced by an initializer
/// holding its value, the static nodes removed; from one run: the values measured before
/// folding are those of the folded graph (it computes the same values, some of them now
/// constants). The fold had a run of its own (ViT-B/16: 1.7 s).
///
/// # Errors
/// When ONNX Runtime cannot run `g` on the feeds.
pub fn probe_and_fold(
    g: &mut Graph,
    rt: &dyn ShapeProbe,
    feeds: &[(&str, &Tensor)],
    trained: &HashSet<&str>,
) -> Result<(Metas, FoldReport)> {
    let is_static = static_nodes(g, trained);
    let frontier = frontier(g, &is_static);
    if frontier.is_empty() {
        return Ok((rt.probe(g, feeds)?, FoldReport::default()));
    }
    let (metas, values) = rt.probe_with_values(g, feeds, &frontier)?;
    Ok((metas, apply_fold(g, is_static, frontier, &values)))
}

/// Removes `Constant` nodes nothing reads any more; returns how many.
fn drop_unread_constants(g: &mut Graph) -> usize {
    let read: HashSet<&str> = g
        .nodes
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .chain(g.outputs.iter().map(|o| o.name.as_str()))
        .collect();
    let unread: HashSet<usize> = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| {
            n.op_type == "Constant" && !n.output.iter().any(|o| read.contains(o.as_str()))
        })
        .map(|(i, _)| i)
        .collect();
    let before = g.nodes.len();
    let mut i = 0;
    g.nodes.retain(|_| {
        i += 1;
        !unread.contains(&(i - 1))
    });
    before - g.nodes.len()
}
