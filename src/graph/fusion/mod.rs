//! The training graph's forward part with pipetrain's fused kernels in place of the
//! nodes they compute (`runtime.fused_kernels`): `Softmax` over the last axis as
//! pipetrain's `Softmax`, the `SoftmaxCrossEntropyLoss` pipetrain attaches as
//! `SoftmaxCrossEntropy`, PyTorch's erf GELU (`x / k`, `Erf`, `+ 1`, `x *`, `* 0.5`) as
//! `ErfGelu`, GPT-2's tanh GELU as `TanhGelu` ([`fuse_tanh_gelu`], which a graph for a
//! GPU gets too), a depthwise 2-D `Conv` (one filter per channel) as `DepthwiseConv`, and
//! scaled dot-product attention with the transposes around it as `Attention` (see
//! [`attention`]); each gets its fused backward from the autodiff
//! (`autodiff::rules::fused`). Only float32 nodes whose shapes fit the kernels are
//! replaced; the rest stay standard ONNX.
//!
//! Runs after the loss is attached and the values measured, before differentiation, on
//! pipetrain's own graph only: graphs that leave pipetrain are built without it.

mod attention;
mod linear;
mod products;
mod tanh_gelu;

pub use linear::fuse_transposed_weights;
pub use products::blas_products;

pub use tanh_gelu::{fuse_tanh_gelu, tanh_gelu, tanh_gelu_slope};

use std::collections::{HashMap, HashSet};

use super::autodiff::gelu;

use super::custom_ops::{
    ATTENTION, DEPTHWISE_CONV, DOMAIN, ERF_GELU, FLASH_HEAD_SIZES, PACKED_ATTENTION, SOFTMAX,
    SOFTMAX_CROSS_ENTROPY,
};
use super::ir::{
    attr_i, attr_ints, attr_s, float_attr, int_attr, ints_attr, make_node, Graph, Metas,
};
use crate::onnx::proto::{AttributeProto, NodeProto};
use crate::tensor::DType;

/// How many nodes of each kind [`fuse_forward`] replaced.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    pub gelu: usize,
    pub softmax: usize,
    pub cross_entropy: usize,
    pub depthwise_conv: usize,
    pub attention: usize,
    /// Of those, with a causal mask (the kernel's own).
    pub causal_attention: usize,
    /// Of those, reading Q, K and V as parts of one packed tensor.
    pub packed_attention: usize,
}

impl Fused {
    /// Whether any node was replaced.
    pub fn any(&self) -> bool {
        self.gelu + self.softmax + self.cross_entropy + self.depthwise_conv + self.attention > 0
    }
}

/// Replaces the patterns in `g` (see the module doc); `metas` are its values' measured
/// types and shapes, `trainable` the parameters trained (an attention mask computed
/// from them stays standard ops). Imports pipetrain's domain when it replaced anything.
pub fn fuse_forward(g: &mut Graph, metas: &Metas, trainable: &HashSet<&str>) -> Fused {
    let is_f32 = |v: &str| metas.get(v).is_some_and(|m| m.dtype == DType::F32);
    let mut fused = Fused::default();
    let mut replace: HashMap<usize, NodeProto> = HashMap::new();
    let mut drop: HashSet<usize> = HashSet::new();
    let constants = g.constants();

    for found in attention::find(g, metas, &constants, trainable) {
        fused.causal_attention += usize::from(found.causal);
        fused.packed_attention += usize::from(found.node.op_type == PACKED_ATTENTION);
        replace.insert(found.at, found.node);
        drop.extend(found.drop);
        fused.attention += 1;
    }

    // GELU: its five nodes as one `ErfGelu`, which also gives `erf`'s value (read by the
    // backward) under the `Erf` node's output name.
    let consumers = g.consumers();
    let producers = g.producers();
    for (&half, chain) in &gelu::find(g, &constants, &|_| false) {
        let scale_at = producers[chain.t.as_str()];
        let Some(attrs) = gelu_attributes(&g.nodes[scale_at], &chain.x, &constants) else {
            continue;
        };
        if !is_f32(&chain.x) {
            continue;
        }
        let erf_at = consumers[chain.t.as_str()][0];
        let (add, times) = (producers[chain.a.as_str()], consumers[chain.a.as_str()][0]);
        let name = format!("{}/fused", g.nodes[half].name);
        let (y, e) = (&g.nodes[half].output[0], &g.nodes[erf_at].output[0]);
        let node = custom(ERF_GELU, &name, &[&chain.x], &[y, e], attrs);
        replace.insert(half, node);
        drop.extend([scale_at, erf_at, add, times]);
        fused.gelu += 1;
    }

    let opset = g.opset();
    for (i, n) in g.nodes.iter().enumerate() {
        let standard = n.domain.is_empty() || n.domain == "ai.onnx";
        if !standard || drop.contains(&i) || replace.contains_key(&i) {
            continue;
        }
        let shape = |v: &str| metas.get(v).map(|m| m.shape.clone()).unwrap_or_default();
        if n.op_type == "Softmax" && is_f32(&n.output[0]) {
            let rank = shape(&n.output[0]).len() as i64;
            let default = if opset >= 13 { -1 } else { 1 };
            let axis = attr_i(n, "axis").unwrap_or(default);
            if rank > 0 && (axis == -1 || axis == rank - 1) {
                let fused_node = custom(SOFTMAX, &n.name, &[&n.input[0]], &[&n.output[0]], vec![]);
                replace.insert(i, fused_node);
                fused.softmax += 1;
            }
        }
        if n.op_type == "SoftmaxCrossEntropyLoss" && cross_entropy_fits(n, metas) {
            let inputs: Vec<&str> = n.input[..2].iter().map(String::as_str).collect();
            let outputs: Vec<&str> = n.output.iter().map(String::as_str).collect();
            let node = custom(
                SOFTMAX_CROSS_ENTROPY,
                &n.name,
                &inputs,
                &outputs,
                n.attribute.clone(),
            );
            replace.insert(i, node);
            fused.cross_entropy += 1;
        }
        if n.op_type == "Conv" {
            if let Some(attrs) = depthwise_attributes(n, metas) {
                let inputs: Vec<&str> = n.input.iter().map(String::as_str).collect();
                let node = custom(DEPTHWISE_CONV, &n.name, &inputs, &[&n.output[0]], attrs);
                replace.insert(i, node);
                fused.depthwise_conv += 1;
            }
        }
    }

    if fused.any() {
        apply(g, replace, &drop);
    }
    fused
}

