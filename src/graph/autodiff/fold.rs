//! Folding a weight gradient's transpose into the product that makes it, and dropping
//! the reshapes nothing reads.
//!
//! A linear layer exported as `x @ Transpose(W)` gets the gradient `Transpose(op(A) @
//! op(B))` for `W`: the product of the `MatMul` rule, then the `Transpose` rule's
//! transpose, a full pass over the weight's values. Since `(op(A) op(B))^T = op(B)^T
//! op(A)^T`, the product with its operands swapped and their transpose flags flipped
//! gives `W`'s gradient directly (`com.microsoft.FusedMatMul` has the flags).

use std::collections::HashMap;

use crate::graph::ir::{attr_i, attr_ints, int_attr};
use crate::onnx::proto::NodeProto;

/// Rewrites every `Transpose(perm = [1, 0])` whose input is a `FusedMatMul` output read
/// by nothing else into that product itself, transposed; returns the indices of the
/// transposes removed (in increasing order) so the caller drops their anchors too.
///
/// Only rank-2 products qualify (a `[1, 0]` permutation fixes the rank), so the
/// operands are matrices and no batch axes move.
pub(super) fn fold_transposes(nodes: &mut Vec<NodeProto>, keep: &[&str]) -> Vec<usize> {
    let mut readers: HashMap<&str, usize> = HashMap::new();
    for n in nodes.iter() {
        for i in &n.input {
            *readers.entry(i.as_str()).or_default() += 1;
        }
    }
    let producer: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let mut folds: Vec<(usize, usize)> = Vec::new();
    for (t, n) in nodes.iter().enumerate() {
        if n.op_type != "Transpose" || attr_ints(n, "perm").as_deref() != Some(&[1, 0]) {
            continue;
        }
        let x = n.input[0].as_str();
        let Some(&p) = producer.get(x) else { continue };
        let prod = &nodes[p];
        let single_use = readers.get(x) == Some(&1) && !keep.contains(&x);
        if prod.op_type == "FusedMatMul" && prod.domain == "com.microsoft" && single_use {
            folds.push((p, t));
        }
    }
    for &(p, t) in &folds {
        let out = nodes[t].output[0].clone();
        let prod = &mut nodes[p];
        let ta = attr_i(prod, "transA").unwrap_or(0) != 0;
        let tb = attr_i(prod, "transB").unwrap_or(0) != 0;
        prod.input.swap(0, 1);
        prod.attribute
            .retain(|a| a.name != "transA" && a.name != "transB");
        prod.attribute.push(int_attr("transA", i64::from(!tb)));
        prod.attribute.push(int_attr("transB", i64::from(!ta)));
        prod.output[0] = out;
    }
    let mut removed: Vec<usize> = folds.iter().map(|&(_, t)| t).collect();
    removed.sort_unstable();
    for &t in removed.iter().rev() {
        nodes.remove(t);
    }
    removed
}

