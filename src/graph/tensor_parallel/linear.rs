//! Linear layers as exporters write them, for the split to find: `MatMul(x, W)` with
//! `W [in, out]` (pipetrain's own models), `MatMul(x, Transpose(W))` with `W [out, in]`
//! (`torch.nn.Linear` under `torch.onnx.export`, both exporters), and `Gemm(x, W, b)`
//! (Hugging Face GPT-2's `Conv1D` on a 2-D view).

use std::collections::{HashMap, HashSet};

use crate::graph::ir::{attr_f, attr_i, attr_ints, Graph};
use crate::onnx::proto::NodeProto;

/// A linear layer's trainable weight, and its axes of output and input features.
#[derive(Debug, Clone, Copy)]
pub(super) struct Linear<'a> {
    /// The weight parameter.
    pub weight: &'a str,
    /// Its axis of output features (split by a column-parallel layer).
    pub out_axis: usize,
    /// Its axis of input features (split by a row-parallel layer).
    pub in_axis: usize,
    /// `Gemm`'s bias (its third input), when it has one.
    pub bias: Option<&'a str>,
}

/// The linear layer node `n` computes, when it is one: a `MatMul` or plain `Gemm`
/// (no transposed input, unit `beta`) of an activation by a trainable 2-D weight read
/// by nothing else.
pub(super) fn linear<'a>(
    g: &'a Graph,
    n: &NodeProto,
    trainable: &HashSet<&str>,
    (producers, readers): (&HashMap<&str, usize>, &HashMap<&str, Vec<usize>>),
) -> Option<Linear<'a>> {
    let param = |name: &str| -> Option<&'a str> {
        let t = g.initializer(name)?;
        (trainable.contains(name) && t.dims.len() == 2).then_some(t.name.as_str())
    };
    let b = n.input.get(1)?;
    let gemm = n.op_type == "Gemm";
    if !n.domain.is_empty() || !(gemm || n.op_type == "MatMul") {
        return None;
    }
    if gemm
        && (attr_i(n, "transA").unwrap_or(0) != 0
            || (n.input.len() > 2 && attr_f(n, "beta").unwrap_or(1.0) != 1.0))
    {
        return None;
    }
    let trans_b = gemm && attr_i(n, "transB").unwrap_or(0) == 1;
    let (weight, transposed) = match param(b) {
        Some(w) => (w, trans_b),
        None if !gemm => {
            // `Transpose(W)` read by this node alone.
            let t = &g.nodes[*producers.get(b.as_str())?];
            let perm = attr_ints(t, "perm").unwrap_or_else(|| vec![1, 0]);
            let alone = readers.get(b.as_str()).is_some_and(|r| r.len() == 1);
            match (t.op_type.as_str(), perm.as_slice(), alone) {
                ("Transpose", [1, 0], true) => (param(&t.input[0])?, true),
                _ => return None,
            }
        }
        None => return None,
    };
    let (out_axis, in_axis) = if transposed { (0, 1) } else { (1, 0) };
    let bias = n
        .input
        .get(2)
        .filter(|c| !c.is_empty())
        .map(|c| g.initializer(c).map(|t| t.name.as_str()))
        .map(|c| c.filter(|c| trainable.contains(c)));
    let bias = match bias {
        None => None,
        Some(Some(c)) => Some(c),
        // A constant bias: the layer does not split.
        Some(None) => return None,
    };
    Some(Linear {
        weight,
        out_axis,
        in_axis,
        bias,
    })
}
