//! The steps of [`super::build_sharded_training_graph`] that stand on their own: checks
//! of what the model and data give, the forward's and the loss's values measured, the
//! parameters taken out of the initializers, and the forward joined with its backward.

use std::collections::HashSet;

use super::{InitValue, Param, LOSS_GRAD};
use crate::graph::autodiff::Backward;
use crate::graph::ir::{untyped_value_info, value_info, Graph, Metas, ValueMeta};
use crate::graph::loss::{LossSpec, LOSS};
use crate::graph::model_inputs::feeds_for;
use crate::graph::running_stats::Buffer;
use crate::graph::shape_probe::ShapeProbe;
use crate::graph::static_fold::probe_and_fold;
use crate::tensor::{DType, Tensor, TensorView};
use crate::{Error, Result};

/// Measures every value of the forward graph on `example` and folds what shapes and
/// constants alone compute into constants, from one run ([`probe_and_fold`]). Where the
/// inputs were `resized` to the example's (a model exported with a fixed batch), a
/// failed run says so.
pub(super) fn probe_forward(
    rt: &dyn ShapeProbe,
    g: &mut Graph,
    example: &[(&str, &Tensor)],
    trained: &HashSet<&str>,
    resized: Option<String>,
) -> Result<Metas> {
    let model_feeds = feeds_for(g, example);
    let (metas, folded) =
        probe_and_fold(g, rt, &model_feeds, trained).map_err(|e| match (resized, e) {
            (Some(what), Error::Ort { context, source }) => Error::Ort {
                context: format!(
                    "{context} ({what}; a model exported with a fixed batch size can only \
                     train micro-batches of that size)"
                ),
                source,
            },
            (_, e) => e,
        })?;
    if !folded.folded.is_empty() {
        tracing::info!(
            "{} values computed from shapes and constants alone are constants of the \
             training graph ({} nodes folded)",
            folded.folded.len(),
            folded.removed_nodes
        );
    }
    Ok(metas)
}

/// Every value of `g` (the forward with its loss, parameters `params` taken out)
/// measured on `example`: the loss's nodes alone (from node `.0` on) on top of the
/// forward's measures `.1` where those still hold (`probed`), else the whole graph.
pub(super) fn loss_metas(
    rt: &dyn ShapeProbe,
    g: &Graph,
    example: &[(&str, &Tensor)],
    params: &[(String, InitValue)],
    probed: Option<(usize, &Metas)>,
) -> Result<Metas> {
    let whole = || {
        let feeds = feeds_for(g, example);
        let mut probe_graph = g.clone();
        // Initializers again, for the probe: their bytes are shared, not copied.
        let values = params.iter().map(|(n, v)| v.to_proto(n));
        probe_graph.initializers.extend(values);
        rt.probe(&probe_graph, &feeds)
    };
    match probed {
        Some((first_loss_node, forward_metas)) => {
            let data = feeds_for(g, example);
            super::super::loss_metas::with_loss(rt, g, first_loss_node, forward_metas, &data, whole)
        }
        None => whole(),
    }
}

/// The measured type and shape of the value `loss` reads as the prediction.
pub(super) fn prediction_meta<'m>(
    g: &Graph,
    loss: &LossSpec,
    forward_metas: &'m Metas,
) -> Result<&'m ValueMeta> {
    let name = match loss {
        LossSpec::SoftmaxCrossEntropy { prediction, .. } | LossSpec::Mse { prediction, .. } => {
            prediction
        }
        LossSpec::Output { name } => name,
    };
    forward_metas.get(name).ok_or_else(|| Error::MissingValue {
        role: "prediction",
        name: name.clone(),
        hint: g.value_names_hint(),
    })
}

/// Takes the initializers of `trained` out of `g`: the parameters, by name.
pub(super) fn take_params(
    g: &mut Graph,
    trained: &HashSet<&str>,
) -> Result<Vec<(String, InitValue)>> {
    let mut params = Vec::new();
    let mut inits = Vec::new();
    for t in std::mem::take(&mut g.initializers) {
        if trained.contains(t.name.as_str()) {
            params.push((t.name.clone(), InitValue::from_proto(t)?));
        } else {
            inits.push(t);
        }
    }
    g.initializers = inits;
    Ok(params)
}

/// The loss's measured type: an error where it was not computed or is not a scalar.
pub(super) fn scalar_loss(loss_metas: &Metas) -> Result<ValueMeta> {
    let meta = loss_metas
        .get(LOSS)
        .cloned()
        .ok_or_else(|| Error::graph("the loss was not computed"))?;
    if meta.numel() != 1 {
        return Err(Error::BadTensor {
            name: LOSS.into(),
            reason: format!("the loss must be a scalar, it has shape {:?}", meta.shape),
        });
    }
    Ok(meta)
}

/// The forward `g` followed by `backward`: the loss's gradient an input, each parameter
/// the loss depends on an input with its gradient an output (the others constants of
/// the graph again).
pub(super) fn with_backward(
    g: Graph,
    backward: &Backward,
    param_values: Vec<(String, InitValue)>,
    loss_meta: &ValueMeta,
) -> (Graph, Vec<Param>) {
    let mut full = g;
    full.nodes.extend(backward.nodes.iter().cloned());
    if backward.used_contrib {
        full.import_domain("com.microsoft", 1);
    }
    if backward.used_custom {
        full.import_domain(crate::graph::custom_ops::DOMAIN, 1);
    }
    let seed_meta = ValueMeta {
        dtype: loss_meta.dtype,
        shape: vec![],
    };
    full.inputs.push(value_info(LOSS_GRAD, &seed_meta));
    let mut params = Vec::new();
    for (name, init) in param_values {
        let meta = meta_of_view(&init.view());
        match backward.grads.iter().find(|(w, _)| *w == name) {
            Some((_, grad)) => {
                full.inputs.push(value_info(&name, &meta));
                full.outputs.push(untyped_value_info(grad));
                params.push(Param {
                    grad: grad.clone(),
                    name,
                    meta,
                    init,
                });
            }
            // The loss does not depend on it: it stays a constant of the graph.
            None => full.initializers.push(init.to_proto(&name)),
        }
    }
    (full, params)
}

/// Every value of the training graph `full` measured, on `example`'s data, the
/// parameters' and buffers' initial values and a zero loss gradient of `loss_dtype`.
pub(super) fn measure(
    rt: &dyn ShapeProbe,
    full: &Graph,
    example: &[(&str, &Tensor)],
    params: &[Param],
    buffers: &[Buffer],
    loss_dtype: DType,
) -> Result<Metas> {
    let mut feeds = feeds_for(full, example);
    feeds.extend(buffers.iter().map(|b| (b.name.as_str(), &b.init)));
    let seed = Tensor::zeros(loss_dtype, vec![]);
    feeds.push((LOSS_GRAD, &seed));
    // The parameters as initializers of the probed graph: their bytes are shared with
    // the model, where feeds would be decoded copies of every one.
    let mut probed = full.clone();
    probed
        .inputs
        .retain(|v| params.iter().all(|p| p.name != v.name));
    let values = params.iter().map(|p| p.init.to_proto(&p.name));
    probed.initializers.extend(values);
    let mut metas = rt.probe(&probed, &feeds)?;
    for p in params {
        metas.insert(p.name.clone(), p.meta.clone());
    }
    Ok(metas)
}

/// The type and shape of a value seen in place.
fn meta_of_view(v: &TensorView<'_>) -> ValueMeta {
    ValueMeta {
        dtype: v.dtype(),
        shape: v.shape.to_vec(),
    }
}
