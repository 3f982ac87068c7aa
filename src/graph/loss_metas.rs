//! The types and shapes of a graph once its loss is attached, without running its
//! forward again: the forward's were measured before the loss was added, so only the
//! loss's own nodes are probed, with the prediction fed as zeros of its measured shape
//! (a shape does not depend on values). For GPT-2 small at batch 4 x 1024 that saves a
//! whole forward pass at startup. Where the forward was rewritten after it was measured
//! (tensor shards, split sequences: the caller's choice), the loss reads some other
//! forward value, or the probe cannot run the small graph, the whole graph is probed as
//! before.

use std::collections::HashSet;

use crate::graph::ir::{untyped_value_info, value_info, Graph, Metas};
use crate::graph::loss::LOSS;
use crate::graph::model_inputs::meta_of;
use crate::graph::shape_probe::ShapeProbe;
use crate::tensor::Tensor;
use crate::Result;

/// The metas of `g`, whose nodes from `first` on are the loss's, given `forward` (the
/// metas of everything before) and the data `feeds`; `whole` probes the whole graph,
/// the fallback.
pub(super) fn with_loss(
    rt: &dyn ShapeProbe,
    g: &Graph,
    first: usize,
    forward: &Metas,
    feeds: &[(&str, &Tensor)],
    whole: impl FnOnce() -> Result<Metas>,
) -> Result<Metas> {
    match loss_only(rt, g, first, forward, feeds) {
        Some(loss) => {
            let mut metas = forward.clone();
            metas.extend(loss);
            Ok(metas)
        }
        None => whole(),
    }
}

fn loss_only(
    rt: &dyn ShapeProbe,
    g: &Graph,
    first: usize,
    forward: &Metas,
    feeds: &[(&str, &Tensor)],
) -> Option<Metas> {
    let nodes = g.nodes.get(first..)?;
    let made: HashSet<&str> = nodes
        .iter()
        .flat_map(|n| &n.output)
        .map(String::as_str)
        .collect();
    let read: HashSet<&str> = nodes
        .iter()
        .flat_map(|n| &n.input)
        .map(String::as_str)
        .filter(|v| !v.is_empty() && !made.contains(v))
        .collect();
    let mut small = Graph {
        name: g.name.clone(),
        nodes: nodes.to_vec(),
        outputs: vec![untyped_value_info(LOSS)],
        opsets: g.opsets.clone(),
        ir_version: g.ir_version,
        ..Graph::default()
    };
    let mut fed: Vec<(&str, &Tensor)> = Vec::new();
    let mut zeros = None;
    for &v in &read {
        if let Some(t) = g.initializer(v) {
            small.initializers.push(t.clone());
        } else if let Some(&(n, t)) = feeds.iter().find(|(n, _)| *n == v) {
            small.inputs.push(value_info(n, &meta_of(t)));
            fed.push((n, t));
        } else if zeros.is_none() {
            // A forward value: only one (the prediction) is worth feeding, as zeros.
            let meta = forward.get(v)?;
            small.inputs.push(value_info(v, meta));
            zeros = Some((v, Tensor::zeros(meta.dtype, meta.shape.clone())));
        } else {
            return None;
        }
    }
    fed.extend(zeros.as_ref().map(|(n, t)| (*n, t)));
    rt.probe(&small, &fed).ok()
}
