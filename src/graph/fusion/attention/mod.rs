//! Exported attention as pipetrain's `Attention` node (see `compute::fused`, attention):
//!
//! ```text
//! MatMul(q, kt) [* c or / c] [Cast float] [+ mask | Where(causal, ., fill)]
//!   -> Softmax(last axis) [-> Identity | Cast float]*
//!   -> MatMul(., v) [-> Transpose]
//! ```
//!
//! with `q`, `kt` and `v` of rank 4 (`[B, H, T, D]`, `[B, H, D, S]`, `[B, H, S, E]`,
//! no broadcasting), each read through the `Transpose` that makes it where nothing else
//! reads that transpose, and the `Transpose` after the second product taken in where it
//! is the product's only reader. This is how PyTorch exports `softmax(q @ k.transpose(-2,
//! -1) * scale + mask) @ v` (Hugging Face's eager BERT and GPT-2, the tiny GPT) and
//! `scaled_dot_product_attention` (torchvision's ViT, whose scale is on q and k: a `Mul`
//! of q or k by a constant, read by the product alone, goes into the node's scale). The mask must not depend on a trained parameter (it gets no gradient); the
//! values inside the pattern must have no other readers and not be graph outputs. The
//! softmax's output keeps its name as the node's second output. Where q, k and v are
//! the three parts of one `Split` of a `[B, T, W]` tensor along its last axis, each
//! `Reshape`d to `[B, T, H, D]` (GPT-2's and the tiny GPT's fused projection), the node is
//! `PackedAttention` on that tensor instead, and the `Split` and `Reshape`s go too.

mod mask;

use std::collections::{HashMap, HashSet};

use super::super::ir::{attr_i, attr_ints, float_attr, int_attr, ints_attr, Graph, Metas};
use super::custom;
use crate::graph::custom_ops::{ATTENTION, PACKED_ATTENTION};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};
use mask::{causal, Mask};

/// One pattern found: the node to put at `at` (the pattern's last node) and the other
/// nodes it replaces.
pub(super) struct Found {
    pub at: usize,
    pub node: NodeProto,
    pub drop: Vec<usize>,
    /// Whether the mask was causal (the kernel's own).
    pub causal: bool,
}

/// Q, K and V as parts of one packed tensor (see [`Finder::packed`]).
struct Packed<'g> {
    packed: &'g str,
    heads_dim: Vec<i64>,
    offsets: Vec<i64>,
    /// The `Split` and the three `Reshape`s the node replaces too.
    nodes: Vec<usize>,
}

/// Every attention pattern of `g` (none overlapping).
pub(super) fn find<'g>(
    g: &'g Graph,
    metas: &'g Metas,
    consts: &'g HashMap<String, Tensor>,
    trainable: &HashSet<&'g str>,
) -> Vec<Found> {
    let finder = Finder {
        g,
        metas,
        consts,
        consumers: g.consumers(),
        producers: g.producers(),
        outputs: g.outputs.iter().map(|o| o.name.as_str()).collect(),
        graded: graded(g, trainable),
    };
    let mut taken = HashSet::new();
    let mut found = Vec::new();
    for i in 0..g.nodes.len() {
        let Some(f) = finder.at(i) else { continue };
        if f.drop.iter().chain([&f.at]).all(|n| !taken.contains(n)) {
            taken.extend(f.drop.iter().copied().chain([f.at]));
            found.push(f);
        }
    }
    found
}

/// The trained parameters and the values that depend on them.
fn graded<'g>(g: &'g Graph, trainable: &HashSet<&'g str>) -> HashSet<&'g str> {
    let mut graded: HashSet<&str> = trainable.clone();
    for n in &g.nodes {
        let reads = n
            .input
            .iter()
            .any(|v| trainable.contains(v.as_str()) || graded.contains(v.as_str()));
        if reads {
            graded.extend(n.output.iter().map(String::as_str));
        }
    }
    graded
}

struct Finder<'g> {
    g: &'g Graph,
    metas: &'g Metas,
    consts: &'g HashMap<String, Tensor>,
    consumers: HashMap<&'g str, Vec<usize>>,
    producers: HashMap<&'g str, usize>,
    outputs: HashSet<&'g str>,
    graded: HashSet<&'g str>,
}

impl<'g> Finder<'g> {
    /// Whether node `i` is the standard op `op`.
    fn is(&self, i: usize, op: &str) -> bool {
        let n = &self.g.nodes[i];
        n.op_type == op && (n.domain.is_empty() || n.domain == "ai.onnx")
    }

    /// The only reader of `v`, where it has one and is not a graph output.
    fn only(&self, v: &str) -> Option<usize> {
        match self.consumers.get(v) {
            Some(c) if c.len() == 1 && !self.outputs.contains(v) => Some(c[0]),
            _ => None,
        }
    }

