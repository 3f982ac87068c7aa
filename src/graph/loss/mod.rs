//! Attaching a loss to a forward graph (ONNX Runtime's `loss_func_info`).

mod label;

use serde::{Deserialize, Serialize};

use label::{classes_on_axis_1, find_class_axis, label_input, reshape_label};

use crate::graph::ir::{int_attr, make_node, string_attr, tensor_attr, Graph, ValueMeta};
use crate::onnx::proto::{AttributeProto, NodeProto};
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// The name of the scalar loss value in every training graph.
pub const LOSS: &str = "loss";

/// Correct predictions (arg-max class equals the label) of a classification loss's
/// batch, float32 scalar: evaluation reports accuracy from it.
pub const ACC_CORRECT: &str = "loss/correct";
/// Label positions counted (not `ignore_index`) of that batch, float32 scalar.
pub const ACC_COUNTED: &str = "loss/counted";

/// Which loss to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LossSpec {
    /// Mean softmax cross-entropy of `prediction` against integer `label`s; positions
    /// labelled `ignore_index` count for nothing. Classes are on axis 1 (ONNX's and
    /// PyTorch's `cross_entropy` convention) or, for a language model's logits
    /// `[batch, seq, vocab]` with labels `[batch, seq]`, on the last axis (found from the
    /// shapes, or set with `class_axis`).
    SoftmaxCrossEntropy {
        /// The logits value.
        prediction: String,
        /// The labels input (added as a graph input when the model has none).
        label: String,
        /// A label value to skip.
        #[serde(default)]
        ignore_index: Option<i64>,
        /// The prediction's class axis (negative counts from the end); found from the
        /// label's shape when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        class_axis: Option<i64>,
        /// What a step's loss is the mean over, under gradient accumulation.
        #[serde(default)]
        normalize: LossNormalize,
    },
    /// Mean squared error between `prediction` and `label`.
    Mse {
        /// The prediction value.
        prediction: String,
        /// The target input.
        label: String,
    },
    /// The model already outputs a scalar loss.
    Output {
        /// The loss value.
        name: String,
    },
}

/// What a step's loss is the mean over when a step has several micro-batches (and
/// replicas), and some label positions are ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalize {
    /// The mean of the micro-batches' means: each micro-batch weighs the same, whatever
    /// its count of counted positions (a PyTorch accumulation loop's semantics).
    #[default]
    MicroBatch,
    /// The sum over the step's counted positions divided by their count over every
    /// micro-batch and replica: the same as one batch of the whole step.
    Tokens,
}

impl LossSpec {
    /// How the loss is normalized under accumulation.
    pub fn normalize(&self) -> LossNormalize {
        match self {
            LossSpec::SoftmaxCrossEntropy { normalize, .. } => *normalize,
            _ => LossNormalize::MicroBatch,
        }
    }

    /// The ignored label value of a cross-entropy loss.
    pub fn ignore_index(&self) -> Option<i64> {
        match self {
            LossSpec::SoftmaxCrossEntropy { ignore_index, .. } => *ignore_index,
            _ => None,
        }
    }

    /// The label input this loss reads, if any.
    pub fn label(&self) -> Option<&str> {
        match self {
            LossSpec::SoftmaxCrossEntropy { label, .. } | LossSpec::Mse { label, .. } => {
                Some(label)
            }
            LossSpec::Output { .. } => None,
        }
    }
}

/// Adds the loss nodes (and the label input, typed by `label_meta`) to `g`; the loss is
/// named [`LOSS`]. `prediction_meta` gives the prediction's measured shape.
///
/// # Errors
/// `MissingValue` when the prediction is not a value of the graph, or the label is
/// neither a graph input nor described by `label_meta`; `BadTensor` when the label's
/// size does not fit the prediction.
pub fn attach_loss(
    g: &mut Graph,
    spec: &LossSpec,
    prediction_meta: &ValueMeta,
    label_meta: Option<&ValueMeta>,
) -> Result<()> {
    match spec {
        LossSpec::Output { name } => attach_output(g, name, prediction_meta),
        LossSpec::SoftmaxCrossEntropy {
            prediction,
            label,
            ignore_index,
            class_axis,
            normalize,
        } => {
            let lm = label_input(g, prediction, label, label_meta)?;
            let axis = find_class_axis(prediction, label, *class_axis, prediction_meta, &lm)?;
            let (prediction, want) = classes_on_axis_1(g, prediction, axis, prediction_meta)?;
            let prediction = prediction.as_str();
            let label_in = reshape_label(g, label, &lm, &want, prediction_meta)?;
            // Normalized by tokens, the graph sums; the stage divides by the step's count
            // of counted positions (through the backward seed and the reported loss).
            let reduction = match normalize {
                LossNormalize::MicroBatch => "mean",
                LossNormalize::Tokens => "sum",
            };
            let mut attrs = vec![string_attr("reduction", reduction)];
            if let Some(ii) = ignore_index {
                attrs.push(int_attr("ignore_index", *ii));
            }
            g.nodes.push(make_node(
                "SoftmaxCrossEntropyLoss",
                "loss/softmax_cross_entropy",
                &[prediction, &label_in],
                &[LOSS, "loss/log_prob"],
                attrs,
            ));
            attach_accuracy(g, prediction, &label_in, *ignore_index)
        }
        LossSpec::Mse { prediction, label } => {
            let lm = label_input(g, prediction, label, label_meta)?;
            let label_in = reshape_label(g, label, &lm, &prediction_meta.shape, prediction_meta)?;
            let rank = prediction_meta.shape.len();
            let inv_n = 1.0 / prediction_meta.numel() as f64;
            let scale = match prediction_meta.dtype {
                DType::F64 => Tensor::f64(vec![], vec![inv_n])?,
                _ => Tensor::f32(vec![], vec![inv_n as f32])?,
            };
            let axes = Tensor::i64(vec![rank], (0..rank as i64).collect())?;
            g.nodes.extend([
                make_node(
                    "Sub",
                    "loss/diff",
                    &[prediction, &label_in],
                    &["loss/diff"],
                    vec![],
                ),
                make_node(
                    "Mul",
                    "loss/square",
                    &["loss/diff", "loss/diff"],
                    &["loss/square"],
                    vec![],
                ),
                constant_node("loss/axes", &axes),
                make_node(
                    "ReduceSum",
                    "loss/sum",
                    &["loss/square", "loss/axes"],
                    &["loss/sum"],
                    vec![int_attr("keepdims", 0)],
                ),
                constant_node("loss/inv_n", &scale),
                make_node(
                    "Mul",
                    "loss/mean",
                    &["loss/sum", "loss/inv_n"],
                    &[LOSS],
                    vec![],
                ),
            ]);
            Ok(())
        }
    }
}

