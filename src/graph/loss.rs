//! Attaching a loss to a forward graph (ONNX Runtime's `loss_func_info`).

use serde::{Deserialize, Serialize};

use crate::graph::ir::{
    int_attr, make_node, string_attr, tensor_attr, value_info, Graph, ValueMeta,
};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The name of the scalar loss value in every training graph.
pub const LOSS: &str = "loss";

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

impl LossSpec {
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
    let (prediction, label) = match spec {
        LossSpec::Output { name } => {
            if !g.has_value(name) {
                return Err(missing("loss output", name, g));
            }
            if prediction_meta.numel() != 1 {
                return Err(Error::BadTensor {
                    name: name.clone(),
                    reason: format!(
                        "a loss must be a scalar, this has shape {:?}",
                        prediction_meta.shape
                    ),
                });
            }
            g.nodes.push(make_node(
                "Identity",
                "loss/identity",
                &[name],
                &[LOSS],
                vec![],
            ));
            return Ok(());
        }
        LossSpec::SoftmaxCrossEntropy {
            prediction, label, ..
        }
        | LossSpec::Mse { prediction, label } => (prediction, label),
    };
    if !g.has_value(prediction) {
        return Err(missing("prediction", prediction, g));
    }
    if g.has_value(LOSS) {
        return Err(Error::graph(format!(
            "the model already has a value named `{LOSS}`, the name pipetrain gives the loss; \
             use `output` as the loss kind if it is the loss"
        )));
    }
    let lm = match (g.inputs.iter().any(|v| &v.name == label), label_meta) {
        (_, Some(m)) => m.clone(),
        (true, None) => {
            return Err(Error::MissingValue {
                role: "label",
                name: label.clone(),
                hint: "; its shape is unknown (no data provides it)".into(),
            })
        }
        (false, None) => return Err(missing("label", label, g)),
    };
    if !g.inputs.iter().any(|v| &v.name == label) {
        g.inputs.push(value_info(label, &lm));
    }
    let ps = &prediction_meta.shape;
    // The label as the loss op wants it: [N, d1, ...] for logits [N, C, d1, ...] (cross
    // entropy), the prediction's shape (MSE). Data often comes in another layout of the
    // same size (e.g. [B, T] targets for [B*T, V] logits), so reshape when sizes agree.
    let want: Vec<usize> = match spec {
        LossSpec::SoftmaxCrossEntropy { .. } => {
            if ps.len() < 2 {
                return Err(Error::BadTensor {
                    name: prediction.clone(),
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
        }
        _ => ps.clone(),
    };
    if lm.numel() != want.iter().product::<usize>() {
        return Err(Error::BadTensor {
            name: label.clone(),
            reason: format!(
                "label shape {:?} does not fit prediction shape {ps:?} (expected {want:?})",
                lm.shape
            ),
        });
    }
    let label_in = if lm.shape == want {
        label.clone()
    } else {
        let shape = Tensor::i64(vec![want.len()], want.iter().map(|&d| d as i64).collect())?;
        let s = "loss/label_shape";
        g.nodes.push(make_node(
            "Constant",
            s,
            &[],
            &[s],
            vec![tensor_attr("value", shape.to_proto(s))],
        ));
        g.nodes.push(make_node(
            "Reshape",
            "loss/label_reshape",
            &[label, s],
            &["loss/label"],
            vec![],
        ));
        "loss/label".to_string()
    };
    match spec {
        LossSpec::SoftmaxCrossEntropy { ignore_index, .. } => {
            let mut attrs = vec![string_attr("reduction", "mean")];
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
        }
        LossSpec::Mse { .. } => {
            let inv_n = 1.0 / prediction_meta.numel() as f64;
            let scale = Tensor {
                shape: vec![],
                data: match prediction_meta.dtype {
                    crate::tensor::DType::F64 => crate::tensor::TensorData::F64(vec![inv_n]),
                    _ => crate::tensor::TensorData::F32(vec![inv_n as f32]),
                },
            };
            let axes = Tensor::i64(vec![ps.len()], (0..ps.len() as i64).collect())?;
            let nodes = [
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
                make_node(
                    "Constant",
                    "loss/axes",
                    &[],
                    &["loss/axes"],
                    vec![tensor_attr("value", axes.to_proto("loss/axes"))],
                ),
                make_node(
                    "ReduceSum",
                    "loss/sum",
                    &["loss/square", "loss/axes"],
                    &["loss/sum"],
                    vec![int_attr("keepdims", 0)],
                ),
                make_node(
                    "Constant",
                    "loss/inv_n",
                    &[],
                    &["loss/inv_n"],
                    vec![tensor_attr("value", scale.to_proto("loss/inv_n"))],
                ),
                make_node(
                    "Mul",
                    "loss/mean",
                    &["loss/sum", "loss/inv_n"],
                    &[LOSS],
                    vec![],
                ),
            ];
            g.nodes.extend(nodes);
        }
        LossSpec::Output { .. } => unreachable!("handled above"),
    }
    Ok(())
}

fn missing(role: &'static str, name: &str, g: &Graph) -> Error {
    Error::MissingValue {
        role,
        name: name.to_string(),
        hint: g.value_names_hint(),
    }
}