/// Removes the `Reshape` and `Constant` nodes whose outputs nothing reads (left by
/// [`super::emit::Emitter::reshape`] reading a reshape's input instead of it), until none
/// is left; returns the indices removed (in increasing order), as [`fold_transposes`].
pub(super) fn drop_unread(nodes: &mut Vec<NodeProto>, keep: &[&str]) -> Vec<usize> {
    let mut gone = vec![false; nodes.len()];
    loop {
        let mut readers: HashMap<&str, usize> = HashMap::new();
        for (_, n) in nodes.iter().enumerate().filter(|(i, _)| !gone[*i]) {
            for i in &n.input {
                *readers.entry(i.as_str()).or_default() += 1;
            }
        }
        let unread = |n: &NodeProto| {
            matches!(n.op_type.as_str(), "Reshape" | "Constant")
                && n.domain.is_empty()
                && n.output
                    .iter()
                    .all(|o| !readers.contains_key(o.as_str()) && !keep.contains(&o.as_str()))
        };
        let now: Vec<usize> = (0..nodes.len())
            .filter(|&i| !gone[i] && unread(&nodes[i]))
            .collect();
        if now.is_empty() {
            break;
        }
        now.into_iter().for_each(|i| gone[i] = true);
    }
    let removed: Vec<usize> = (0..nodes.len()).filter(|&i| gone[i]).collect();
    let mut i = 0;
    nodes.retain(|_| {
        i += 1;
        !gone[i - 1]
    });
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::{ints_attr, make_node};

    fn fused(a: &str, b: &str, out: &str, ta: i64, tb: i64) -> NodeProto {
        let mut n = make_node(
            "FusedMatMul",
            "mm",
            &[a, b],
            &[out],
            vec![int_attr("transA", ta), int_attr("transB", tb)],
        );
        n.domain = "com.microsoft".into();
        n
    }

    fn transpose(x: &str, out: &str) -> NodeProto {
        make_node(
            "Transpose",
            "t",
            &[x],
            &[out],
            vec![ints_attr("perm", &[1, 0])],
        )
    }

    #[test]
    fn a_transposed_product_read_once_becomes_the_swapped_product() {
        let mut nodes = vec![
            fused("A", "B", "x", 1, 0),
            transpose("x", "y"),
            make_node("Identity", "id", &["y"], &["W_grad"], vec![]),
        ];
        assert_eq!(fold_transposes(&mut nodes, &["W_grad"]), vec![1]);
        assert_eq!(nodes.len(), 2);
        let p = &nodes[0];
        assert_eq!(p.input, ["B", "A"]);
        assert_eq!(p.output, ["y"]);
        // (A^T B)^T = B^T A: transA = !transB, transB = !transA.
        assert_eq!(attr_i(p, "transA"), Some(1));
        assert_eq!(attr_i(p, "transB"), Some(0));
    }

    #[test]
    fn products_read_elsewhere_or_kept_and_other_permutations_stay() {
        let shared = vec![
            fused("A", "B", "x", 0, 1),
            transpose("x", "y"),
            make_node("Neg", "n", &["x"], &["z"], vec![]),
        ];
        let mut nodes = shared.clone();
        assert!(fold_transposes(&mut nodes, &[]).is_empty());
        assert_eq!(nodes, shared);

        let kept = vec![fused("A", "B", "x", 0, 1), transpose("x", "y")];
        let mut nodes = kept.clone();
        assert!(fold_transposes(&mut nodes, &["x"]).is_empty());
        assert_eq!(nodes, kept);

        let mut other = transpose("x", "y");
        other.attribute = vec![ints_attr("perm", &[0, 2, 1])];
        let batched = vec![fused("A", "B", "x", 0, 1), other];
        let mut nodes = batched.clone();
        assert!(fold_transposes(&mut nodes, &[]).is_empty());
        assert_eq!(nodes, batched);
    }
}

#[cfg(test)]
mod unread {
    use super::*;
    use crate::graph::ir::make_node;

    #[test]
    fn unread_reshapes_and_their_shapes_go_and_nothing_else() {
        let mut nodes = vec![
            make_node("Constant", "c1", &[], &["s1"], vec![]),
            make_node("Reshape", "r1", &["x", "s1"], &["y"], vec![]),
            make_node("Constant", "c2", &[], &["s2"], vec![]),
            make_node("Reshape", "r2", &["x", "s2"], &["z"], vec![]),
            make_node("Neg", "n", &["z"], &["w"], vec![]),
            make_node("Reshape", "r3", &["x", "s2"], &["kept"], vec![]),
            make_node("Relu", "unread_but_not_a_reshape", &["x"], &["v"], vec![]),
        ];
        assert_eq!(drop_unread(&mut nodes, &["kept"]), vec![0, 1]);
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["c2", "r2", "n", "r3", "unread_but_not_a_reshape"]);
    }
}
