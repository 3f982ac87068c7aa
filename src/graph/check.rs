//! What is wrong with a model for training, said before it trains (`pipetrain check`,
//! and the start of `train`).
//!
//! - **Merged initializers.** `torch.onnx.export` in its default (eval) mode with
//!   constant folding merges initializers of equal value: at initialization every
//!   LayerNorm weight is ones and every bias zeros, so one initializer ends up as the
//!   scale or bias of many normalization layers, and training it trains another model
//!   than the user's (one parameter where PyTorch has many).
//! - **Operators without a gradient** on the way from a parameter to an output, all of
//!   them at once.
//! - **A fixed batch**: an input whose first axis is a number, not a name.
//! - **BatchNorm in inference mode**: normalizing with the running statistics, where
//!   PyTorch's `train()` normalizes with each batch's (what the dynamo exporter writes).

use std::collections::{BTreeMap, HashSet};

use crate::graph::autodiff::has_rule;
use crate::graph::ir::{declared_type, node_label, Graph};
use crate::graph::static_fold::static_nodes;
use crate::tensor::DType;

/// The export call that keeps every parameter its own initializer.
pub const TRAINING_EXPORT: &str = "torch.onnx.export(model, args, path, \
    training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, \
    dynamic_axes={...: {0: \"batch\"}})";

/// One initializer that stands for several of PyTorch's parameters: the exporter merged
/// equal initial values into it (read directly or through `Identity` aliases named after
/// the other parameters), or several normalization layers read it as scale or bias.
#[derive(Debug, Clone, PartialEq)]
pub struct MergedInitializer {
    /// The initializer.
    pub name: String,
    /// `Identity` outputs that alias it (the merged parameters' names).
    pub aliases: Vec<String>,
    /// Normalization nodes reading it (or an alias) as scale or bias.
    pub norm_sites: Vec<String>,
}

/// What `check` finds in a model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Findings {
    /// Initializers standing for several parameters: the eval-mode export's mark.
    pub merged: Vec<MergedInitializer>,
    /// Nodes without a gradient rule on a path from a float initializer to an output:
    /// `(node, op type)`.
    pub no_gradient: Vec<(String, String)>,
    /// Inputs whose first axis is fixed: `(input, size)`.
    pub fixed_batch: Vec<(String, i64)>,
    /// BatchNormalization nodes in inference mode (running statistics), by name.
    pub inference_batch_norms: Vec<String>,
}

impl Findings {
    /// The findings as warning lines (the ones `train` logs before it starts).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for m in &self.merged {
            let stands_for = if m.aliases.is_empty() {
                format!(
                    "is the scale or bias of {} normalization layers ({})",
                    m.norm_sites.len(),
                    list(&m.norm_sites, 4)
                )
            } else {
                format!(
                    "also stands for {} other parameters ({})",
                    m.aliases.len(),
                    list(&m.aliases, 4)
                )
            };
            out.push(format!(
                "initializer `{}` {stands_for}: an eval-mode export merged initializers of \
                 equal initial value, so they would train as one parameter, another model \
                 than PyTorch's; export with {TRAINING_EXPORT}",
                m.name
            ));
        }
        if !self.inference_batch_norms.is_empty() {
            out.push(format!(
                "{} BatchNormalization nodes normalize with their running statistics \
                 (inference mode: {}), where PyTorch's train() uses each batch's: the \
                 exporter wrote the model in eval mode (the dynamo exporter does so for \
                 BatchNorm); export with {TRAINING_EXPORT}",
                self.inference_batch_norms.len(),
                list(&self.inference_batch_norms, 3)
            ));
        }
        for (input, n) in &self.fixed_batch {
            out.push(format!(
                "input `{input}` has a fixed batch of {n}: every micro-batch must have {n} rows \
                 (batch_size = {n}); export with dynamic_axes={{\"{input}\": {{0: \"batch\"}}}} \
                 to choose the batch when training"
            ));
        }
        out
    }
}

