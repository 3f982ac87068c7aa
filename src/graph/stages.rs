//! Per-stage graphs: forward, backward, and the backward split into an input-gradient
//! part and a weight-gradient part (for zero-bubble schedules).
//!
//! The contract between neighbouring stages of a linear pipeline: after stage `s`'s
//! forward, every forward value computed at stages `<= s` and used at stages `> s`
//! crosses to stage `s + 1` (`fwd_send`); stage `s` receives what stage `s - 1` sent
//! (`fwd_recv`), feeds its graphs what they need and passes the rest on. Gradients cross
//! the other way (`bwd_send`, `bwd_recv`).

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::graph::ir::Graph;
use crate::graph::loss::{ACC_CORRECT, ACC_COUNTED, LOSS};
use crate::graph::partition::{constant_nodes, StageAssignment};
use crate::graph::running_stats::inference_mode;
use crate::graph::subgraph::{ancestors, external_inputs, subgraph, with_constants};
use crate::graph::tied::{node_stages, tied_params};
use crate::graph::training::TrainingGraph;
use crate::{Error, Result};

/// What one stage exchanges with its neighbours and keeps between its passes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageIo {
    /// Parameters this stage owns (and updates).
    pub params: Vec<String>,
    /// Data inputs its graphs read (model inputs, label).
    pub data: Vec<String>,
    /// Forward values arriving from the previous stage.
    pub fwd_recv: Vec<String>,
    /// Forward values leaving for the next stage.
    pub fwd_send: Vec<String>,
    /// Gradients arriving from the next stage.
    pub bwd_recv: Vec<String>,
    /// Gradients leaving for the previous stage.
    pub bwd_send: Vec<String>,
    /// Forward values the backward reads (produced here or received), kept per micro-batch.
    pub stash: Vec<String>,
    /// Values the input-gradient graph hands to the weight-gradient graph.
    pub i_to_w: Vec<String>,
    /// Whether this stage computes the loss (and its backward reads `loss_grad`).
    pub has_loss: bool,
    /// Running statistics this stage keeps: `(buffer, the forward value updating it)`.
    pub buffers: Vec<(String, String)>,
}

/// The graphs of one pipeline stage.
#[derive(Debug, Clone)]
pub struct StageGraphs {
    /// Stage index.
    pub stage: usize,
    /// Forward: activations for the next stage, the stash, and the loss on the last stage.
    pub forward: Graph,
    /// Forward for evaluation: activations for the next stage and the loss, nothing kept.
    pub evaluate: Graph,
    /// Full backward: gradients for the previous stage and for this stage's parameters.
    pub backward: Graph,
    /// Input-gradient half of the backward (may have no nodes on the first stage).
    pub backward_input: Graph,
    /// Weight-gradient half of the backward.
    pub backward_weight: Graph,
    /// On the last stage (whose backward needs nothing from another stage): forward and
    /// backward as one graph, giving the loss, the gradients for the previous stage and
    /// the parameter gradients in one run, with no stash between two sessions.
    pub fused: Option<Graph>,
    /// The exchange contract.
    pub io: StageIo,
}

/// What a stage keeps of a micro-batch between its forward and its backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Every forward value the backward reads (fastest, most memory).
    #[default]
    None,
    /// Only what the stage received (and its data): the backward graphs run the
    /// stage's forward again. Under a split backward the input-gradient part recomputes
    /// it once and hands the weight-gradient part the values it reads. The last stage
    /// of an unsplit schedule runs forward and backward in one graph and keeps nothing
    /// either way.
    Stage,
}

/// Op types whose output a second run would draw anew (Dropout only in training mode).
fn draws_randomly(n: &crate::onnx::proto::NodeProto) -> bool {
    match n.op_type.as_str() {
        "Dropout" => n.input.get(2).is_some_and(|v| !v.is_empty()),
        t => t.starts_with("Random") || matches!(t, "Bernoulli" | "Multinomial"),
    }
}

/// Cuts the training graph into per-stage graphs, keeping every forward value the
/// backward reads ([`Recompute::None`]).
///
/// # Errors
/// As [`build_stage_graphs_with`].
pub fn build_stage_graphs(tg: &TrainingGraph, a: &StageAssignment) -> Result<Vec<StageGraphs>> {
    build_stage_graphs_with(tg, a, Recompute::None)
}

