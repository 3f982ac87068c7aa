//! A tensor taken apart by `Gather`s at constant positions, every position once, as one
//! `Split`: how `torch.nn.MultiheadAttention` (torchvision's ViT among its users) takes
//! q, k and v out of its packed projection (`proj[0]`, `proj[1]`, `proj[2]`).
//!
//! Each `Gather`'s gradient is a scatter into zeros of the whole tensor, and the three
//! are summed (ViT-B/16: 36 scatters of 4.8 MB, 9.5% of its step). A `Split`'s gradient
//! is one `Concat`. Each `Gather` becomes a `Squeeze` of its part, keeping its output's
//! name; the new values' shapes are added to the measured ones, so nothing is probed
//! again.
//!
//! Where the tensor is a `Transpose` (and a `Squeeze` of it) read by the `Gather`s alone,
//! and each part is the same values in the same order before the transpose as after it
//! (the axes it moves are of size 1 in a part), the `Split` takes the transpose's input
//! apart instead, and the transpose goes: `nn.MultiheadAttention` transposes its packed
//! projection `[S, B, 3, E]` to `[3, S, B, E]` before taking q, k and v (ViT-B/16: a
//! 4.8 MB copy each way, each layer).

use std::collections::{BTreeMap, HashMap};

mod untransposed;

use crate::graph::ir::{
    attr_i, axis_index, int_attr, make_node, tensor_attr, Graph, Metas, ValueMeta,
};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};
use untransposed::{untransposed, Reads, Source};

/// Rewrites each tensor of `g` whose constant-position `Gather`s (a scalar index each, on
/// one axis) take every position of that axis exactly once; adds the new values to
/// `metas`. Returns how many tensors.
pub fn gathers_as_split(g: &mut Graph, metas: &mut Metas) -> usize {
    let consts = g.constants();
    let groups = find(g, metas, &consts);
    // Where each group's parts come from, all read before the graph changes.
    let sources: Vec<Source> = {
        let reads = Reads::of(g, &consts);
        groups
            .iter()
            .map(|((data, axis), at)| {
                untransposed(&reads, metas, (data, *axis), at.len())
                    .unwrap_or_else(|| Source::of(data, *axis))
            })
            .collect()
    };
    let dead: Vec<String> = sources.iter().flat_map(|s| s.replaced.clone()).collect();
    // Each group's `Gather`s are replaced in place; the `Split`s go in afterwards, the
    // last first, so that no insertion moves a place still to come.
    let mut inserts: Vec<(usize, Vec<NodeProto>)> = groups
        .values()
        .zip(sources)
        .enumerate()
        .map(|(i, (at, source))| apply(g, metas, source, at, i))
        .collect();
    inserts.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    for (at, nodes) in inserts {
        g.nodes.splice(at..at, nodes);
    }
    g.nodes
        .retain(|n| !n.output.first().is_some_and(|o| dead.contains(o)));
    groups.len()
}

/// The `Gather` nodes of each (tensor, axis) that fit, by position: node index per
/// position, in position order.
type Groups = BTreeMap<(String, usize), Vec<usize>>;

fn find(g: &Graph, metas: &Metas, consts: &HashMap<String, Tensor>) -> Groups {
    let mut by: BTreeMap<(String, usize), BTreeMap<usize, Vec<usize>>> = BTreeMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some((data, axis, pos)) = constant_gather(n, metas, consts) {
            by.entry((data, axis))
                .or_default()
                .entry(pos)
                .or_default()
                .push(i);
        }
    }
    by.into_iter()
        .filter_map(|((data, axis), at)| {
            let dim = *metas.get(&data)?.shape.get(axis)?;
            let whole = dim >= 2 && at.len() == dim && at.values().all(|v| v.len() == 1);
            whole.then(|| ((data, axis), at.into_values().map(|v| v[0]).collect()))
        })
        .collect()
}

/// (data, axis, position) of a `Gather` of a scalar constant position.
fn constant_gather(
    n: &NodeProto,
    metas: &Metas,
    consts: &HashMap<String, Tensor>,
) -> Option<(String, usize, usize)> {
    let at = position_read(n, metas, consts).filter(|at| !at.keeps_axis)?;
    Some((n.input[0].clone(), at.axis, at.position))
}

/// Where a `Gather` of a constant position reads.
pub(crate) struct Position {
    /// Its data input's axis.
    pub axis: usize,
    /// The position, in `0..dim`.
    pub position: usize,
    /// Whether its output keeps the axis (an index of shape `[1]`, not a scalar).
    pub keeps_axis: bool,
}

