//! Exporting the trained inference model: the original forward model with the trained
//! values in its initializers (no loss, no gradient nodes). A training-mode
//! `BatchNormalization` whose running statistics were trained along is put in inference
//! mode, normalizing with them, as PyTorch's `eval()` does, and so is a training-mode
//! `Dropout` whose mask nothing reads (an identity then, as `eval()` makes it).

use std::collections::HashSet;

use crate::onnx::proto::ModelProto;
use crate::onnx::MAX_IR_VERSION;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// `original` with each named initializer replaced by its trained value.
///
/// # Errors
/// `MissingValue` when a name is not an initializer of the model; `BadTensor` when a
/// value's type or shape differs from the initializer's.
pub fn export_inference_model(
    original: &ModelProto,
    trained: &[(&str, &Tensor)],
) -> Result<ModelProto> {
    let mut model = original.clone();
    model.ir_version = model.ir_version.min(MAX_IR_VERSION);
    let graph = model
        .graph
        .as_mut()
        .ok_or_else(|| Error::graph("the model has no graph"))?;
    for (name, value) in trained {
        let slot = graph
            .initializer
            .iter_mut()
            .find(|t| t.name == *name)
            .ok_or_else(|| Error::MissingValue {
                role: "trained parameter",
                name: name.to_string(),
                hint: "; it is not an initializer of the original model".into(),
            })?;
        let dims: Vec<i64> = value.shape.iter().map(|&d| d as i64).collect();
        if slot.dims != dims || slot.data_type != value.dtype().onnx() {
            return Err(Error::BadTensor {
                name: name.to_string(),
                reason: format!(
                    "trained value has type {:?} shape {:?}, the model's initializer type code {} shape {:?}",
                    value.dtype(),
                    dims,
                    slot.data_type,
                    slot.dims
                ),
            });
        }
        *slot = value.to_proto(name);
    }
    // A run drops its copy of the values it trains (`train::run`): each must be given.
    if let Some(t) = graph.initializer.iter().find(|t| holds_nothing(t)) {
        return Err(Error::MissingValue {
            role: "trained parameter",
            name: t.name.clone(),
            hint: "; the run did not hand back its trained value".into(),
        });
    }
    let given: HashSet<&str> = trained.iter().map(|(n, _)| *n).collect();
    let read: HashSet<String> = graph
        .node
        .iter()
        .flat_map(|n| n.input.iter().cloned())
        .chain(graph.output.iter().map(|o| o.name.clone()))
        .collect();
    for n in &mut graph.node {
        let training = n.op_type == "BatchNormalization"
            && n.attribute
                .iter()
                .any(|a| a.name == "training_mode" && a.i == 1);
        let with_stats =
            n.input.len() == 5 && n.input[3..].iter().all(|v| given.contains(v.as_str()));
        let unread = n.output.iter().skip(1).all(|o| !read.contains(o));
        if training && with_stats && unread {
            n.attribute.retain(|a| a.name != "training_mode");
            n.output.truncate(1);
        }
        let dropout = n.op_type == "Dropout" && (n.domain.is_empty() || n.domain == "ai.onnx");
        if dropout && n.input.len() > 2 && unread {
            n.input.truncate(2);
            n.output.truncate(1);
        }
    }
    Ok(model)
}

/// Whether `t` has elements but no data in any field (nor external data).
fn holds_nothing(t: &crate::onnx::proto::TensorProto) -> bool {
    let elements: i64 = t.dims.iter().product();
    elements > 0
        && t.raw_data.is_empty()
        && t.float_data.is_empty()
        && t.double_data.is_empty()
        && t.int32_data.is_empty()
        && t.int64_data.is_empty()
        && t.uint64_data.is_empty()
        && t.string_data.is_empty()
        && t.external_data.is_empty()
}

/// The trained model's metadata key: the optimizer steps it trained.
pub const STEPS_KEY: &str = "pipetrain.optimizer_steps";
/// The trained model's metadata key: the run's optimizer steps in all.
pub const TOTAL_KEY: &str = "pipetrain.num_optimizer_steps";
/// The trained model's metadata key: `true` when it trained every step, `false` when a
/// signal stopped the run first.
pub const COMPLETE_KEY: &str = "pipetrain.complete";

/// Records in `model`'s metadata that it trained `done` of `total` optimizer steps.
pub fn mark_trained_steps(model: &mut crate::onnx::proto::ModelProto, (done, total): (u64, u64)) {
    use crate::onnx::proto::StringStringEntryProto;
    let ours = [STEPS_KEY, TOTAL_KEY, COMPLETE_KEY];
    model
        .metadata_props
        .retain(|e| !ours.contains(&e.key.as_str()));
    let values = [
        done.to_string(),
        total.to_string(),
        (done >= total).to_string(),
    ];
    for (key, value) in ours.into_iter().zip(values) {
        model.metadata_props.push(StringStringEntryProto {
            key: key.into(),
            value,
        });
    }
}