/// Cuts the training graph into per-stage graphs, with `recompute` deciding what a
/// stage keeps between its passes.
///
/// # Errors
/// `Partition` when a parameter is read by more than one stage (tied weights: pass the
/// graph through [`crate::graph::with_tied_shared`] first), when a stage would not
/// compute the gradient of a parameter it owns, or when recomputing would rerun a random op (its second draw would not match the
/// forward's).
pub fn build_stage_graphs_with(
    tg: &TrainingGraph,
    a: &StageAssignment,
    recompute: Recompute,
) -> Result<Vec<StageGraphs>> {
    let g = &tg.graph;
    let is_const = constant_nodes(tg);
    let node_stage = node_stages(tg, a);
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            producer.insert(o, i);
        }
    }
    let data: HashSet<&str> = tg.data_inputs.iter().map(String::as_str).collect();

    // Which stages use each value (and each parameter).
    let mut users: HashMap<&str, BTreeSet<usize>> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(s) = node_stage[i] {
            for v in n.input.iter().filter(|v| !v.is_empty()) {
                users.entry(v.as_str()).or_default().insert(s);
            }
        }
    }
    if let Some(t) = tied_params(tg, a).first() {
        return Err(Error::Partition {
            reason: format!(
                "parameter `{}` is read by stages {:?}; share it first (graph::with_tied_shared)",
                t.name, t.stages
            ),
        });
    }
    let crossing = |s: usize, forward: bool| -> Vec<String> {
        let mut out: Vec<String> = producer
            .iter()
            .filter(|(_, &i)| {
                node_stage[i].is_some_and(|ps| if forward { ps <= s } else { ps >= s })
                    && (i < tg.forward_len) == forward
            })
            .filter(|(v, _)| {
                users
                    .get(*v)
                    .is_some_and(|u| u.iter().any(|&us| if forward { us > s } else { us < s }))
            })
            .map(|(v, _)| v.to_string())
            .collect();
        out.sort_by_key(|v| producer[v.as_str()]);
        out
    };

    let mut result = Vec::with_capacity(a.stages);
    for s in 0..a.stages {
        let fwd: Vec<usize> = (0..tg.forward_len)
            .filter(|&i| node_stage[i] == Some(s))
            .collect();
        let bwd: Vec<usize> = (tg.forward_len..g.nodes.len())
            .filter(|&i| node_stage[i] == Some(s))
            .collect();
        let fwd_send = crossing(s, true);
        let fwd_recv = if s == 0 {
            vec![]
        } else {
            crossing(s - 1, true)
        };
        let bwd_send = if s == 0 { vec![] } else { crossing(s, false) };
        let bwd_recv = if s + 1 == a.stages {
            vec![]
        } else {
            crossing(s + 1, false)
        };

        let produced = |nodes: &[usize]| -> HashSet<&str> {
            nodes
                .iter()
                .flat_map(|&i| g.nodes[i].output.iter().map(String::as_str))
                .collect()
        };
        let (fwd_made, bwd_made) = (produced(&fwd), produced(&bwd));
        let bwd_full = with_constants(g, &bwd, &producer, &is_const);
        let bwd_inputs = external_inputs(g, &bwd_full);
        let stash: Vec<String> = bwd_inputs
            .iter()
            .filter(|v| fwd_made.contains(v.as_str()) || fwd_recv.contains(v))
            .cloned()
            .collect();
        let has_loss = fwd_made.contains(LOSS);
        let mut fwd_outputs: Vec<String> = fwd_send
            .iter()
            .filter(|v| fwd_made.contains(v.as_str()))
            .cloned()
            .collect();
        for v in &stash {
            if fwd_made.contains(v.as_str()) && !fwd_outputs.contains(v) {
                fwd_outputs.push(v.clone());
            }
        }
        if has_loss && !fwd_outputs.iter().any(|v| v == LOSS) {
            fwd_outputs.push(LOSS.into());
        }
        let buffers: Vec<(String, String)> = tg
            .buffers
            .iter()
            .filter(|b| fwd_made.contains(b.update.as_str()))
            .map(|b| (b.name.clone(), b.update.clone()))
            .collect();
        let updates: Vec<String> = buffers.iter().map(|(_, u)| u.clone()).collect();
        fwd_outputs.extend(updates.iter().cloned());
        let stage_params: Vec<String> = tg
            .params
            .iter()
            .filter(|p| users.get(p.name.as_str()).is_some_and(|u| u.contains(&s)))
            .map(|p| p.name.clone())
            .collect();
        let grads: Vec<String> = tg
            .params
            .iter()
            .filter(|p| bwd_made.contains(p.grad.as_str()))
            .map(|p| p.grad.clone())
            .collect();
        if let Some(p) = tg
            .params
            .iter()
            .find(|p| bwd_made.contains(p.grad.as_str()) && !stage_params.contains(&p.name))
        {
            return Err(Error::Partition {
                reason: format!(
                    "stage {s} would compute the gradient of `{}`, which another stage holds",
                    p.name
                ),
            });
        }
        let mut bwd_outputs: Vec<String> = bwd_send
            .iter()
            .filter(|v| bwd_made.contains(v.as_str()))
            .cloned()
            .collect();
        bwd_outputs.extend(grads.iter().cloned());

        // Split backward: nodes the outgoing gradients depend on, and the rest.
        let targets: HashSet<&str> = bwd_send
            .iter()
            .filter(|v| bwd_made.contains(v.as_str()))
            .map(String::as_str)
            .collect();
        let input_part = ancestors(g, &bwd, &targets, &producer);
        let weight_part: Vec<usize> = bwd
            .iter()
            .copied()
            .filter(|i| !input_part.contains(i))
            .collect();
        let input_nodes: Vec<usize> = bwd
            .iter()
            .copied()
            .filter(|i| input_part.contains(i))
            .collect();
        let weight_full = with_constants(g, &weight_part, &producer, &is_const);
        let input_made = produced(&input_nodes);
        let i_to_w: Vec<String> = external_inputs(g, &weight_full)
            .into_iter()
            .filter(|v| input_made.contains(v.as_str()))
            .collect();
        let mut input_targets: Vec<String> = targets.iter().map(|v| v.to_string()).collect();
        input_targets.sort_by_key(|v| producer[v.as_str()]);

        let fwd_full = with_constants(g, &fwd, &producer, &is_const);
        let mut used_data: BTreeSet<String> = BTreeSet::new();
        for set in [&fwd_full, &bwd_full] {
            for v in external_inputs(g, set) {
                if data.contains(v.as_str()) {
                    used_data.insert(v);
                }
            }
        }
        let input_full = with_constants(g, &input_nodes, &producer, &is_const);
        let label = |part: &str| format!("stage{s}_{part}");
        let mut eval_outputs: Vec<String> = fwd_send
            .iter()
            .filter(|v| fwd_made.contains(v.as_str()))
            .cloned()
            .collect();
        if has_loss {
            eval_outputs.push(LOSS.into());
            // Classification losses also count correct predictions for evaluation.
            if [ACC_CORRECT, ACC_COUNTED]
                .iter()
                .all(|v| fwd_made.contains(v))
            {
                eval_outputs.push(ACC_CORRECT.into());
                eval_outputs.push(ACC_COUNTED.into());
            }
        }
        let fused = if has_loss && bwd_recv.is_empty() {
            let mut nodes: Vec<usize> = fwd_full.iter().chain(&bwd_full).copied().collect();
            nodes.sort_unstable();
            nodes.dedup();
            let mut outputs = vec![LOSS.to_string()];
            outputs.extend(bwd_outputs.iter().cloned());
            outputs.extend(updates.iter().cloned());
            Some(subgraph(tg, &nodes, &outputs, &label("forward_backward"))?)
        } else {
            None
        };
        let (mut bwd_nodes, mut input_nodes) = (bwd_full, input_full);
        let (mut stash, mut i_to_w) = (stash, i_to_w);
        if recompute == Recompute::Stage {
            if let Some(&i) = fwd.iter().find(|&&i| draws_randomly(&g.nodes[i])) {
                let n = &g.nodes[i];
                return Err(Error::Partition {
                    reason: format!(
                        "recompute = \"stage\" would run stage {s}'s `{}` ({}) again and draw anew, so its gradients would not match its forward; use recompute = \"none\"",
                        n.name, n.op_type
                    ),
                });
            }
            // The backward graphs start with the stage's forward; the forward keeps
            // nothing but what it sends, and the stash only what arrived.
            let with_fwd = |nodes: &[usize]| -> Vec<usize> {
                let set: BTreeSet<usize> = fwd_full.iter().chain(nodes).copied().collect();
                set.into_iter().collect()
            };
            bwd_nodes = with_fwd(&bwd_nodes);
            input_nodes = with_fwd(&input_nodes);
            let recomputed = produced(&input_nodes);
            i_to_w = external_inputs(g, &weight_full)
                .into_iter()
                .filter(|v| recomputed.contains(v.as_str()))
                .collect();
            fwd_outputs.retain(|v| fwd_send.contains(v) || v == LOSS || updates.contains(v));
            let read: HashSet<String> = [&bwd_nodes, &input_nodes, &weight_full]
                .into_iter()
                .flat_map(|nodes| external_inputs(g, nodes))
                .collect();
            stash = fwd_recv
                .iter()
                .filter(|v| read.contains(*v))
                .cloned()
                .collect();
        }
        let input_outputs = [input_targets, i_to_w.clone()].concat();
        let mut evaluate = subgraph(tg, &fwd_full, &eval_outputs, &label("evaluate"))?;
        inference_mode(&mut evaluate, &tg.buffers);
        result.push(StageGraphs {
            stage: s,
            forward: subgraph(tg, &fwd_full, &fwd_outputs, &label("forward"))?,
            evaluate,
            backward: subgraph(tg, &bwd_nodes, &bwd_outputs, &label("backward"))?,
            backward_input: subgraph(tg, &input_nodes, &input_outputs, &label("backward_input"))?,
            backward_weight: subgraph(tg, &weight_full, &grads, &label("backward_weight"))?,
            fused,
            io: StageIo {
                params: stage_params,
                data: used_data.into_iter().collect(),
                fwd_recv,
                fwd_send,
                bwd_recv,
                bwd_send,
                stash,
                i_to_w,
                has_loss,
                buffers,
            },
        });
    }
    Ok(result)
}
