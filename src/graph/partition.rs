//! Assigning forward nodes to pipeline stages: at given cut edges, or balanced by
//! parameter count, FLOPs or measured time.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::graph::training::TrainingGraph;
use crate::{Error, Result};

/// How to cut the model into pipeline stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Partition {
    /// Stage k ends where tensor `k` is produced (k + 1 stages for k cut tensors).
    CutAt(Vec<String>),
    /// `stages` contiguous stages with about equal cost.
    Balanced {
        /// Number of stages.
        stages: usize,
        /// What to balance.
        by: BalanceBy,
    },
    /// `stages` contiguous stages with about equal sums of each forward node's `times`
    /// (by node name; a node not named costs nothing): what `by = "time"` becomes once
    /// `pipeline.profile` is read.
    Weighted {
        /// Number of stages.
        stages: usize,
        /// Seconds per forward node (its forward and its backward), by name.
        times: BTreeMap<String, f64>,
    },
}

/// The cost balanced across stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BalanceBy {
    /// Number of trainable parameters each stage holds.
    Params,
    /// Forward floating-point operations (matrix products and convolutions dominate).
    Flops,
    /// Each node's measured time, forward and backward (`pipeline.profile`, written by
    /// `pipetrain plan --save-profile`).
    Time,
}

/// Each forward node's measured time (its forward and its backward, seconds per
/// micro-batch) by name, as `pipetrain plan --save-profile` writes it for `pipeline.profile`
/// (the file's other fields are what cutting on a schedule's critical path reads:
/// `crate::cost::SavedProfile`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeTimes {
    /// Samples per micro-batch the times were measured at.
    pub micro_batch: usize,
    /// Intra-op threads they were measured with.
    pub threads: usize,
    /// Seconds by forward node name.
    pub times: BTreeMap<String, f64>,
}

/// The stage of each forward node (`None` for constant nodes, which every stage that
/// needs them computes for itself), and the number of stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageAssignment {
    /// Per forward node.
    pub stage: Vec<Option<usize>>,
    /// Number of stages.
    pub stages: usize,
}

/// Which forward nodes compute only constants (no data or parameter flows into them).
pub(crate) fn constant_nodes(tg: &TrainingGraph) -> Vec<bool> {
    let g = &tg.graph;
    let mut variable: HashSet<&str> = g.inputs.iter().map(|v| v.name.as_str()).collect();
    let mut is_const = vec![false; tg.forward_len];
    for (i, n) in g.nodes[..tg.forward_len].iter().enumerate() {
        if n.input.iter().any(|v| variable.contains(v.as_str())) {
            variable.extend(n.output.iter().map(String::as_str));
        } else {
            is_const[i] = true;
        }
    }
    is_const
}

/// Assigns stages.
///
/// # Errors
/// `MissingValue` for a cut tensor that is not computed by the model, `Partition` when
/// cuts are out of order or there are more stages than nodes.
pub fn assign_stages(tg: &TrainingGraph, p: &Partition) -> Result<StageAssignment> {
    let is_const = constant_nodes(tg);
    let fwd = &tg.graph.nodes[..tg.forward_len];
    let live: Vec<usize> = (0..fwd.len()).filter(|&i| !is_const[i]).collect();
    let boundaries: Vec<usize> = match p {
        Partition::CutAt(cuts) => {
            let producers: HashMap<&str, usize> = fwd
                .iter()
                .enumerate()
                .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
                .collect();
            let mut last = None;
            let mut out = Vec::new();
            for c in cuts {
                let &i = producers
                    .get(c.as_str())
                    .ok_or_else(|| Error::MissingValue {
                        role: "cut edge",
                        name: c.clone(),
                        hint: "; a cut edge must be a tensor computed by a node of the model"
                            .into(),
                    })?;
                if is_const[i] {
                    return Err(Error::Partition {
                        reason: format!("cut edge `{c}` is a constant, not an activation"),
                    });
                }
                if last.is_some_and(|l| i <= l) {
                    return Err(Error::Partition {
                        reason: format!("cut edge `{c}` is computed before the previous cut edge; list cuts in model order"),
                    });
                }
                last = Some(i);
                // Stage boundary: the position in `live` just after the producer.
                out.push(live.iter().position(|&x| x > i).unwrap_or(live.len()));
            }
            out
        }
        Partition::Balanced {
            by: BalanceBy::Time,
            ..
        } => {
            return Err(Error::Partition {
                reason: "balancing by time needs the nodes' times: set pipeline.profile to a \
                         file `pipetrain plan --save-profile` wrote"
                    .into(),
            })
        }
        Partition::Balanced { stages, by } => {
            let costs: Vec<f64> = live.iter().map(|&i| node_cost(tg, i, *by)).collect();
            balanced(&costs, *stages)?
        }
        Partition::Weighted { stages, times } => {
            let fwd = &tg.graph.nodes;
            let costs: Vec<f64> = live
                .iter()
                .map(|&i| times.get(&fwd[i].name).copied().unwrap_or(0.0))
                .collect();
            balanced(&costs, *stages)?
        }
    };
    let mut stage = vec![None; fwd.len()];
    for (pos, &i) in live.iter().enumerate() {
        stage[i] = Some(boundaries.iter().filter(|&&b| b <= pos).count());
    }
    let stages = boundaries.len() + 1;
    for s in 0..stages {
        if !stage.contains(&Some(s)) {
            return Err(Error::Partition {
                reason: format!("stage {s} would hold no computing node"),
            });
        }
    }
    Ok(StageAssignment { stage, stages })
}

