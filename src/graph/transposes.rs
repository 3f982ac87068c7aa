//! Transposes of merged axes as transposes of the axes themselves, so that the attention
//! kernel reads them through strides (`graph::fusion`, attention) instead of ONNX Runtime
//! copying them.
//!
//! `torch.nn.MultiheadAttention` (torchvision's ViT) turns each of q, k and v from
//! `[S, B, E]` into `[B, H, S, D]` as `Reshape` to `[S, B*H, D]`, `Transpose` to
//! `[B*H, S, D]` and `Reshape` to `[B, H, S, D]`, then transposes k once more. Each is a
//! copy of the layer's activations forward and backward (ViT-B/16: about 80 ms of a
//! 2.8 s step). Both reshapes only merge and split axes, so the three nodes are one
//! `Reshape` of the input to the finest axes of both (`[S, B, H, D]`) and one `Transpose`
//! of those (`[1, 2, 0, 3]`); and a transpose of a transpose is one transpose. The values
//! and their names stay; the new values' shapes are added to the measured ones.

use std::collections::HashMap;
use std::ops::Range;

use crate::graph::gathers::i64_constant;
use crate::graph::ir::{attr_ints, ints_attr, make_node, Graph, Metas, ValueMeta};

/// Rewrites the `Reshape`-`Transpose`-`Reshape` chains and the transposes of transposes
/// of `g` (see the module doc); returns how many of each.
pub fn merged_transposes(g: &mut Graph, metas: &mut Metas) -> (usize, usize) {
    let mut chained = 0;
    for (ra, t, rb) in chains(g, metas) {
        if rewrite(g, metas, (ra, t, rb)) {
            chained += 1;
        }
    }
    (chained, fold_transposes(g))
}

/// `(first reshape, transpose, second reshape)` node triples, each value read by the
/// next node alone.
fn chains(g: &Graph, metas: &Metas) -> Vec<(usize, usize, usize)> {
    let (producers, consumers) = (g.producers(), g.consumers());
    let only = |v: &str, reader: usize| {
        consumers.get(v).is_some_and(|c| c == &[reader]) && !g.outputs.iter().any(|o| o.name == v)
    };
    let is = |i: usize, op: &str| g.nodes[i].op_type == op && g.nodes[i].domain.is_empty();
    (0..g.nodes.len())
        .filter(|&rb| is(rb, "Reshape") && metas.contains_key(&g.nodes[rb].output[0]))
        .filter_map(|rb| {
            let t = *producers.get(g.nodes[rb].input[0].as_str())?;
            let ra = *producers.get(g.nodes[t].input.first()?.as_str())?;
            let fits = is(t, "Transpose") && is(ra, "Reshape");
            let read = only(&g.nodes[t].output[0], rb) && only(&g.nodes[ra].output[0], t);
            (fits && read).then_some((ra, t, rb))
        })
        .collect()
}

/// Rewrites one chain in place where both reshapes only merge and split axes and the
/// second merges none of the transposed axes: the first reshape's place takes the new
/// shape's constant, the transpose's the reshape to the finest axes, the second
/// reshape's the transpose. Returns whether it did.
fn rewrite(g: &mut Graph, metas: &mut Metas, (ra, t, rb): (usize, usize, usize)) -> bool {
    // An earlier rewrite may have taken a node of this chain (its second reshape this
    // one's first).
    let ops = [ra, t, rb].map(|i| g.nodes[i].op_type.as_str());
    if ops != ["Reshape", "Transpose", "Reshape"] {
        return false;
    }
    let x = g.nodes[ra].input[0].clone();
    let y = g.nodes[rb].output[0].clone();
    let shape = |v: &str| metas.get(v).map(|m| m.shape.clone());
    let (Some(s0), Some(s1), Some(s2)) = (shape(&x), shape(&g.nodes[ra].output[0]), shape(&y))
    else {
        return false;
    };
    let perm = match attr_ints(&g.nodes[t], "perm") {
        Some(p) => p.iter().map(|&a| a as usize).collect::<Vec<_>>(),
        None => (0..s1.len()).rev().collect(),
    };
    if perm.len() != s1.len() || perm.iter().any(|&a| a >= s1.len()) {
        return false;
    }
    let Some((atoms, _, groups)) = refine(&s0, &s1) else {
        return false;
    };
    let order: Vec<usize> = perm.iter().flat_map(|&a| groups[a].clone()).collect();
    let turned: Vec<usize> = order.iter().map(|&i| atoms[i]).collect();
    if turned != s2 {
        return false;
    }
    let dtype = metas[&x].dtype;
    let (fine, fine_shape) = (format!("{y}/finest"), format!("{y}/finest_shape"));
    let dims: Vec<i64> = atoms.iter().map(|&d| d as i64).collect();
    g.nodes[ra] = i64_constant(metas, &fine_shape, dims);
    let reshape = make_node(
        "Reshape",
        &format!("{y}/finest"),
        &[&x, &fine_shape],
        &[&fine],
        vec![],
    );
    g.nodes[t] = reshape;
    let order: Vec<i64> = order.iter().map(|&i| i as i64).collect();
    let name = g.nodes[rb].name.clone();
    g.nodes[rb] = make_node(
        "Transpose",
        &name,
        &[&fine],
        &[&y],
        vec![ints_attr("perm", &order)],
    );
    metas.insert(
        fine,
        ValueMeta {
            dtype,
            shape: atoms,
        },
    );
    true
}

/// Finest axes, and the atoms each axis of one shape and of the other spans.
type Refined = (Vec<usize>, Vec<Range<usize>>, Vec<Range<usize>>);

