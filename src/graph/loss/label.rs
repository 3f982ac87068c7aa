//! The label side of a loss: the label input, and the prediction's class axis (axis 1,
//! or the last axis of a language model's `[batch, seq, vocab]` logits) brought to where
//! `SoftmaxCrossEntropyLoss` wants it.

use super::{constant_node, missing, LOSS};
use crate::graph::ir::{make_node, value_info, Graph, ValueMeta};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Checks the prediction, adds the label as a graph input when the model has none, and
/// returns the label's type and shape.
pub(super) fn label_input(
    g: &mut Graph,
    prediction: &str,
    label: &str,
    label_meta: Option<&ValueMeta>,
) -> Result<ValueMeta> {
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
    Ok(lm)
}

/// The prediction's class axis: `class_axis` when given; else the last axis when the
/// label has exactly the prediction's shape without it (a language model's logits
/// `[batch, seq, vocab]`, labels `[batch, seq]`) and not the shape without axis 1;
/// else axis 1.
pub(super) fn find_class_axis(
    prediction: &str,
    label: &str,
    class_axis: Option<i64>,
    pm: &ValueMeta,
    lm: &ValueMeta,
) -> Result<usize> {
    let rank = pm.shape.len();
    if rank < 2 {
        return Err(Error::BadTensor {
            name: prediction.into(),
            reason: format!(
                "cross-entropy needs logits of rank >= 2 (a class axis beside the batch), got {:?}",
                pm.shape
            ),
        });
    }
    if let Some(a) = class_axis {
        let axis = if a < 0 { a + rank as i64 } else { a };
        if axis < 1 || axis >= rank as i64 {
            return Err(Error::BadTensor {
                name: prediction.into(),
                reason: format!(
                    "loss.class_axis = {a} is not an axis after the batch axis of a prediction \
                     of shape {:?}",
                    pm.shape
                ),
            });
        }
        return Ok(axis as usize);
    }
    let without = |axis: usize| -> Vec<usize> {
        let mut s = pm.shape.clone();
        s.remove(axis);
        s
    };
    if rank >= 3 && lm.shape == without(rank - 1) && lm.shape != without(1) {
        tracing::debug!(
            "cross-entropy: label `{label}` {:?} takes classes on the last axis of `{prediction}` {:?}",
            lm.shape,
            pm.shape
        );
        return Ok(rank - 1);
    }
    Ok(1)
}

/// Brings the classes of `prediction` to axis 1, where `SoftmaxCrossEntropyLoss` wants
/// them; returns the value to use and the label shape it wants. Classes on the last axis
/// are a free `Reshape` to `[-1, classes]` (every position a row: the same mean over the
/// same positions); another axis is a `Transpose`.
pub(super) fn classes_on_axis_1(
    g: &mut Graph,
    prediction: &str,
    axis: usize,
    pm: &ValueMeta,
) -> Result<(String, Vec<usize>)> {
    let shape = &pm.shape;
    let rank = shape.len();
    if axis == 1 {
        let mut want = shape.clone();
        want.remove(1);
        return Ok((prediction.to_string(), want));
    }
    if axis == rank - 1 {
        let classes = shape[axis];
        let rows: usize = shape[..axis].iter().product();
        let dims = Tensor::i64(vec![2], vec![-1, classes as i64])?;
        g.nodes.push(constant_node("loss/rows_shape", &dims));
        g.nodes.push(make_node(
            "Reshape",
            "loss/logits_rows",
            &[prediction, "loss/rows_shape"],
            &["loss/logits"],
            vec![],
        ));
        return Ok(("loss/logits".into(), vec![rows]));
    }
    let mut perm: Vec<i64> = (0..rank as i64).filter(|&a| a != axis as i64).collect();
    perm.insert(1, axis as i64);
    g.nodes.push(make_node(
        "Transpose",
        "loss/classes_to_axis_1",
        &[prediction],
        &["loss/logits"],
        vec![crate::graph::ir::ints_attr("perm", &perm)],
    ));
    let mut want = shape.clone();
    want.remove(axis);
    Ok(("loss/logits".into(), want))
}

/// The label as the loss op wants it (`want`): data often comes in another layout of the
/// same size (e.g. [B, T] targets for [B*T, V] logits), so the label is reshaped when the
/// sizes agree.
pub(super) fn reshape_label(
    g: &mut Graph,
    label: &str,
    lm: &ValueMeta,
    want: &[usize],
    pm: &ValueMeta,
) -> Result<String> {
    if lm.numel() != want.iter().product::<usize>() {
        return Err(Error::BadTensor {
            name: label.into(),
            reason: format!(
                "label shape {:?} does not fit prediction shape {:?} (expected {want:?}, or \
                 the prediction's shape without its last axis)",
                lm.shape, pm.shape
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