/// Counts of correct and counted label positions ([`ACC_CORRECT`], [`ACC_COUNTED`]):
/// `ArgMax` over the class axis compared with the label, positions labelled
/// `ignore_index` left out. Nothing depends on them in training, so only evaluation
/// graphs compute them.
fn attach_accuracy(
    g: &mut Graph,
    prediction: &str,
    label: &str,
    ignore_index: Option<i64>,
) -> Result<()> {
    let to = |d: DType| vec![int_attr("to", d.onnx() as i64)];
    let keepdims_0 = || vec![int_attr("keepdims", 0)];
    let argmax_attrs = vec![int_attr("axis", 1), int_attr("keepdims", 0)];
    g.nodes.extend([
        node("ArgMax", &[prediction], "loss/argmax", argmax_attrs),
        node("Cast", &[label], "loss/label_i64", to(DType::I64)),
        node(
            "Equal",
            &["loss/argmax", "loss/label_i64"],
            "loss/hit",
            vec![],
        ),
        node("Cast", &["loss/hit"], "loss/hit_f", to(DType::F32)),
    ]);
    let Some(ii) = ignore_index else {
        g.nodes.extend([
            node("ReduceSum", &["loss/hit_f"], ACC_CORRECT, keepdims_0()),
            // Counted from the label itself (not a constant): constants are copied
            // only into stages whose nodes read them.
            node("Size", &["loss/label_i64"], "loss/size", vec![]),
            node("Cast", &["loss/size"], ACC_COUNTED, to(DType::F32)),
        ]);
        return Ok(());
    };
    let is_ignored = ["loss/label_i64", "loss/ignore_index"];
    g.nodes.extend([
        constant_node("loss/ignore_index", &Tensor::i64(vec![], vec![ii])?),
        node("Equal", &is_ignored, "loss/ignored", vec![]),
        node("Not", &["loss/ignored"], "loss/kept", vec![]),
        node("Cast", &["loss/kept"], "loss/kept_f", to(DType::F32)),
        node(
            "Mul",
            &["loss/hit_f", "loss/kept_f"],
            "loss/hit_kept",
            vec![],
        ),
        node("ReduceSum", &["loss/hit_kept"], ACC_CORRECT, keepdims_0()),
        node("ReduceSum", &["loss/kept_f"], ACC_COUNTED, keepdims_0()),
    ]);
    Ok(())
}

/// A node with one output, named after it.
fn node(op: &str, inputs: &[&str], output: &str, attrs: Vec<AttributeProto>) -> NodeProto {
    make_node(op, output, inputs, &[output], attrs)
}

/// The model's own scalar output is the loss.
fn attach_output(g: &mut Graph, name: &str, meta: &ValueMeta) -> Result<()> {
    if !g.has_value(name) {
        return Err(missing("loss output", name, g));
    }
    if meta.numel() != 1 {
        return Err(Error::BadTensor {
            name: name.into(),
            reason: format!("a loss must be a scalar, this has shape {:?}", meta.shape),
        });
    }
    if name != LOSS {
        g.nodes.push(make_node(
            "Identity",
            "loss/identity",
            &[name],
            &[LOSS],
            vec![],
        ));
    }
    Ok(())
}

/// A `Constant` node whose output has the node's name.
pub(super) fn constant_node(name: &str, t: &Tensor) -> NodeProto {
    make_node(
        "Constant",
        name,
        &[],
        &[name],
        vec![tensor_attr("value", t.to_proto(name))],
    )
}

pub(super) fn missing(role: &'static str, name: &str, g: &Graph) -> Error {
    Error::MissingValue {
        role,
        name: name.to_string(),
        hint: g.value_names_hint(),
    }
}
