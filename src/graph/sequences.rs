//! Tensor sequences as the dynamo exporter writes a `torch.split`: `SplitToSequence`
//! read only by `SequenceAt` with constant positions. pipetrain's values are tensors, so
//! the pair becomes a plain `Split` whose outputs the `SequenceAt`s name (`Identity`).
//! The piece sizes come from the measured shape of the split value.

use std::collections::HashMap;

use crate::graph::ir::{attr_i, int_attr, make_node, tensor_attr, Graph, Metas};
use crate::tensor::Tensor;

/// Operators whose output is a sequence, not a tensor (the shape probe leaves them out).
pub fn makes_sequence(op: &str) -> bool {
    matches!(
        op,
        "SplitToSequence"
            | "SequenceConstruct"
            | "SequenceInsert"
            | "SequenceErase"
            | "SequenceEmpty"
    )
}

/// Rewrites every `SplitToSequence` (keepdims = 1) whose readers are all `SequenceAt`
/// with a constant position; returns how many.
pub fn split_sequences(g: &mut Graph, metas: &Metas) -> usize {
    let consts = g.constants();
    let mut rewritten = 0;
    let mut i = 0;
    while i < g.nodes.len() {
        if g.nodes[i].op_type == "SplitToSequence" {
            if let Some(parts) = rewrite_plan(g, i, metas, &consts) {
                apply(g, i, parts, &consts);
                rewritten += 1;
            }
        }
        i += 1;
    }
    rewritten
}

/// The piece sizes of the split at node `i`, when it can be rewritten.
fn rewrite_plan(
    g: &Graph,
    i: usize,
    metas: &Metas,
    consts: &HashMap<String, Tensor>,
) -> Option<Vec<i64>> {
    let n = &g.nodes[i];
    if attr_i(n, "keepdims").unwrap_or(1) != 1 {
        return None;
    }
    let seq = n.output.first()?;
    let readers_ok = g
        .nodes
        .iter()
        .filter(|m| m.input.iter().any(|v| v == seq))
        .all(|m| {
            m.op_type == "SequenceAt" && m.input[0] == *seq && consts.contains_key(&m.input[1])
        });
    if !readers_ok || g.outputs.iter().any(|o| o.name == *seq) {
        return None;
    }
    let shape = &metas.get(n.input.first()?)?.shape;
    let axis = attr_i(n, "axis").unwrap_or(0);
    let axis = if axis < 0 {
        axis + shape.len() as i64
    } else {
        axis
    } as usize;
    let dim = *shape.get(axis)? as i64;
    match n.input.get(1).filter(|s| !s.is_empty()) {
        None => Some(vec![1; dim as usize]),
        Some(s) => {
            let t = consts.get(s)?.to_i64_vec()?;
            if t.len() == 1 && consts[s].shape.is_empty() {
                let chunk = t[0].max(1);
                let mut sizes = vec![chunk; (dim / chunk) as usize];
                if dim % chunk != 0 {
                    sizes.push(dim % chunk);
                }
                Some(sizes)
            } else {
                Some(t)
            }
        }
    }
}

/// Replaces node `i` by a `Split` into `parts` and each `SequenceAt` by an `Identity`.
fn apply(g: &mut Graph, i: usize, parts: Vec<i64>, consts: &HashMap<String, Tensor>) {
    let n = g.nodes[i].clone();
    let seq = n.output[0].clone();
    let axis = attr_i(&n, "axis").unwrap_or(0);
    let outs: Vec<String> = (0..parts.len()).map(|k| format!("{seq}/part{k}")).collect();
    let sizes_name = format!("{seq}/sizes");
    let sizes = Tensor::i64(vec![parts.len()], parts.clone()).expect("sizes");
    let out_refs: Vec<&str> = outs.iter().map(String::as_str).collect();
    let constant = make_node(
        "Constant",
        &sizes_name,
        &[],
        &[&sizes_name],
        vec![tensor_attr("value", sizes.to_proto(&sizes_name))],
    );
    let split = make_node(
        "Split",
        &n.name,
        &[&n.input[0], &sizes_name],
        &out_refs,
        vec![int_attr("axis", axis)],
    );
    g.nodes.splice(i..=i, [constant, split]);
    for m in g
        .nodes
        .iter_mut()
        .filter(|m| m.op_type == "SequenceAt" && m.input[0] == seq)
    {
        let at = consts[&m.input[1]].to_i64_vec().unwrap_or_default()[0];
        let k = if at < 0 { at + parts.len() as i64 } else { at } as usize;
        *m = make_node("Identity", &m.name, &[&outs[k]], &[&m.output[0]], vec![]);
    }
}