/// The training step's floating-point operations per node, about: three times the
/// forward's (its products again for the inputs' and the weights' gradients; one
/// operation per value made by a node that is not a product) over the forward's
/// computing nodes and the backward's. What one kernel call has to amortize
/// its start (and, split across threads, the thread pool's hand-over) over.
pub fn flops_per_node(tg: &TrainingGraph) -> f64 {
    let is_const = constant_nodes(tg);
    let live: Vec<usize> = (0..tg.forward_len).filter(|&i| !is_const[i]).collect();
    let forward: f64 = live
        .iter()
        .map(|&i| node_cost(tg, i, BalanceBy::Flops))
        .sum();
    let nodes = live.len() + tg.graph.nodes.len() - tg.forward_len;
    3.0 * forward / nodes.max(1) as f64
}

/// [`balanced_boundaries`] of `costs` (one per computing node) into `stages` stages.
fn balanced(costs: &[f64], stages: usize) -> Result<Vec<usize>> {
    if stages == 0 || stages > costs.len() {
        return Err(Error::Partition {
            reason: format!(
                "{stages} stages requested for {} computing nodes",
                costs.len()
            ),
        });
    }
    Ok(balanced_boundaries(costs, stages))
}

/// The cost of one forward node.
fn node_cost(tg: &TrainingGraph, i: usize, by: BalanceBy) -> f64 {
    let n = &tg.graph.nodes[i];
    let numel = |v: &str| tg.metas.get(v).map_or(0.0, |m| m.numel() as f64);
    match by {
        // Measured times come with a profile (`Partition::Weighted`).
        BalanceBy::Time => 0.0,
        BalanceBy::Params => n
            .input
            .iter()
            .filter(|v| tg.param(v).is_some())
            .map(|v| numel(v))
            .sum(),
        BalanceBy::Flops => {
            let out = numel(n.output.first().map_or("", String::as_str));
            let inner = |v: &str, axis_from_end: usize| {
                tg.metas
                    .get(v)
                    .and_then(|m| {
                        m.shape
                            .len()
                            .checked_sub(axis_from_end)
                            .map(|a| m.shape[a] as f64)
                    })
                    .unwrap_or(1.0)
            };
            match n.op_type.as_str() {
                "MatMul" => 2.0 * out * inner(&n.input[0], 1),
                "Gemm" | "FusedMatMul" | "BlasMatMul" => {
                    let ta = crate::graph::ir::attr_i(n, "transA").unwrap_or(0) != 0;
                    2.0 * out * inner(&n.input[0], if ta { 2 } else { 1 })
                }
                "Conv" => {
                    let w = tg.metas.get(&n.input[1]);
                    let per_out: f64 =
                        w.map_or(1.0, |m| m.shape[1..].iter().product::<usize>() as f64);
                    2.0 * out * per_out
                }
                // A product of every step's input and hidden state by W and R.
                "LSTM" | "GRU" | "RNN" => {
                    let steps = numel(&n.input[0]) / inner(&n.input[0], 1);
                    2.0 * steps * (numel(&n.input[1]) + numel(&n.input[2]))
                }
                _ => out,
            }
        }
    }
}

/// Cuts `costs` into `parts` contiguous non-empty runs minimising the largest run's sum
/// (linear partition by dynamic programming); returns the start index of runs 1...
pub(crate) fn balanced_boundaries(costs: &[f64], parts: usize) -> Vec<usize> {
    let n = costs.len();
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + costs[i];
    }
    // best[k][i]: minimal max-run cost of splitting the first i items into k runs.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let c = best[k - 1][j].max(prefix[i] - prefix[j]);
                if c < best[k][i] {
                    best[k][i] = c;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut bounds = Vec::with_capacity(parts - 1);
    let mut i = n;
    for k in (2..=parts).rev() {
        i = cut[k][i];
        bounds.push(i);
    }
    bounds.reverse();
    bounds
}

#[cfg(test)]
mod tests {
    use super::balanced_boundaries;

    #[test]
    fn linear_partition_minimises_the_largest_stage() {
        // Best 3-way split of [5,1,1,1,5,1,1,1] is {5,1,1} {1,5} {1,1,1}? max 7 vs
        // [5,1][1,1,5][1,1,1] max 7; any split has a run holding a 5 plus neighbours.
        let b = balanced_boundaries(&[5.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0], 3);
        let sums: Vec<f64> = [0, b[0], b[1], 8]
            .windows(2)
            .map(|w| {
                [5.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0][w[0]..w[1]]
                    .iter()
                    .sum()
            })
            .collect();
        assert!(sums.iter().cloned().fold(0.0, f64::max) <= 7.0, "{sums:?}");
        assert_eq!(balanced_boundaries(&[1.0; 4], 4), vec![1, 2, 3]);
        assert_eq!(balanced_boundaries(&[1.0, 1.0, 10.0], 2), vec![2]);
    }
}
