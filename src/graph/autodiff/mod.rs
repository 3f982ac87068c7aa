//! Reverse-mode automatic differentiation that emits ONNX backward graphs.
//!
//! The forward graph is walked from the loss back to the requested values; each node on
//! the way contributes nodes computing its inputs' gradients from its outputs' gradients
//! (its rule, in `rules/`). A value used by several nodes (a tied embedding, a residual)
//! gets the `Sum` of its contributions. Every emitted node records the forward node it
//! belongs to, so that the stage partition can place it. The walk itself is in `walk.rs`.

mod emit;
mod fold;
pub(crate) mod gelu;
mod rules;
mod sums;
mod walk;

use std::collections::{BTreeMap, HashMap};

pub use emit::Emitter;
pub use rules::{has_rule, ruled_ops};
use walk::{Path, Walk};

use crate::graph::ir::{node_label, Graph, Metas, ValueMeta};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The backward part of a training graph.
#[derive(Debug, Default)]
pub struct Backward {
    /// The backward nodes, in execution order.
    pub nodes: Vec<NodeProto>,
    /// For each backward node, the index of the forward node it belongs to.
    pub anchors: Vec<usize>,
    /// `(value, its gradient's name)` for every requested value the loss depends on.
    pub grads: Vec<(String, String)>,
    /// Requested values the loss does not depend on (their gradient is zero).
    pub no_grad: Vec<String>,
    /// Whether a `com.microsoft` node was emitted.
    pub used_contrib: bool,
    /// Whether one of pipetrain's own nodes (domain `ai.pipetrain`) was emitted.
    pub used_custom: bool,
}

/// Which operators beyond the standard ones a backward graph may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpChoice {
    /// ONNX Runtime's contrib ops (`com.microsoft.FusedMatMul`).
    pub contrib: bool,
    /// pipetrain's fused kernels (`ai.pipetrain.LayerNormGrad`).
    pub fused: bool,
    /// Those of pipetrain's kernels that run on ONNX Runtime's CUDA provider
    /// (`ai.pipetrain.SoftmaxGrad`).
    pub cuda: bool,
    /// With `cuda`, those not yet run on a GPU too (`ai.pipetrain.LayerNormGrad`;
    /// `runtime.cuda_kernels_untried`).
    pub cuda_untried: bool,
}

/// What a gradient rule sees of its node.
pub struct RuleCtx<'a> {
    /// The forward node.
    pub node: &'a NodeProto,
    /// The gradient of each output, when some later node uses that output.
    pub dy: Vec<Option<String>>,
    /// Whether each input needs a gradient.
    pub needs: Vec<bool>,
    /// Types and shapes of forward values.
    pub metas: &'a Metas,
    /// Constant values of the forward graph.
    pub consts: &'a HashMap<String, Tensor>,
    /// The forward graph (what made an input, see [`RuleCtx::untransposed`]).
    pub fwd: &'a Graph,
    /// The default-domain opset.
    pub opset: i64,
    /// Rows of looked-up tables that get no gradient from the lookup (padding rows).
    pub frozen_rows: &'a BTreeMap<String, Vec<i64>>,
    /// Where the rule emits its nodes.
    pub e: &'a mut Emitter,
}

impl RuleCtx<'_> {
    /// The name of input `i` (empty when the optional input is absent).
    pub fn input(&self, i: usize) -> &str {
        self.node.input.get(i).map_or("", String::as_str)
    }

    /// The name of output `i`.
    pub fn output(&self, i: usize) -> &str {
        self.node.output.get(i).map_or("", String::as_str)
    }

    /// The type and shape of a forward value.
    ///
    /// # Errors
    /// `InvalidGraph` when the value was not measured.
    pub fn meta(&self, name: &str) -> Result<&ValueMeta> {
        self.metas
            .get(name)
            .ok_or_else(|| Error::graph(format!("no type or shape known for value `{name}`")))
    }

    /// The gradient of output `i`.
    ///
    /// # Errors
    /// `UnsupportedGradient` when no gradient reached that output (rules call this only
    /// for outputs the loss depends on).
    pub fn dy(&self, i: usize) -> Result<String> {
        self.dy
            .get(i)
            .cloned()
            .flatten()
            .ok_or_else(|| self.unsupported(format!("output {i} has no gradient")))
    }

    /// Whether input `i` needs a gradient.
    pub fn needs(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }

    /// The error for a case this rule does not handle.
    pub fn unsupported(&self, reason: impl Into<String>) -> Error {
        Error::UnsupportedGradient {
            node: node_label(self.node),
            op_type: self.node.op_type.clone(),
            reason: reason.into(),
        }
    }

    /// The constant integer values of optional input `i` (axes, shapes, pads).
    ///
    /// # Errors
    /// `UnsupportedGradient` when the input is present but not a constant.
    pub fn const_ints(&self, i: usize) -> Result<Option<Vec<i64>>> {
        let name = self.input(i);
        if name.is_empty() {
            return Ok(None);
        }
        self.consts
            .get(name)
            .and_then(Tensor::to_i64_vec)
            .map(Some)
            .ok_or_else(|| self.unsupported(format!("input `{name}` must be a constant")))
    }

    /// `W` where forward value `name` is `Transpose(W)` of a matrix: a rule reading
    /// `name`'s transpose can read `W` instead, and the backward then needs no copy of
    /// the transposed matrix. (`torch.onnx.export` without constant folding writes every
    /// `nn.Linear` as `MatMul(x, Transpose(weight))`; read by the backward, the
    /// transposed weights were kept from each forward to its backward: a second copy of
    /// the model's matrices.)
    pub fn untransposed(&self, name: &str) -> Option<String> {
        let n = self
            .fwd
            .nodes
            .iter()
            .find(|n| n.output.first().is_some_and(|o| o == name))?;
        let w = n.input.first()?;
        let two_d = self
            .metas
            .get(w.as_str())
            .is_some_and(|m| m.shape.len() == 2);
        let perm = crate::graph::attr_ints(n, "perm");
        let swaps = perm.is_none() || perm.as_deref() == Some(&[1, 0]);
        (n.op_type == "Transpose" && n.domain.is_empty() && two_d && swaps).then(|| w.clone())
    }

    /// The constant float value of optional input `i`.
    pub fn const_scalar(&self, i: usize) -> Option<f64> {
        let t = self.consts.get(self.input(i))?;
        (t.len() == 1).then(|| t.to_f64_vec()[0])
    }
}

