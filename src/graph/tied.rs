//! Parameters read by several pipeline stages: tied weights, such as GPT-2's token
//! embedding that is also its language-model head (first and last stage).
//!
//! The first stage that reads such a parameter owns it: it alone holds, updates and
//! checkpoints it. An `Identity` node on that stage hands its value on as a forward value,
//! and the later stages read that value instead, so it travels like an activation and
//! every schedule, recompute mode and process layout carries it unchanged (the same in
//! every micro-batch of a step, it crosses with the step's first forward only:
//! `pipeline::tied`). Its gradients travel back the same way: the parameter's gradient `Sum` sits
//! on the owner stage (autodiff anchors it at the parameter's first reader), so the
//! contributions of later stages cross back as gradients and are summed there before the
//! update, as DeepSpeed's `TiedLayerSpec` sums the copies' gradients.
//!
//! The price is traffic: a gradient of the parameter's size crosses each stage
//! boundary between its readers once per micro-batch, where a per-step reduction between
//! the readers would send it once per step.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use crate::graph::partition::StageAssignment;
use crate::graph::training::TrainingGraph;
use crate::onnx::proto::NodeProto;

/// A parameter read by several stages, and how the later ones get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiedParam {
    /// The parameter.
    pub name: String,
    /// The stages that read it; the first owns it.
    pub stages: BTreeSet<usize>,
    /// The forward value later stages read in its place.
    pub shared: String,
}

/// The stage of every node of `tg` under `a`: forward nodes as assigned (the update
/// nodes of a running statistic where the node reading it is), backward nodes with their
/// anchor.
pub(crate) fn node_stages(tg: &TrainingGraph, a: &StageAssignment) -> Vec<Option<usize>> {
    let mut stages: Vec<Option<usize>> = (0..tg.graph.nodes.len())
        .map(|i| {
            if i < tg.forward_len {
                a.stage[i]
            } else {
                a.stage[tg.anchors[i - tg.forward_len]]
            }
        })
        .collect();
    if !tg.buffers.is_empty() {
        let index: HashMap<&str, usize> = tg.graph.nodes[..tg.forward_len]
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.as_str(), i))
            .collect();
        for b in &tg.buffers {
            let Some(&reader) = index.get(b.reader.as_str()) else {
                continue;
            };
            for i in b.nodes.iter().filter_map(|n| index.get(n.as_str())) {
                stages[*i] = stages[reader];
            }
        }
    }
    stages
}

/// The parameters that nodes of more than one stage read, in parameter order.
pub fn tied_params(tg: &TrainingGraph, a: &StageAssignment) -> Vec<TiedParam> {
    let node_stage = node_stages(tg, a);
    tg.params
        .iter()
        .filter_map(|p| {
            let stages: BTreeSet<usize> = tg
                .graph
                .nodes
                .iter()
                .zip(&node_stage)
                .filter(|(n, _)| n.input.contains(&p.name))
                .filter_map(|(_, s)| *s)
                .collect();
            (stages.len() > 1).then(|| TiedParam {
                name: p.name.clone(),
                stages,
                shared: format!("{}__shared", p.name),
            })
        })
        .collect()
}

/// `tg` and `a` with every tied parameter shared from its first stage (see the module
/// doc); `tg` itself, borrowed, when no parameter is read by two stages.
pub fn with_tied_shared(
    tg: &TrainingGraph,
    mut a: StageAssignment,
) -> (Cow<'_, TrainingGraph>, StageAssignment) {
    let tied = tied_params(tg, &a);
    if tied.is_empty() {
        return (Cow::Borrowed(tg), a);
    }
    let mut shared = tg.clone();
    share_tied_params(&mut shared, &mut a, &tied);
    (Cow::Owned(shared), a)
}

/// Rewrites `tg` and `a` so that each parameter of `tied` is read by its first stage only
/// (see the module doc). The `Identity` nodes come first in the graph, on the owner
/// stages; backward anchors shift with them.
fn share_tied_params(tg: &mut TrainingGraph, a: &mut StageAssignment, tied: &[TiedParam]) {
    if tied.is_empty() {
        return;
    }
    let node_stage = node_stages(tg, a);
    for (n, stage) in tg.graph.nodes.iter_mut().zip(&node_stage) {
        for t in tied {
            let owner = t.stages.first().copied();
            if stage.is_some() && *stage != owner {
                for v in n.input.iter_mut().filter(|v| **v == t.name) {
                    v.clone_from(&t.shared);
                }
            }
        }
    }
    let k = tied.len();
    let sends = tied.iter().map(|t| NodeProto {
        name: format!("share_{}", t.name),
        op_type: "Identity".into(),
        input: vec![t.name.clone()],
        output: vec![t.shared.clone()],
        ..Default::default()
    });
    tg.graph.nodes.splice(0..0, sends);
    tg.forward_len += k;
    for anchor in &mut tg.anchors {
        *anchor += k;
    }
    a.stage
        .splice(0..0, tied.iter().map(|t| t.stages.first().copied()));
    for t in tied {
        if let Some(meta) = tg.metas.get(&t.name).cloned() {
            tg.metas.insert(t.shared.clone(), meta);
        }
        tracing::info!(
            "parameter `{}` is read by stages {:?}: stage {} owns it and hands its value on with each micro-batch; the other stages' gradients are summed there",
            t.name,
            t.stages,
            t.stages.first().copied().unwrap_or(0)
        );
    }
}