/// Scaled dot-product attention alone as pipetrain's `Attention` (or `PackedAttention`),
/// for a graph whose session runs on a GPU with `runtime.cuda_kernels_untried`: those the
/// CUDA kernel takes, each tensor read with its rows or its columns contiguous
/// (`compute/cuda_attention.rs`). Returns how many were replaced.
pub fn fuse_attention_for_cuda(g: &mut Graph, metas: &Metas, trainable: &HashSet<&str>) -> usize {
    let constants = g.constants();
    let mut replace: HashMap<usize, NodeProto> = HashMap::new();
    let mut drop: HashSet<usize> = HashSet::new();
    for found in attention::find(g, metas, &constants, trainable) {
        let contiguous = ["q_perm", "k_perm", "v_perm"].iter().all(|a| {
            attr_ints(&found.node, a).is_none_or(|p| p.len() == 4 && (p[2] == 3 || p[3] == 3))
        });
        let out = attr_ints(&found.node, "out_perm").is_none_or(|p| p.len() == 4 && p[3] >= 2);
        if contiguous && out {
            replace.insert(found.at, found.node);
            drop.extend(found.drop);
        }
    }
    let n = replace.len();
    if n > 0 {
        apply(g, replace, &drop);
    }
    n
}

/// `runtime.flash_attention`: each fused attention keeps its query rows' log-sum-exps
/// instead of its probabilities (attribute `lse`, second output `<probabilities>/lse`;
/// see `graph::custom_ops::ATTENTION`). For a GPU (`flash_heads`) only those whose heads
/// the flash kernels take ([`FLASH_HEAD_SIZES`]); on the CPU every one. Returns how many.
pub fn keep_log_sum_exp(g: &mut Graph, metas: &Metas, flash_heads: bool) -> usize {
    let mut n = 0;
    for node in &mut g.nodes {
        let attention = [ATTENTION, PACKED_ATTENTION].contains(&node.op_type.as_str());
        if node.domain != DOMAIN || !attention || attr_i(node, "lse").is_some() {
            continue;
        }
        let fits =
            head_sizes(node, metas).is_some_and(|(d, e)| d == e && FLASH_HEAD_SIZES.contains(&d));
        if flash_heads && !fits {
            continue;
        }
        node.attribute.push(int_attr("lse", 1));
        node.output[1] = format!("{}/lse", node.output[1]);
        n += 1;
    }
    n
}

