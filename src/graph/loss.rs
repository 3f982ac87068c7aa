//! Attaching a loss to a forward graph (ONNX Runtime's `loss_func_info`).

use serde::{Deserialize, Serialize};

use crate::graph::ir::{
    int_attr, make_node, string_attr, tensor_attr, value_info, Graph, ValueMeta,
};
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
    /// Mean softmax cross-entropy of `prediction` (classes on axis 1) against integer
    /// `label`s; positions labelled `ignore_index` count for nothing.
    SoftmaxCrossEntropy {
        /// The logits value.
        prediction: String,
        /// The labels input (added as a graph input when the model has none).
        label: String,
        /// A label value to skip.
        #[serde(default)]
        ignore_index: Option<i64>,
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
            normalize,
        } => {
            let label_in = prepare_label(g, prediction, label, true, prediction_meta, label_meta)?;
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
            let label_in = prepare_label(g, prediction, label, false, prediction_meta, label_meta)?;
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
    let f32_type = DType::F32.onnx() as i64;
    g.nodes.extend([
        make_node(
            "ArgMax",
            "loss/argmax",
            &[prediction],
            &["loss/argmax"],
            vec![int_attr("axis", 1), int_attr("keepdims", 0)],
        ),
        make_node(
            "Cast",
            "loss/label_i64",
            &[label],
            &["loss/label_i64"],
            vec![int_attr("to", DType::I64.onnx() as i64)],
        ),
        make_node(
            "Equal",
            "loss/hit",
            &["loss/argmax", "loss/label_i64"],
            &["loss/hit"],
            vec![],
        ),
        make_node(
            "Cast",
            "loss/hit_f",
            &["loss/hit"],
            &["loss/hit_f"],
            vec![int_attr("to", f32_type)],
        ),
    ]);
    match ignore_index {
        Some(ii) => {
            g.nodes.extend([
                constant_node("loss/ignore_index", &Tensor::i64(vec![], vec![ii])?),
                make_node(
                    "Equal",
                    "loss/ignored",
                    &["loss/label_i64", "loss/ignore_index"],
                    &["loss/ignored"],
                    vec![],
                ),
                make_node(
                    "Not",
                    "loss/kept",
                    &["loss/ignored"],
                    &["loss/kept"],
                    vec![],
                ),
                make_node(
                    "Cast",
                    "loss/kept_f",
                    &["loss/kept"],
                    &["loss/kept_f"],
                    vec![int_attr("to", f32_type)],
                ),
                make_node(
                    "Mul",
                    "loss/hit_kept",
                    &["loss/hit_f", "loss/kept_f"],
                    &["loss/hit_kept"],
                    vec![],
                ),
                make_node(
                    "ReduceSum",
                    "loss/correct",
                    &["loss/hit_kept"],
                    &[ACC_CORRECT],
                    vec![int_attr("keepdims", 0)],
                ),
                make_node(
                    "ReduceSum",
                    "loss/counted",
                    &["loss/kept_f"],
                    &[ACC_COUNTED],
                    vec![int_attr("keepdims", 0)],
                ),
            ]);
        }
        None => {
            g.nodes.extend([
                make_node(
                    "ReduceSum",
                    "loss/correct",
                    &["loss/hit_f"],
                    &[ACC_CORRECT],
                    vec![int_attr("keepdims", 0)],
                ),
                // Counted from the label itself (not a constant): constants are copied
                // only into stages whose nodes read them.
                make_node(
                    "Size",
                    "loss/size",
                    &["loss/label_i64"],
                    &["loss/size"],
                    vec![],
                ),
                make_node(
                    "Cast",
                    "loss/counted",
                    &["loss/size"],
                    &[ACC_COUNTED],
                    vec![int_attr("to", f32_type)],
                ),
            ]);
        }
    }
    Ok(())
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

/// Checks the prediction, adds the label input, and returns the label as the loss op
/// wants it: [N, d1, ...] for logits [N, C, d1, ...] (cross entropy, `class_axis`), the
/// prediction's shape (MSE). Data often comes in another layout of the same size (e.g.
/// [B, T] targets for [B*T, V] logits), so the label is reshaped when the sizes agree.
fn prepare_label(
    g: &mut Graph,
    prediction: &str,
    label: &str,
    class_axis: bool,
    prediction_meta: &ValueMeta,
    label_meta: Option<&ValueMeta>,
) -> Result<String> {
    if !g.has_value(prediction) {
        return Err(missing("prediction", prediction, g));
    }
    if g.has_value(LOSS) {
        return Err(Error::graph(format!(
            "the model already has a value named `{LOSS}`, the name pipetrain gives the loss; \
             use `output` as the loss kind if it is the loss"
        )));
    }
    let is_input = g.inputs.iter().any(|v| v.name == label);
    let lm = match (label_meta, is_input) {
        (Some(m), _) => m.clone(),
        (None, true) => {
            return Err(Error::MissingValue {
                role: "label",
                name: label.into(),
                hint: "; its shape is unknown (no data provides it)".into(),
            })
        }
        (None, false) => return Err(missing("label", label, g)),
    };
    if !is_input {
        g.inputs.push(value_info(label, &lm));
    }
    let ps = &prediction_meta.shape;
    let want: Vec<usize> = if class_axis {
        if ps.len() < 2 {
            return Err(Error::BadTensor {
                name: prediction.into(),
                reason: format!(
                    "cross-entropy needs logits of rank >= 2 (classes on axis 1), got {ps:?}"
                ),
            });
        }
        ps.iter()
            .enumerate()
            .filter(|&(i, _)| i != 1)
            .map(|(_, &d)| d)
            .collect()
    } else {
        ps.clone()
    };
    if lm.numel() != want.iter().product::<usize>() {
        return Err(Error::BadTensor {
            name: label.into(),
            reason: format!(
                "label shape {:?} does not fit prediction shape {ps:?} (expected {want:?})",
                lm.shape
            ),
        });
    }
    if lm.shape == want {
        return Ok(label.into());
    }
    let shape = Tensor::i64(vec![want.len()], want.iter().map(|&d| d as i64).collect())?;
    g.nodes.push(constant_node("loss/label_shape", &shape));
    g.nodes.push(make_node(
        "Reshape",
        "loss/label_reshape",
        &[label, "loss/label_shape"],
        &["loss/label"],
        vec![],
    ));
    Ok("loss/label".into())
}

/// A `Constant` node whose output has the node's name.
fn constant_node(name: &str, t: &Tensor) -> crate::onnx::proto::NodeProto {
    make_node(
        "Constant",
        name,
        &[],
        &[name],
        vec![tensor_attr("value", t.to_proto(name))],
    )
}

fn missing(role: &'static str, name: &str, g: &Graph) -> Error {
    Error::MissingValue {
        role,
        name: name.to_string(),
        hint: g.value_names_hint(),
    }
}