/// The axis and position of a `Gather` whose index is a constant scalar or `[k]`.
pub(crate) fn position_read(
    n: &NodeProto,
    metas: &Metas,
    consts: &HashMap<String, Tensor>,
) -> Option<Position> {
    if n.op_type != "Gather" || !n.domain.is_empty() || n.input.len() != 2 {
        return None;
    }
    let shape = &metas.get(&n.input[0])?.shape;
    let axis = axis_index(attr_i(n, "axis").unwrap_or(0), shape.len())?;
    let dim = shape[axis] as i64;
    let index = consts.get(&n.input[1])?;
    let keeps_axis = match index.shape.as_slice() {
        [] => false,
        [1] => true,
        _ => return None,
    };
    let k = index.to_i64_vec()?[0];
    let k = if k < 0 { k + dim } else { k };
    (0..dim).contains(&k).then_some(Position {
        axis,
        position: k as usize,
        keeps_axis,
    })
}

/// Replaces the `Gather` of position k by a `Squeeze` of part k of a `Split` of the
/// source, and returns where the `Split` (with its constants) goes: before the first
/// `Gather`.
fn apply(
    g: &mut Graph,
    metas: &mut Metas,
    source: Source,
    at: &[usize],
    i: usize,
) -> (usize, Vec<NodeProto>) {
    let (data, axis) = (source.data.as_str(), source.axis);
    let base = format!("{data}/gathered{i}");
    let parts: Vec<String> = (0..at.len()).map(|k| format!("{base}/part{k}")).collect();
    let mut meta = metas[data].clone();
    meta.shape[axis] = 1;
    for p in &parts {
        metas.insert(p.clone(), meta.clone());
    }
    let axes = format!("{base}/axes");
    for (k, &node) in at.iter().enumerate() {
        let n = &g.nodes[node];
        let squeeze = make_node(
            "Squeeze",
            &n.name,
            &[&parts[k], &axes],
            &[&n.output[0]],
            vec![],
        );
        g.nodes[node] = squeeze;
    }
    // Sizes as an input: opset 18 on wants them or `num_outputs`, earlier opsets them.
    let sizes = format!("{base}/sizes");
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    let split = make_node(
        "Split",
        &base,
        &[data, &sizes],
        &refs,
        vec![int_attr("axis", axis as i64)],
    );
    let nodes = vec![
        i64_constant(metas, &axes, source.squeezed),
        i64_constant(metas, &sizes, vec![1; at.len()]),
        split,
    ];
    (at.iter().copied().min().unwrap_or(0), nodes)
}