    /// The shape of `v` where it is float32 of rank 4.
    fn rank4(&self, v: &str) -> Option<&'g [usize]> {
        let m = self.metas.get(v)?;
        (m.dtype == DType::F32 && m.shape.len() == 4).then_some(m.shape.as_slice())
    }

    /// `v`'s value where it is a one-value constant.
    fn scalar(&self, v: &str) -> Option<f64> {
        let t = self.consts.get(v)?;
        (t.len() == 1).then(|| t.to_f64_vec()[0])
    }

    /// The pattern whose first product is node `m1`.
    fn at(&self, m1: usize) -> Option<Found> {
        if !self.is(m1, "MatMul") {
            return None;
        }
        let first = &self.g.nodes[m1];
        let scores = self.rank4(&first.output[0])?;
        let mut chain = vec![m1];
        let (scale, x) = self.scale(&first.output[0], &mut chain)?;
        let (mask, x) = self.mask(x, scores, &mut chain)?;
        // A constant causal mask is the kernel's own (it then skips the masked keys).
        let causal = match mask {
            Mask::Causal => true,
            Mask::Added(m) => self.consts.get(m).is_some_and(|t| causal(t, scores)),
            Mask::None => false,
        };
        let softmax = self.softmax(self.only(x)?, x)?;
        chain.push(softmax);
        let probs = self.g.nodes[softmax].output[0].as_str();
        let m2 = self.second_product(probs, &mut chain)?;
        let v = self.g.nodes[m2].input[1].as_str();
        self.shapes_agree(&first.input[0], &first.input[1], v)?;
        let (out, out_perm) = self.turned_output(&self.g.nodes[m2].output[0], &mut chain);
        // q and k each multiplied by a constant (`scaled_dot_product_attention`'s export
        // scales both): the constants go into the scale.
        let mut scale = scale;
        let mut operands = Vec::new();
        for (value, reader, scaled) in [
            (first.input[0].as_str(), m1, true),
            (first.input[1].as_str(), m1, true),
            (v, m2, false),
        ] {
            match scaled.then(|| self.scaled(value, reader)).flatten() {
                Some((mul, y, c)) => {
                    chain.push(mul);
                    scale *= c;
                    operands.push((y, mul));
                }
                None => operands.push((value, reader)),
            }
        }
        let mut inputs = Vec::new();
        let mut attrs = vec![
            float_attr("scale", scale as f32),
            int_attr("causal", i64::from(causal)),
        ];
        for ((value, reader), name) in operands.into_iter().zip(["q_perm", "k_perm", "v_perm"]) {
            let (source, perm) = match self.transposed(value, reader) {
                Some((t, perm)) => {
                    chain.push(t);
                    (self.g.nodes[t].input[0].as_str(), perm)
                }
                None => (value, vec![0, 1, 2, 3]),
            };
            inputs.push(source);
            attrs.push(ints_attr(name, &perm));
        }
        attrs.push(ints_attr("out_perm", &out_perm));
        let mut op = ATTENTION;
        if let Some(p) = self.packed([inputs[0], inputs[1], inputs[2]], &chain) {
            chain.extend(p.nodes);
            inputs = vec![p.packed];
            attrs.push(ints_attr("heads_dim", &p.heads_dim));
            attrs.push(ints_attr("offsets", &p.offsets));
            op = PACKED_ATTENTION;
        }
        if let (Mask::Added(m), false) = (mask, causal) {
            inputs.push(m);
        }
        let name = format!("{}/attention", self.g.nodes[softmax].name);
        let node = custom(op, &name, &inputs, &[out, probs], attrs);
        let at = *chain.iter().max()?;
        chain.retain(|&i| i != at);
        Some(Found {
            at,
            node,
            drop: chain,
            causal,
        })
    }

    /// The second product reading the probabilities `probs` (through identities and
    /// float casts, each the only reader of the value before it) as its first input.
    fn second_product(&self, probs: &'g str, chain: &mut Vec<usize>) -> Option<usize> {
        let (mut y, mut next) = (probs, self.only(probs)?);
        let g = self.g;
        while self.is(next, "Identity")
            || (self.is(next, "Cast") && attr_i(&g.nodes[next], "to") == Some(1))
        {
            chain.push(next);
            y = &g.nodes[next].output[0];
            next = self.only(y)?;
        }
        let second = &g.nodes[next];
        if !self.is(next, "MatMul") || second.input[0] != y || second.input[1] == y {
            return None;
        }
        chain.push(next);
        Some(next)
    }

    /// The attention's output `out` and the permutation to it: through the `Transpose`
    /// that is its only reader, where there is one.
    fn turned_output(&self, out: &'g str, chain: &mut Vec<usize>) -> (&'g str, Vec<i64>) {
        let turned = self.only(out).filter(|&t| self.is(t, "Transpose"));
        match turned.and_then(|t| Some((t, self.perm(t)?))) {
            Some((t, perm)) => {
                chain.push(t);
                (&self.g.nodes[t].output[0], perm)
            }
            None => (out, vec![0, 1, 2, 3]),
        }
    }

    /// `q, k, v` as parts of one packed tensor: each the only output of a `Reshape` to
    /// `[B, T, H, D]` (one shape for all three) read only by a node of `chain`, of one
    /// output of a `Split` into three along the last axis of a float32 `[B, T, W]`
    /// tensor, each output read only by its `Reshape`.
    fn packed(&self, qkv: [&'g str; 3], chain: &[usize]) -> Option<Packed<'g>> {
        let g = self.g;
        let reshapes: Vec<usize> = qkv
            .iter()
            .map(|&x| {
                let r = *self.producers.get(x)?;
                let read_inside = self.only(x).is_some_and(|n| chain.contains(&n));
                (self.is(r, "Reshape") && read_inside).then_some(r)
            })
            .collect::<Option<_>>()?;
        let split = *self.producers.get(g.nodes[reshapes[0]].input[0].as_str())?;
        let sp = &g.nodes[split];
        if !self.is(split, "Split") || sp.input.is_empty() {
            return None;
        }
        let packed = sp.input[0].as_str();
        let x = self.metas.get(packed).filter(|m| m.dtype == DType::F32)?;
        let axis = attr_i(sp, "axis").unwrap_or(0);
        if sp.output.len() != 3 || x.shape.len() != 3 || (axis != 2 && axis != -1) {
            return None;
        }
        let shape = self.rank4(qkv[0])?;
        let mut offsets = vec![0i64; 3];
        for (i, &r) in reshapes.iter().enumerate() {
            let part = g.nodes[r].input[0].as_str();
            let j = sp.output.iter().position(|o| o == part)?;
            let before: usize = sp.output[..j]
                .iter()
                .map(|o| self.metas.get(o).and_then(|m| m.shape.last().copied()))
                .sum::<Option<usize>>()?;
            let fits = self.only(part) == Some(r)
                && self.rank4(qkv[i]) == Some(shape)
                && shape[..2] == x.shape[..2]
                && self.metas.get(part).and_then(|m| m.shape.last().copied())
                    == Some(shape[2] * shape[3]);
            if !fits {
                return None;
            }
            offsets[i] = before as i64;
        }
        let distinct =
            offsets[0] != offsets[1] && offsets[1] != offsets[2] && offsets[0] != offsets[2];
        let whole = 3 * shape[2] * shape[3] == x.shape[2];
        (distinct && whole).then(|| Packed {
            packed,
            heads_dim: vec![shape[2] as i64, shape[3] as i64],
            offsets,
            nodes: [vec![split], reshapes].concat(),
        })
    }

    /// Node `i` where it is a float32 softmax of `x` over its last axis.
    fn softmax(&self, i: usize, x: &str) -> Option<usize> {
        let n = &self.g.nodes[i];
        let default = if self.g.opset() >= 13 { -1 } else { 1 };
        let axis = attr_i(n, "axis").unwrap_or(default);
        (self.is(i, "Softmax") && n.input[0] == x && (axis == -1 || axis == 3)).then_some(i)
    }

    /// `Some` where `q` `[B, H, T, D]`, `kt` `[B, H, D, S]` and `v` `[B, H, S, E]` agree.
    fn shapes_agree(&self, q: &str, kt: &str, v: &str) -> Option<()> {
        let (q, k, v) = (self.rank4(q)?, self.rank4(kt)?, self.rank4(v)?);
        let agree = q[..2] == k[..2] && k[..2] == v[..2] && q[3] == k[2] && k[3] == v[2];
        agree.then_some(())
    }

    /// A rank-4 `Transpose` node's permutation.
    fn perm(&self, t: usize) -> Option<Vec<i64>> {
        let perm = attr_ints(&self.g.nodes[t], "perm").unwrap_or_else(|| vec![3, 2, 1, 0]);
        (perm.len() == 4).then_some(perm)
    }

    /// `value` as `Mul(y, c)` (or `Mul(c, y)`) of a one-value constant `c`, where
    /// `reader` is its only reader and `y` has its shape: the `Mul` node, `y` and `c`.
    fn scaled(&self, value: &str, reader: usize) -> Option<(usize, &'g str, f64)> {
        let mul = *self.producers.get(value)?;
        if !self.is(mul, "Mul") || self.only(value) != Some(reader) {
            return None;
        }
        let n = &self.g.nodes[mul];
        let (y, c) = match (self.scalar(&n.input[0]), self.scalar(&n.input[1])) {
            (None, Some(c)) => (n.input[0].as_str(), c),
            (Some(c), None) => (n.input[1].as_str(), c),
            _ => return None,
        };
        (self.rank4(y)? == self.rank4(value)?).then_some((mul, y, c))
    }

    /// The `Transpose` making `value` and its permutation, where `reader` is the only
    /// node reading `value`.
    fn transposed(&self, value: &str, reader: usize) -> Option<(usize, Vec<i64>)> {
        let t = *self.producers.get(value)?;
        if !self.is(t, "Transpose") || self.only(value) != Some(reader) {
            return None;
        }
        Some((t, self.perm(t)?))
    }
}
