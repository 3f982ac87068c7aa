//! The training graph's forward part with pipetrain's fused kernels in place of the
//! patterns they compute (`runtime.fused_kernels`): PyTorch's erf GELU (five nodes) as
//! one `Gelu`, `Softmax` over the last axis as pipetrain's `Softmax`, and the
//! `SoftmaxCrossEntropyLoss` pipetrain attaches as `SoftmaxCrossEntropy`; each gets its
//! fused backward from the autodiff (`autodiff::rules::fused`). Only float32 nodes whose
//! shapes fit the kernels are replaced; the rest stay standard ONNX.
//!
//! Runs after the loss is attached and the values measured, before differentiation, on
//! pipetrain's own graph only: graphs that leave pipetrain are built without it.

use std::collections::{HashMap, HashSet};

use super::autodiff::gelu;
use super::custom_ops::{DOMAIN, GELU, SOFTMAX, SOFTMAX_CROSS_ENTROPY};
use super::ir::{attr_i, attr_s, make_node, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// How many nodes of each kind [`fuse_forward`] replaced.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    pub gelu: usize,
    pub softmax: usize,
    pub cross_entropy: usize,
}

impl Fused {
    /// Whether any node was replaced.
    pub fn any(&self) -> bool {
        self.gelu + self.softmax + self.cross_entropy > 0
    }
}

/// Replaces the patterns in `g` (see the module doc); `metas` are its values' measured
/// types and shapes. Imports pipetrain's domain when it replaced anything.
pub fn fuse_forward(g: &mut Graph, metas: &Metas) -> Fused {
    let is_f32 = |v: &str| metas.get(v).is_some_and(|m| m.dtype == DType::F32);
    let consts = g.constants();
    let mut fused = Fused::default();
    let mut drop: HashSet<usize> = HashSet::new();
    let mut replace: HashMap<usize, NodeProto> = HashMap::new();

    let gelus = gelu::find(g, &consts, &|_| false);
    let producer = producers(g);
    let consumers = g.consumers();
    for (&half, chain) in &gelus {
        let scale = producer[chain.t.as_str()];
        if !is_f32(&chain.x) || !scales_by_inv_sqrt2(&g.nodes[scale], &consts) {
            continue;
        }
        // The chain: scale (makes `t`), Erf (reads it), Add (makes `a`), Mul (reads it:
        // x * a), Mul (by one half); each inner value has that one reader.
        let (erf, add, times) = (
            consumers[chain.t.as_str()][0],
            producer[chain.a.as_str()],
            consumers[chain.a.as_str()][0],
        );
        drop.extend([scale, erf, add, times]);
        let name = format!("{}/fused_gelu", g.nodes[half].name);
        let y = g.nodes[half].output[0].clone();
        replace.insert(half, custom(GELU, &name, &[&chain.x], &[&y], vec![]));
        fused.gelu += 1;
    }

    let opset = g.opset();
    for (i, n) in g.nodes.iter().enumerate() {
        if !n.domain.is_empty() && n.domain != "ai.onnx" {
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
    }

    if fused.any() {
        let nodes = std::mem::take(&mut g.nodes);
        g.nodes = nodes
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !drop.contains(i))
            .map(|(i, n)| replace.remove(&i).unwrap_or(n))
            .collect();
        g.import_domain(DOMAIN, 1);
    }
    fused
}

/// Which node makes each value.
fn producers(g: &Graph) -> HashMap<&str, usize> {
    let mut map = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in &n.output {
            map.insert(o.as_str(), i);
        }
    }
    map
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

/// Whether GELU's scale node is `x / sqrt 2` or `x * (1 / sqrt 2)` (what the `Gelu`
/// kernel computes), within float32 rounding.
fn scales_by_inv_sqrt2(scale: &NodeProto, consts: &HashMap<String, Tensor>) -> bool {
    let value = |v: &str| {
        consts
            .get(v)
            .filter(|t| t.len() == 1)
            .map(|t| t.to_f64_vec()[0])
    };
    let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < 1e-6);
    match scale.op_type.as_str() {
        "Div" => near(value(&scale.input[1]), std::f64::consts::SQRT_2),
        "Mul" => scale
            .input
            .iter()
            .any(|v| near(value(v), std::f64::consts::FRAC_1_SQRT_2)),
        _ => false,
    }
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