/// The head sizes (the queries', the values') of a fused attention node: its packed
/// `heads_dim`, else its Q and V inputs' last axis after their permutations.
fn head_sizes(node: &NodeProto, metas: &Metas) -> Option<(usize, usize)> {
    if let Some(hd) = attr_ints(node, "heads_dim") {
        let d = usize::try_from(*hd.get(1)?).ok()?;
        return Some((d, d));
    }
    let last = |i: usize, perm: &str| -> Option<usize> {
        let shape = &metas.get(node.input.get(i)?)?.shape;
        let axis = attr_ints(node, perm).map_or(Some(3), |p| p.get(3).copied())?;
        shape.get(usize::try_from(axis).ok()?).copied()
    };
    Some((last(0, "q_perm")?, last(2, "v_perm")?))
}

/// Puts each node of `replace` at its index, drops the nodes at `drop`, and imports
/// pipetrain's domain.
fn apply(g: &mut Graph, mut replace: HashMap<usize, NodeProto>, drop: &HashSet<usize>) {
    let nodes = std::mem::take(&mut g.nodes);
    g.nodes = nodes
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !drop.contains(i))
        .map(|(i, n)| replace.remove(&i).unwrap_or(n))
        .collect();
    g.import_domain(DOMAIN, 1);
}

/// A node of pipetrain's domain.
fn custom(
    op: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    attrs: Vec<crate::onnx::proto::AttributeProto>,
) -> NodeProto {
    let mut n = make_node(op, name, inputs, outputs, attrs);
    n.domain = DOMAIN.into();
    n
}

/// The `ErfGelu` attributes of a GELU whose `t` node is `scale` (`x / k` or `x * c`, `k`
/// and `c` constants of `constants`).
fn gelu_attributes(
    scale: &NodeProto,
    x: &str,
    constants: &HashMap<String, crate::tensor::Tensor>,
) -> Option<Vec<AttributeProto>> {
    let divide = scale.op_type == "Div";
    let by = scale.input.iter().find(|v| v.as_str() != x)?;
    let by = constants.get(by)?.to_f64_vec().first().copied()? as f32;
    Some(vec![
        float_attr("scale", by),
        int_attr("divide", i64::from(divide)),
    ])
}

/// Whether a `SoftmaxCrossEntropyLoss` fits the fused kernel: float32 scores with the
/// classes on axis 1 and nothing after it but ones, int64 labels, no class weights, both
/// outputs, reduction `mean` or `sum`.
fn cross_entropy_fits(n: &NodeProto, metas: &Metas) -> bool {
    let (Some(scores), Some(labels)) = (
        metas.get(&n.input[0]),
        n.input.get(1).and_then(|l| metas.get(l)),
    ) else {
        return false;
    };
    let weights = n.input.get(2).is_some_and(|w| !w.is_empty());
    let reduction = attr_s(n, "reduction").unwrap_or_else(|| "mean".into());
    scores.dtype == DType::F32
        && labels.dtype == DType::I64
        && scores.shape.len() >= 2
        && scores.shape[2..].iter().all(|&d| d == 1)
        && labels.shape.iter().product::<usize>() == scores.shape[0]
        && !weights
        && n.output.len() == 2
        && !n.output[1].is_empty()
        && (reduction == "mean" || reduction == "sum")
}

/// The `DepthwiseConv` attributes (explicit strides, pads, dilations) of a `Conv` that
/// fits the kernel: float32 `X` of shape `[N, C, H, W]`, `W` of shape `[C, 1, KH, KW]`
/// (one filter per channel), `group = C`, explicit pads; `None` otherwise.
fn depthwise_attributes(n: &NodeProto, metas: &Metas) -> Option<Vec<AttributeProto>> {
    let x = metas.get(n.input.first()?)?;
    let w = metas.get(n.input.get(1)?)?;
    let c = *x.shape.get(1)?;
    let fits = x.dtype == DType::F32
        && x.shape.len() == 4
        && w.shape.len() == 4
        && w.shape[..2] == [c, 1]
        && c > 1
        && attr_i(n, "group") == Some(c as i64)
        && attr_s(n, "auto_pad").is_none_or(|p| p == "NOTSET")
        && attr_ints(n, "kernel_shape").is_none_or(|k| {
            k.iter()
                .map(|&d| d as usize)
                .eq(w.shape[2..].iter().copied())
        });
    // Defaults are also the least values allowed: strides and dilations 1, pads 0.
    let ints = |name: &str, len: usize, least: i64| {
        let v = attr_ints(n, name).unwrap_or_else(|| vec![least; len]);
        (v.len() == len && v.iter().all(|&d| d >= least)).then_some(v)
    };
    let (strides, pads, dilations) = (
        ints("strides", 2, 1)?,
        ints("pads", 4, 0)?,
        ints("dilations", 2, 1)?,
    );
    fits.then(|| {
        vec![
            ints_attr("strides", &strides),
            ints_attr("pads", &pads),
            ints_attr("dilations", &dilations),
        ]
    })
}
