//! `MatMul(x, Transpose(W))` of a matrix `W` as one `com.microsoft.FusedMatMul(x, W,
//! transB = 1)`: how `torch.onnx.export` without constant folding writes every
//! `nn.Linear` (BERT, ViT, Llama; GPT-2's `Conv1D` is a plain `MatMul`).
//!
//! The transposed weight is a value that depends on the parameters alone, so ONNX
//! Runtime's order runs every such `Transpose` at the start of a forward, and each copy
//! lives until its `MatMul`, many layers later: a second copy of all the model's
//! matrices at the forward's peak (2.3 GB of a 1-billion-parameter Llama's probe, against
//! 10 MB of activations). The fused product reads `W` in place. Its gradient
//! (`autodiff::rules::linalg::fused_matmul`) reads `W` and `x`, as `MatMul`'s does.
//!
//! A graph for ONNX Runtime's contrib operators only (`runtime.standard_ops_only` off).

use std::collections::{HashMap, HashSet};

use crate::graph::ir::{attr_ints, float_attr, int_attr, Graph, Metas};

/// Replaces each `MatMul` whose second input is `Transpose` of a matrix (swapping its
/// two axes) by `FusedMatMul` reading the matrix; drops the `Transpose`s nothing reads
/// any more. Returns how many products it replaced.
pub fn fuse_transposed_weights(g: &mut Graph, metas: &Metas) -> usize {
    let producers: HashMap<&str, usize> = g
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let rank = |v: &str| metas.get(v).map(|m| m.shape.len());
    let mut swaps: Vec<(usize, String)> = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if n.op_type != "MatMul" || !n.domain.is_empty() || n.input.len() != 2 {
            continue;
        }
        let Some(&t) = producers.get(n.input[1].as_str()) else {
            continue;
        };
        let tr = &g.nodes[t];
        let perm = attr_ints(tr, "perm").unwrap_or_else(|| vec![1, 0]);
        let w = tr.input.first().map_or("", String::as_str);
        let fits = tr.op_type == "Transpose"
            && tr.domain.is_empty()
            && perm == [1, 0]
            && rank(w) == Some(2)
            && rank(&n.input[0]).is_some_and(|r| r >= 2);
        if fits {
            swaps.push((i, w.to_string()));
        }
    }
    for (i, w) in &swaps {
        let n = &mut g.nodes[*i];
        n.op_type = "FusedMatMul".into();
        n.domain = "com.microsoft".into();
        n.input[1] = w.clone();
        n.attribute = vec![
            int_attr("transA", 0),
            int_attr("transB", 1),
            float_attr("alpha", 1.0),
        ];
    }
    if !swaps.is_empty() {
        g.import_domain("com.microsoft", 1);
        drop_unread_transposes(g);
    }
    swaps.len()
}

/// Removes `Transpose` nodes whose output no node and no graph output reads.
fn drop_unread_transposes(g: &mut Graph) {
    let read: HashSet<String> = g
        .nodes
        .iter()
        .flat_map(|n| n.input.iter().cloned())
        .chain(g.outputs.iter().map(|o| o.name.clone()))
        .collect();
    g.nodes
        .retain(|n| n.op_type != "Transpose" || n.output.iter().any(|o| read.contains(o)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::{make_node, ValueMeta};

    #[test]
    fn a_linear_layer_reads_its_weight_in_place() {
        let mut g = Graph {
            nodes: vec![
                make_node("Transpose", "t1", &["w"], &["wt"], vec![]),
                make_node("MatMul", "m1", &["x", "wt"], &["y"], vec![]),
                // A transpose of activations (rank 3) stays.
                make_node("Transpose", "t2", &["y"], &["yt"], vec![]),
                make_node("MatMul", "m2", &["x", "yt"], &["z"], vec![]),
            ],
            ..Default::default()
        };
        let metas: Metas = [
            ("w", ValueMeta::f32(&[8, 4])),
            ("wt", ValueMeta::f32(&[4, 8])),
            ("x", ValueMeta::f32(&[2, 3, 4])),
            ("y", ValueMeta::f32(&[2, 3, 8])),
            ("yt", ValueMeta::f32(&[8, 3, 2])),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_string(), m))
        .collect();
        assert_eq!(fuse_transposed_weights(&mut g, &metas), 1);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["FusedMatMul", "Transpose", "MatMul"]);
        assert_eq!(g.nodes[0].input, ["x", "w"]);
        assert_eq!(g.nodes[0].domain, "com.microsoft");
    }
}
