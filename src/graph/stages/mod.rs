//! Per-stage graphs: forward, backward, and the backward split into an input-gradient
//! part and a weight-gradient part (for zero-bubble schedules).
//!
//! The contract between neighbouring stages of a linear pipeline: after stage `s`'s
//! forward, every forward value computed at stages `<= s` and used at stages `> s`
//! crosses to stage `s + 1` (`fwd_send`); stage `s` receives what stage `s - 1` sent
//! (`fwd_recv`), feeds its graphs what they need and passes the rest on. Gradients cross
//! the other way (`bwd_send`, `bwd_recv`).

mod accumulate;
mod cut;

pub use accumulate::{accumulating, ACC_SUFFIX};

use serde::{Deserialize, Serialize};

use crate::graph::ir::Graph;
use crate::graph::partition::StageAssignment;
use crate::graph::training::TrainingGraph;
use crate::Result;
use cut::Cut;

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
    /// Of `fwd_recv` and `fwd_send`: a parameter's value handed on unchanged (a tied
    /// weight, `graph::tied`), the same in every micro-batch of a step.
    pub tied: Vec<String>,
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
    let cut = Cut::new(tg, a)?;
    (0..a.stages).map(|s| cut.stage(s, recompute)).collect()
}