fn list(v: &[String], most: usize) -> String {
    let shown: Vec<String> = v.iter().take(most).map(|s| format!("`{s}`")).collect();
    match v.len().saturating_sub(most) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// Inspects `g` (the model as loaded).
pub fn inspect(g: &Graph) -> Findings {
    Findings {
        merged: merged_initializers(g),
        no_gradient: no_gradient(g),
        fixed_batch: fixed_batch(g),
        inference_batch_norms: g
            .nodes
            .iter()
            .filter(|n| n.op_type == "BatchNormalization")
            .filter(|n| crate::graph::ir::attr_i(n, "training_mode").unwrap_or(0) == 0)
            .map(node_label)
            .collect(),
    }
}

/// Float initializers aliased by `Identity` nodes, or read as scale or bias by two or
/// more normalization nodes.
fn merged_initializers(g: &Graph) -> Vec<MergedInitializer> {
    let floats: HashSet<&str> = g
        .initializers
        .iter()
        .filter(|t| DType::from_onnx(t.data_type).is_some_and(|d| d.is_float()))
        .map(|t| t.name.as_str())
        .collect();
    // What each value is an alias of (an initializer, through Identity chains).
    let mut source: BTreeMap<&str, &str> = floats.iter().map(|&n| (n, n)).collect();
    let mut found: BTreeMap<&str, MergedInitializer> = BTreeMap::new();
    for n in &g.nodes {
        if n.op_type == "Identity" {
            if let Some(&init) = n.input.first().and_then(|v| source.get(v.as_str())) {
                source.insert(n.output[0].as_str(), init);
                merged_entry(&mut found, init)
                    .aliases
                    .push(n.output[0].clone());
            }
            continue;
        }
        let slots: &[usize] = match n.op_type.as_str() {
            "LayerNormalization"
            | "BatchNormalization"
            | "InstanceNormalization"
            | "GroupNormalization"
            | "SimplifiedLayerNormalization" => &[1, 2],
            _ => continue,
        };
        for &i in slots {
            if let Some(&init) = n.input.get(i).and_then(|v| source.get(v.as_str())) {
                merged_entry(&mut found, init)
                    .norm_sites
                    .push(node_label(n));
            }
        }
    }
    found
        .into_values()
        .filter(|m| !m.aliases.is_empty() || m.norm_sites.len() > 1)
        .collect()
}

fn merged_entry<'a, 'g>(
    found: &'a mut BTreeMap<&'g str, MergedInitializer>,
    init: &'g str,
) -> &'a mut MergedInitializer {
    found.entry(init).or_insert_with(|| MergedInitializer {
        name: init.to_string(),
        aliases: Vec::new(),
        norm_sites: Vec::new(),
    })
}

/// Nodes without a rule that a float initializer reaches and an output depends on
/// (values computed from shapes and constants alone are left out: they are folded).
fn no_gradient(g: &Graph) -> Vec<(String, String)> {
    let float_inits: HashSet<&str> = g
        .initializers
        .iter()
        .filter(|t| DType::from_onnx(t.data_type).is_some_and(|d| d.is_float()))
        .map(|t| t.name.as_str())
        .collect();
    let folded = static_nodes(g, &float_inits);
    let mut reached: HashSet<&str> = float_inits.clone();
    let mut on_path = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if !folded[i] && n.input.iter().any(|v| reached.contains(v.as_str())) && !integer_out(n) {
            let outs = float_outputs(n, &reached);
            on_path[i] = !outs.is_empty();
            reached.extend(outs);
        }
    }
    let mut needed: HashSet<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut out = Vec::new();
    for (i, n) in g.nodes.iter().enumerate().rev() {
        if !n.output.iter().any(|o| needed.contains(o.as_str())) {
            continue;
        }
        needed.extend(n.input.iter().map(String::as_str));
        if on_path[i] && !has_rule(&n.op_type, &n.domain) {
            out.push((node_label(n), n.op_type.clone()));
        }
    }
    out.reverse();
    out
}

/// The outputs of `n` (which reads a `reached` value) that can carry a gradient: not the
/// indices of TopK and MaxPool, not a Cast to integers, a OneHot's only where its values
/// are reached.
fn float_outputs<'g>(
    n: &'g crate::onnx::proto::NodeProto,
    reached: &HashSet<&str>,
) -> Vec<&'g str> {
    let all = || n.output.iter().map(String::as_str).collect();
    match n.op_type.as_str() {
        "TopK" | "MaxPool" => n.output.iter().take(1).map(String::as_str).collect(),
        // ONNX's integer, boolean and string element types.
        "Cast" => match crate::graph::ir::attr_i(n, "to") {
            Some(2..=9 | 12 | 13) => Vec::new(),
            _ => all(),
        },
        "OneHot" => match n.input.get(2).is_some_and(|v| reached.contains(v.as_str())) {
            true => all(),
            false => Vec::new(),
        },
        _ => all(),
    }
}

/// Operators whose outputs are integers or booleans: no gradient flows through them.
fn integer_out(n: &crate::onnx::proto::NodeProto) -> bool {
    matches!(
        n.op_type.as_str(),
        "Shape"
            | "Size"
            | "Equal"
            | "Greater"
            | "GreaterOrEqual"
            | "Less"
            | "LessOrEqual"
            | "Not"
            | "And"
            | "Or"
            | "Xor"
            | "ArgMax"
            | "ArgMin"
            | "NonZero"
            | "IsNaN"
            | "IsInf"
    )
}

/// Inputs declared with a number as their first axis.
fn fixed_batch(g: &Graph) -> Vec<(String, i64)> {
    fixed_batch_of(&g.inputs, &g.initializers)
}

/// Of `inputs`, those fed (not among `initializers`) and declared with a number as
/// their first axis, with that number: what [`Findings::fixed_batch`] holds, read off
/// a model's graph as decoded.
pub fn fixed_batch_of(
    inputs: &[crate::onnx::proto::ValueInfoProto],
    initializers: &[crate::onnx::proto::TensorProto],
) -> Vec<(String, i64)> {
    inputs
        .iter()
        .filter(|v| !initializers.iter().any(|t| t.name == v.name))
        .filter_map(|v| {
            let (_, dims) = declared_type(v)?;
            let first = dims.first().copied().flatten()?;
            (dims.len() > 1).then(|| (v.name.clone(), first))
        })
        .collect()
}