/// The finest axes both `a` and `b` split into (each a divisor of the other's), and the
/// atoms each axis of `a` and of `b` spans; `None` where they do not refine each other
/// (a size-1 axis included, whose place among the atoms is not unique).
fn refine(a: &[usize], b: &[usize]) -> Option<Refined> {
    if a.is_empty() || b.is_empty() || a.iter().chain(b).any(|&d| d < 2) {
        return None;
    }
    let (mut atoms, mut ga, mut gb) = (Vec::new(), Vec::new(), Vec::new());
    let (mut i, mut j, mut ra, mut rb, mut from_a, mut from_b) = (0, 0, a[0], b[0], 0, 0);
    loop {
        let m = ra.min(rb);
        if ra % m != 0 || rb % m != 0 {
            return None;
        }
        atoms.push(m);
        (ra, rb) = (ra / m, rb / m);
        if ra == 1 {
            ga.push(from_a..atoms.len());
            (from_a, i) = (atoms.len(), i + 1);
            ra = a.get(i).copied().unwrap_or(1);
        }
        if rb == 1 {
            gb.push(from_b..atoms.len());
            (from_b, j) = (atoms.len(), j + 1);
            rb = b.get(j).copied().unwrap_or(1);
        }
        match (i == a.len(), j == b.len()) {
            (true, true) => return Some((atoms, ga, gb)),
            (false, false) => {}
            _ => return None,
        }
    }
}

/// A `Transpose` of a `Transpose` read by it alone as one; returns how many went.
fn fold_transposes(g: &mut Graph) -> usize {
    let mut gone = Vec::new();
    let consumers: HashMap<String, Vec<usize>> = g
        .consumers()
        .into_iter()
        .map(|(v, c)| (v.to_string(), c))
        .collect();
    let producers: HashMap<String, usize> = g
        .producers()
        .into_iter()
        .map(|(v, p)| (v.to_string(), p))
        .collect();
    let is =
        |g: &Graph, i: usize| g.nodes[i].op_type == "Transpose" && g.nodes[i].domain.is_empty();
    for outer in 0..g.nodes.len() {
        if !is(g, outer) {
            continue;
        }
        let Some(&inner) = producers.get(&g.nodes[outer].input[0]) else {
            continue;
        };
        let mid = &g.nodes[inner].output[0];
        let alone = consumers.get(mid).is_some_and(|c| c == &[outer])
            && !g.outputs.iter().any(|o| &o.name == mid);
        let perms = (
            attr_ints(&g.nodes[inner], "perm"),
            attr_ints(&g.nodes[outer], "perm"),
        );
        let (true, true, (Some(p1), Some(p2))) = (is(g, inner), alone, perms) else {
            continue;
        };
        if p1.len() != p2.len() || p2.iter().any(|&a| a < 0 || a as usize >= p1.len()) {
            continue;
        }
        let perm: Vec<i64> = p2.iter().map(|&a| p1[a as usize]).collect();
        let source = g.nodes[inner].input[0].clone();
        let n = &mut g.nodes[outer];
        n.input[0] = source;
        n.attribute = vec![ints_attr("perm", &perm)];
        gone.push(inner);
    }
    let count = gone.len();
    let mut i = 0;
    g.nodes.retain(|_| {
        i += 1;
        !gone.contains(&(i - 1))
    });
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refining_finds_the_finest_axes_or_none() {
        let (atoms, ga, gb) = refine(&[197, 8, 768], &[197, 96, 64]).unwrap();
        assert_eq!(atoms, [197, 8, 12, 64]);
        assert_eq!((ga, gb), (vec![0..1, 1..2, 2..4], vec![0..1, 1..3, 3..4]));
        assert_eq!(refine(&[2, 6], &[4, 3]).unwrap().0, [2, 2, 3]);
        assert!(refine(&[4, 6], &[6, 4]).is_none());
        assert!(refine(&[6], &[4]).is_none());
        assert!(refine(&[1, 6], &[6]).is_none());
    }

    /// ViT's q: `[S, B, E]` -> `[S, B*H, D]` -> `[B*H, S, D]` -> `[B, H, S, D]`, then a
    /// transpose of its last two axes (k): one reshape and one transpose.
    #[test]
    fn a_transpose_of_merged_axes_is_one_of_the_axes_and_transposes_fold() {
        let mut g = Graph::default();
        g.nodes
            .push(make_node("Reshape", "ra", &["x", "s1"], &["a"], vec![]));
        let swap = ints_attr("perm", &[1, 0, 2]);
        g.nodes
            .push(make_node("Transpose", "t", &["a"], &["b"], vec![swap]));
        g.nodes
            .push(make_node("Reshape", "rb", &["b", "s2"], &["y"], vec![]));
        let last = ints_attr("perm", &[0, 1, 3, 2]);
        g.nodes
            .push(make_node("Transpose", "k", &["y"], &["kt"], vec![last]));
        let mut metas: Metas = [
            ("x", ValueMeta::f32(&[5, 2, 12])),
            ("a", ValueMeta::f32(&[5, 6, 4])),
            ("b", ValueMeta::f32(&[6, 5, 4])),
            ("y", ValueMeta::f32(&[2, 3, 5, 4])),
            ("kt", ValueMeta::f32(&[2, 3, 4, 5])),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_string(), m))
        .collect();
        assert_eq!(merged_transposes(&mut g, &mut metas), (1, 1));
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Constant", "Reshape", "Transpose"]);
        assert_eq!(metas["y/finest"].shape, [5, 2, 3, 4]);
        let t = &g.nodes[2];
        assert_eq!(
            (t.input[0].as_str(), t.output[0].as_str()),
            ("y/finest", "kt")
        );
        // [S, B, H, D] -> [B, H, S, D] -> [B, H, D, S].
        assert_eq!(attr_ints(t, "perm"), Some(vec![1, 2, 3, 0]));
    }
}