/// A `Constant` node of the 1-D int64 `values`, named `name`, its value's shape in
/// `metas`.
pub(crate) fn i64_constant(metas: &mut Metas, name: &str, values: Vec<i64>) -> NodeProto {
    let meta = ValueMeta {
        dtype: DType::I64,
        shape: vec![values.len()],
    };
    metas.insert(name.to_string(), meta);
    let value = Tensor::i64(vec![values.len()], values).expect("a 1-D tensor");
    make_node(
        "Constant",
        name,
        &[],
        &[name],
        vec![tensor_attr("value", value.to_proto(name))],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalar(g: &mut Graph, name: &str, v: i64) {
        let t = Tensor::i64(vec![], vec![v]).unwrap();
        let node = make_node(
            "Constant",
            name,
            &[],
            &[name],
            vec![tensor_attr("value", t.to_proto(name))],
        );
        g.nodes.push(node);
    }

    #[test]
    fn every_position_once_becomes_a_split_and_a_partial_set_stays() {
        let mut g = Graph::default();
        for (name, v) in [("i0", 0), ("i1", 1), ("i2", -1)] {
            scalar(&mut g, name, v);
        }
        g.nodes.push(make_node("Relu", "r", &["x"], &["p"], vec![]));
        for (i, idx) in ["i0", "i1", "i2"].iter().enumerate() {
            let out = format!("q{i}");
            g.nodes
                .push(make_node("Gather", &out, &["p", idx], &[&out], vec![]));
        }
        // Only positions 0 and 1 of `y`'s axis 1: kept.
        g.nodes.push(make_node(
            "Gather",
            "y0",
            &["y", "i0"],
            &["z0"],
            vec![int_attr("axis", 1)],
        ));
        g.nodes.push(make_node(
            "Gather",
            "y1",
            &["y", "i1"],
            &["z1"],
            vec![int_attr("axis", 1)],
        ));
        let mut metas: Metas = [
            ("x", ValueMeta::f32(&[3, 4, 5])),
            ("p", ValueMeta::f32(&[3, 4, 5])),
            ("y", ValueMeta::f32(&[2, 3])),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_string(), m))
        .collect();
        assert_eq!(gathers_as_split(&mut g, &mut metas), 1);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        let want = [
            "Constant", "Constant", "Constant", "Relu", "Constant", "Constant", "Split", "Squeeze",
            "Squeeze", "Squeeze", "Gather", "Gather",
        ];
        assert_eq!(ops, want);
        // Position -1 is part 2; the squeezes keep the gathers' outputs.
        assert_eq!(g.nodes[9].input[0], "p/gathered0/part2");
        assert_eq!(g.nodes[9].output[0], "q2");
        assert_eq!(metas["p/gathered0/part1"].shape, [1, 4, 5]);
    }

    /// A `Split`'s input and axis, and the axes its parts' `Squeeze`s take.
    type SplitOf = (String, i64, Vec<i64>);

    /// `nn.MultiheadAttention`'s packed projection: `x` `[1, S, B, 3, E]` transposed to
    /// `[3, S, B, 1, E]` and squeezed to `[3, S, B, E]`, then q, k, v at 0, 1, 2 (with
    /// `perm` that order; `dims` `x`'s shape). Returns the ops after the rewrite and
    /// the first `Split`'s input and axis, with the parts' squeezed axes.
    fn packed(perm: &[i64], dims: &[usize]) -> (Vec<String>, Option<SplitOf>) {
        let mut g = Graph::default();
        for (name, v) in [("i0", 0), ("i1", 1), ("i2", 2)] {
            scalar(&mut g, name, v);
        }
        let t = Tensor::i64(vec![1], vec![3]).unwrap();
        g.nodes.push(make_node(
            "Constant",
            "sq",
            &[],
            &["sq"],
            vec![tensor_attr("value", t.to_proto("sq"))],
        ));
        let perm_attr = crate::graph::ir::ints_attr("perm", perm);
        g.nodes
            .push(make_node("Transpose", "t", &["x"], &["t"], vec![perm_attr]));
        g.nodes
            .push(make_node("Squeeze", "s", &["t", "sq"], &["p"], vec![]));
        for (i, idx) in ["i0", "i1", "i2"].iter().enumerate() {
            let out = format!("q{i}");
            g.nodes
                .push(make_node("Gather", &out, &["p", idx], &[&out], vec![]));
        }
        let turned: Vec<usize> = perm.iter().map(|&a| dims[a as usize]).collect();
        let mut squeezed = turned.clone();
        squeezed.remove(3);
        let mut metas: Metas = [
            ("x", ValueMeta::f32(dims)),
            ("t", ValueMeta::f32(&turned)),
            ("p", ValueMeta::f32(&squeezed)),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_string(), m))
        .collect();
        assert_eq!(gathers_as_split(&mut g, &mut metas), 1);
        let consts = g.constants();
        let split = g.nodes.iter().find(|n| n.op_type == "Split").map(|n| {
            let part = |m: &&NodeProto| m.op_type == "Squeeze" && m.input[0] == n.output[0];
            let squeeze = g.nodes.iter().find(part).unwrap();
            let axes = consts[&squeeze.input[1]].to_i64_vec().unwrap();
            (n.input[0].clone(), attr_i(n, "axis").unwrap(), axes)
        });
        (g.nodes.iter().map(|n| n.op_type.clone()).collect(), split)
    }

    #[test]
    fn a_transpose_moving_only_axes_of_size_one_in_a_part_is_split_before() {
        let (ops, split) = packed(&[3, 1, 2, 0, 4], &[1, 5, 2, 3, 4]);
        assert!(!ops.iter().any(|o| o == "Transpose"), "{ops:?}");
        assert_eq!(ops.iter().filter(|o| *o == "Squeeze").count(), 3, "{ops:?}");
        // x split along its axis 3; each part [1, 5, 2, 1, 4] loses axes 0 and 3: the
        // gathers' [5, 2, 4], the same values in the same order.
        assert_eq!(split, Some(("x".to_string(), 3, vec![0, 3])));
        // A transpose that also swaps two axes of size > 1 (5 and 2) stays, and the
        // Split takes the squeezed tensor apart as before.
        let (ops, split) = packed(&[3, 2, 1, 0, 4], &[1, 5, 2, 3, 4]);
        assert!(ops.iter().any(|o| o == "Transpose"), "{ops:?}");
        assert_eq!(split, Some(("p".to_string(), 0, vec![0])));
    }
}
