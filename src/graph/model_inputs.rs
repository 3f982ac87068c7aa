//! The model graph made ready for a training graph: model inputs declared with the
//! micro-batch's shape, the example's feeds, and the optional outputs the backward
//! rules read, named.

use crate::graph::ir::{node_label, value_info, Graph, ValueMeta};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Micro-batches may be smaller than the batch the model was exported with: declares each
/// model input with the example's shape when only sizes (not ranks or types) differ.
/// Returns a description of the first change, for errors.
pub(crate) fn fit_inputs_to_example(
    g: &mut Graph,
    example: &[(&str, &Tensor)],
) -> Result<Option<String>> {
    let mut changed = None;
    for v in &mut g.inputs {
        let Some((_, t)) = example.iter().find(|(n, _)| *n == v.name) else {
            continue;
        };
        let Some((elem, dims)) = crate::graph::ir::declared_type(v) else {
            continue;
        };
        if elem != t.dtype().onnx() || dims.len() != t.shape.len() {
            return Err(Error::BadTensor {
                name: v.name.clone(),
                reason: format!(
                    "the model declares element type {elem} and rank {}, the data gives {:?} {:?}",
                    dims.len(),
                    t.dtype(),
                    t.shape
                ),
            });
        }
        let fits = dims
            .iter()
            .zip(&t.shape)
            .all(|(d, &n)| d.is_none_or(|d| d == n as i64));
        if !fits {
            changed.get_or_insert(format!(
                "model input `{}` is declared {dims:?}, the micro-batch is {:?}",
                v.name, t.shape
            ));
            *v = value_info(&v.name, &meta_of(t));
        }
    }
    Ok(changed)
}

/// The example tensors that are inputs of `g` (data files may hold more arrays).
pub(crate) fn feeds_for<'a>(
    g: &Graph,
    example: &[(&'a str, &'a Tensor)],
) -> Vec<(&'a str, &'a Tensor)> {
    example
        .iter()
        .filter(|(n, _)| g.inputs.iter().any(|v| v.name == *n))
        .copied()
        .collect()
}

/// The type and shape of `t`.
pub(crate) fn meta_of(t: &Tensor) -> ValueMeta {
    ValueMeta {
        dtype: t.dtype(),
        shape: t.shape.clone(),
    }
}

/// Names the optional outputs that backward rules read (LayerNormalization's statistics,
/// SoftmaxCrossEntropyLoss's log-probabilities, Dropout's mask, MaxPool's indices) when
/// the model leaves them out.
pub(crate) fn add_outputs_backward_needs(g: &mut Graph) {
    for n in &mut g.nodes {
        if !(n.domain.is_empty() || n.domain == "ai.onnx") {
            continue;
        }
        let wanted: &[&str] = match n.op_type.as_str() {
            "LayerNormalization" => &["", "mean", "inv_std_dev"],
            "SoftmaxCrossEntropyLoss" => &["", "log_prob"],
            "Dropout" => &["", "mask"],
            "MaxPool" => &["", "indices"],
            _ => continue,
        };
        let label = node_label(n);
        for (i, suffix) in wanted.iter().enumerate().skip(1) {
            if n.output.len() <= i {
                n.output.resize(i + 1, String::new());
            }
            if n.output[i].is_empty() {
                n.output[i] = format!("{label}/{suffix}");
            }
        }
    }
}