/// Builds the backward nodes computing the gradients of `loss` with respect to `wrt`,
/// seeded with the value `seed` (the loss's own gradient, a scalar fed at run time).
/// `frozen_rows` get no gradient from the `Gather`s that look them up.
///
/// # Errors
/// `NoGradient` naming every node on the path without a rule (and a parameter that
/// needs one);
/// `UnsupportedGradient` when a rule cannot handle the node's attributes.
pub fn differentiate(
    fwd: &Graph,
    metas: &Metas,
    loss: &str,
    seed: &str,
    wrt: &[String],
    ops: OpChoice,
    frozen_rows: &BTreeMap<String, Vec<i64>>,
) -> Result<Backward> {
    let consts = fwd.constants();
    let path = Path::new(fwd, metas, loss, wrt);
    path.check_rules(fwd)?;
    let mut e = Emitter::new(ops.contrib);
    e.fused = ops.fused;
    e.cuda = ops.cuda;
    e.cuda_untried = ops.cuda && ops.cuda_untried;
    let walk = Walk {
        fwd,
        metas,
        consts: &consts,
        frozen_rows,
        path: &path,
    };
    let mut contributions = walk.run(&mut e, loss, seed)?;
    let (grads, no_grad) = gradient_outputs(&mut e, fwd, wrt, &mut contributions);
    let keep: Vec<&str> = grads.iter().map(|(_, g)| g.as_str()).collect();
    for t in fold::fold_transposes(&mut e.nodes, &keep).into_iter().rev() {
        e.anchors.remove(t);
    }
    for t in fold::drop_unread(&mut e.nodes, &keep).into_iter().rev() {
        e.anchors.remove(t);
    }
    Ok(Backward {
        used_contrib: e.used_contrib,
        used_custom: e.used_custom,
        nodes: e.nodes,
        anchors: e.anchors,
        grads,
        no_grad,
    })
}

/// Each requested value's gradient output (`{w}_grad`, the sum of its contributions),
/// and the requested values no gradient reached.
fn gradient_outputs(
    e: &mut Emitter,
    fwd: &Graph,
    wrt: &[String],
    contributions: &mut HashMap<String, Vec<String>>,
) -> (Vec<(String, String)>, Vec<String>) {
    let consumers = fwd.consumers();
    let mut grads = Vec::new();
    let mut no_grad = Vec::new();
    for w in wrt {
        let Some(c) = contributions.remove(w) else {
            no_grad.push(w.clone());
            continue;
        };
        let first_use = consumers.get(w.as_str()).and_then(|c| c.first());
        e.set_anchor(first_use.copied().unwrap_or(0), w);
        let name = format!("{w}_grad");
        e.sum_into(&c, &name);
        grads.push((w.clone(), name));
    }
    (grads, no_grad)
}

/// The error naming every node without a gradient rule, `(node, op type, parameter)` in
/// the backward walk's order (nearest the loss first); `None` when there is none.
fn no_gradient_error(missing: Vec<(String, String, String)>) -> Option<Error> {
    let mut it = missing.into_iter();
    let (node, op_type, param) = it.next()?;
    let rest: Vec<String> = it.map(|(n, op, _)| format!("`{n}` ({op})")).collect();
    let also = if rest.is_empty() {
        String::new()
    } else {
        format!("; also without a gradient rule: {}", rest.join(", "))
    };
    Some(Error::NoGradient {
        node,
        op_type,
        param,
        also,
    })
}

/// One gradient from several contributions: their sum (`Emitter::sum`), anchored at the
/// current node (the value's producer).
fn accumulate(e: &mut Emitter, c: Vec<String>) -> String {
    e.sum(&c)
}
