//! Sums and means over the last axis written as products with a constant vector, for a
//! training graph that runs on a GPU in a fixed order.
//!
//! With `use_deterministic_compute` (pipetrain's `runtime.deterministic`, on by default)
//! ONNX Runtime's CUDA `ReduceSum` and `ReduceMean` leave their own row kernels for
//! cuDNN's general reduction. On an H200 that ran GPT-2 small's row sums (LayerNorm's
//! backward means over 768 values, softmax's backward sums over 1024) at 0.2-0.4 TB/s:
//! 74 reductions, 11 ms of the device's 141 ms in a step (Nsight Compute, 2026-11-27;
//! `benches/gpu/RESULTS.md`). A product `X[..., n] @ v[n]` is one cuBLAS matrix-vector
//! product instead, memory-bound, summing in a fixed order: `v` holds ones for a sum and
//! `1/n` for a mean. cuBLAS's products, unlike a reduction with atomics, give the same
//! bits on every run.
//!
//! The rewrite keeps every node where it is (stage cuts, anchors and `forward_len` hold
//! node indices): the reduction becomes the `MatMul`, and the vectors are `Constant`
//! nodes put first in the graph, as `graph/tied.rs` puts its nodes.

use std::collections::HashMap;

use super::ir::{attr_i, attr_ints, constant_value, make_node, tensor_attr, ValueMeta};
use super::training::TrainingGraph;
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor, TensorData};

/// Rewrites each float32 `ReduceSum`/`ReduceMean` of `tg` over its input's last axis
/// alone as a product with a constant vector (see the module doc); returns how many.
pub fn row_sums_as_products(tg: &mut TrainingGraph) -> usize {
    let producers: HashMap<String, usize> = tg
        .graph
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.clone(), i)))
        .collect();
    let mut vectors: HashMap<(usize, bool, bool), String> = HashMap::new();
    let mut constants = Vec::new();
    let mut rewritten = 0;
    for i in 0..tg.graph.nodes.len() {
        let node = &tg.graph.nodes[i];
        let Some((n, keep)) = last_axis_reduction(node, &tg.graph.nodes, &producers, tg) else {
            continue;
        };
        let mean = node.op_type == "ReduceMean";
        let name = vectors
            .entry((n, keep, mean))
            .or_insert_with(|| {
                let (node, meta) = vector(n, keep, mean);
                let name = node.output[0].clone();
                constants.push(node);
                tg.metas.insert(name.clone(), meta);
                name
            })
            .clone();
        let node = &mut tg.graph.nodes[i];
        let x = node.input[0].clone();
        *node = make_node(
            "MatMul",
            &node.name,
            &[&x, &name],
            &[&node.output[0]],
            vec![],
        );
        rewritten += 1;
    }
    let k = constants.len();
    if k > 0 {
        tg.graph.nodes.splice(0..0, constants);
        tg.forward_len += k;
        for anchor in &mut tg.anchors {
            *anchor += k;
        }
    }
    rewritten
}

/// The `Constant` node of the vector a product with which sums (`mean`: averages) rows
/// of `n` values, `[n, 1]` where the reduction keeps its axis (else `[n]`), and its type.
fn vector(n: usize, keep: bool, mean: bool) -> (NodeProto, ValueMeta) {
    let name = format!(
        "row_sum_vector_{n}{}{}",
        ["", "_mean"][usize::from(mean)],
        ["", "_col"][usize::from(keep)]
    );
    let shape = if keep { vec![n, 1] } else { vec![n] };
    let value = if mean { 1.0 / n as f32 } else { 1.0 };
    let t = Tensor {
        shape: shape.clone(),
        data: TensorData::F32(vec![value; n]),
    };
    let attr = tensor_attr("value", t.to_proto(&name));
    let node = make_node("Constant", &name, &[], &[&name], vec![attr]);
    let meta = ValueMeta {
        dtype: DType::F32,
        shape,
    };
    (node, meta)
}

/// For a float32 `ReduceSum`/`ReduceMean` over its input's last axis alone (axes from the
/// attribute or a `Constant` input): the axis's length and whether the node keeps it.
fn last_axis_reduction(
    node: &NodeProto,
    nodes: &[NodeProto],
    producers: &HashMap<String, usize>,
    tg: &TrainingGraph,
) -> Option<(usize, bool)> {
    if !node.domain.is_empty() || !matches!(node.op_type.as_str(), "ReduceSum" | "ReduceMean") {
        return None;
    }
    let x = tg.metas.get(node.input.first()?)?;
    let rank = x.shape.len();
    if x.dtype != DType::F32 || rank == 0 || attr_i(node, "noop_with_empty_axes") == Some(1) {
        return None;
    }
    let axes = match node.input.get(1).filter(|a| !a.is_empty()) {
        Some(a) => {
            let c = &nodes[*producers.get(a)?];
            (c.op_type == "Constant").then_some(())?;
            constant_value(c)?.as_i64()?.to_vec()
        }
        None => attr_ints(node, "axes")?,
    };
    let last = |a: &i64| *a == rank as i64 - 1 || *a == -1;
    if axes.len() != 1 || !last(&axes[0]) {
        return None;
    }
    let n = x.shape[rank - 1];
    (n > 0).then_some((n, attr_i(node, "keepdims").unwrap_or(1) != 0))
}
