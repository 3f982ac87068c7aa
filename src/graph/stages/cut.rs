//! One stage's cut of the training graph, in phases: its nodes, what crosses to its
//! neighbours, what its forward keeps for its backward, its parameters' gradients, the
//! backward's split into an input-gradient and a weight-gradient part, what recomputing
//! changes, and the graphs.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::{Recompute, StageGraphs, StageIo};
use crate::graph::loss::{ACC_CORRECT, ACC_COUNTED, LOSS};
use crate::graph::partition::{constant_nodes, StageAssignment};
use crate::graph::running_stats::inference_mode;
use crate::graph::subgraph::{ancestors, external_inputs, subgraph, with_constants};
use crate::graph::tied::{node_stages, tied_params};
use crate::graph::training::{Param, TrainingGraph};
use crate::onnx::proto::NodeProto;
use crate::{Error, Result};

/// The training graph and what every stage's cut reads of it.
pub(super) struct Cut<'g> {
    tg: &'g TrainingGraph,
    is_const: Vec<bool>,
    node_stage: Vec<Option<usize>>,
    producer: HashMap<&'g str, usize>,
    /// Which stages read each value (and each parameter).
    users: HashMap<&'g str, BTreeSet<usize>>,
    data: HashSet<&'g str>,
}

/// A stage's nodes (indices into the training graph), without and with the constants
/// they read.
struct Nodes {
    fwd: Vec<usize>,
    bwd: Vec<usize>,
    fwd_full: Vec<usize>,
    bwd_full: Vec<usize>,
}

/// The values a stage's forward and backward graphs give.
struct Outputs {
    forward: Vec<String>,
    backward: Vec<String>,
    /// Of the backward's: the parameters' gradients.
    grads: Vec<String>,
    /// Of the forward's: what updates running statistics.
    updates: Vec<String>,
}

/// The backward split for zero-bubble schedules: the input-gradient part (the nodes the
/// outgoing gradients depend on) and the weight-gradient part (the rest).
struct Split {
    input_nodes: Vec<usize>,
    weight_nodes: Vec<usize>,
    /// The input-gradient part's outputs that cross to the previous stage.
    targets: Vec<String>,
    /// What the input-gradient part hands the weight-gradient part.
    i_to_w: Vec<String>,
}

impl<'g> Cut<'g> {
    /// The cut of `tg` by `a`; an error where a parameter is read by several stages.
    pub(super) fn new(tg: &'g TrainingGraph, a: &StageAssignment) -> Result<Cut<'g>> {
        if let Some(t) = tied_params(tg, a).first() {
            return Err(Error::Partition {
                reason: format!(
                    "parameter `{}` is read by stages {:?}; share it first (graph::with_tied_shared)",
                    t.name, t.stages
                ),
            });
        }
        let g = &tg.graph;
        let node_stage = node_stages(tg, a);
        let mut producer: HashMap<&str, usize> = HashMap::new();
        let mut users: HashMap<&str, BTreeSet<usize>> = HashMap::new();
        for (i, n) in g.nodes.iter().enumerate() {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                producer.insert(o, i);
            }
            if let Some(s) = node_stage[i] {
                for v in n.input.iter().filter(|v| !v.is_empty()) {
                    users.entry(v.as_str()).or_default().insert(s);
                }
            }
        }
        Ok(Cut {
            tg,
            is_const: constant_nodes(tg),
            node_stage,
            producer,
            users,
            data: tg.data_inputs.iter().map(String::as_str).collect(),
        })
    }

    /// Stage `s`'s graphs and exchange contract.
    pub(super) fn stage(&self, s: usize, recompute: Recompute) -> Result<StageGraphs> {
        let (n, tg) = (self.nodes(s), self.tg);
        // Nothing crosses before the first stage or after the last: `crossing` finds none.
        let fwd_send = self.crossing(s, true);
        let fwd_recv = match s.checked_sub(1) {
            Some(previous) => self.crossing(previous, true),
            None => vec![],
        };
        let (bwd_send, bwd_recv) = (self.crossing(s, false), self.crossing(s + 1, false));
        let (fwd_made, bwd_made) = (self.made(&n.fwd), self.made(&n.bwd));
        let has_loss = fwd_made.contains(LOSS);
        let mut stash: Vec<String> = external_inputs(&tg.graph, &n.bwd_full)
            .into_iter()
            .filter(|v| fwd_made.contains(v.as_str()) || fwd_recv.contains(v))
            .collect();
        let buffers: Vec<(String, String)> = tg
            .buffers
            .iter()
            .filter(|b| fwd_made.contains(b.update.as_str()))
            .map(|b| (b.name.clone(), b.update.clone()))
            .collect();
        let reads = |p: &&Param| {
            self.users
                .get(p.name.as_str())
                .is_some_and(|u| u.contains(&s))
        };
        let params: Vec<String> = tg
            .params
            .iter()
            .filter(reads)
            .map(|p| p.name.clone())
            .collect();
        let mut out = self.outputs(s, (&fwd_send, &bwd_send), &stash, &buffers, &params, &n)?;
        let mut split = self.split(&n, &bwd_made, &bwd_send);
        let fused = match has_loss && bwd_recv.is_empty() {
            true => Some(self.fused(s, &n, &out)?),
            false => None,
        }
        .map(|mut g| {
            crate::graph::cleanup::fold_output_identities(&mut g);
            g
        });
        let mut bwd_nodes = n.bwd_full.clone();
        if recompute == Recompute::Stage {
            self.no_random_ops(s, &n.fwd)?;
            bwd_nodes = with(&n.fwd_full, &bwd_nodes);
            stash = self.recompute(&n, &bwd_nodes, (&fwd_send, &fwd_recv), &mut out, &mut split);
        }
        let graph = |nodes: &[usize], outputs: &[String], part: &str| {
            let mut g = subgraph(tg, nodes, outputs, &format!("stage{s}_{part}"))?;
            crate::graph::cleanup::fold_output_identities(&mut g);
            Ok::<_, Error>(g)
        };
        let eval_outputs = eval_outputs(&fwd_send, &fwd_made, has_loss);
        let mut evaluate = graph(&n.fwd_full, &eval_outputs, "evaluate")?;
        inference_mode(&mut evaluate, &tg.buffers);
        crate::graph::dropouts_for_inference(&mut evaluate);
        let input_outputs = [split.targets, split.i_to_w.clone()].concat();
        Ok(StageGraphs {
            stage: s,
            forward: graph(&n.fwd_full, &out.forward, "forward")?,
            evaluate,
            backward: graph(&bwd_nodes, &out.backward, "backward")?,
            backward_input: graph(&split.input_nodes, &input_outputs, "backward_input")?,
            backward_weight: graph(&split.weight_nodes, &out.grads, "backward_weight")?,
            fused,
            io: StageIo {
                tied: self.tied_values(fwd_recv.iter().chain(&fwd_send)),
                params,
                data: self.used_data(&n),
                fwd_recv,
                fwd_send,
                bwd_recv,
                bwd_send,
                stash,
                i_to_w: split.i_to_w,
                has_loss,
                buffers,
            },
        })
    }

    /// Of `values`, those an `Identity` makes of a parameter: a tied weight's value.
    fn tied_values<'v>(&self, values: impl Iterator<Item = &'v String>) -> Vec<String> {
        let of_param = |v: &str| {
            let node = &self.tg.graph.nodes[*self.producer.get(v)?];
            let input = node.input.first()?;
            (node.op_type == "Identity" && self.tg.param(input).is_some()).then_some(())
        };
        let mut out: Vec<String> = values.filter(|v| of_param(v).is_some()).cloned().collect();
        out.sort();
        out.dedup();
        out
    }

    /// Stage `s`'s forward and backward nodes.
    fn nodes(&self, s: usize) -> Nodes {
        let (forward_len, all) = (self.tg.forward_len, self.tg.graph.nodes.len());
        let of = |range: std::ops::Range<usize>| -> Vec<usize> {
            range.filter(|&i| self.node_stage[i] == Some(s)).collect()
        };
        let (fwd, bwd) = (of(0..forward_len), of(forward_len..all));
        Nodes {
            fwd_full: self.with_constants(&fwd),
            bwd_full: self.with_constants(&bwd),
            fwd,
            bwd,
        }
    }

    /// The forward (or backward) values made at stages up to `s` (from `s` on) and read
    /// after it (before it): what crosses between `s` and its next (previous) stage.
    fn crossing(&self, s: usize, forward: bool) -> Vec<String> {
        let mut out: Vec<String> = self
            .producer
            .iter()
            .filter(|(_, &i)| {
                self.node_stage[i].is_some_and(|ps| if forward { ps <= s } else { ps >= s })
                    && (i < self.tg.forward_len) == forward
            })
            .filter(|(v, _)| {
                self.users
                    .get(*v)
                    .is_some_and(|u| u.iter().any(|&us| if forward { us > s } else { us < s }))
            })
            .map(|(v, _)| v.to_string())
            .collect();
        out.sort_by_key(|v| self.producer[v.as_str()]);
        out
    }

    /// The values `nodes` make.
    fn made(&self, nodes: &[usize]) -> HashSet<&'g str> {
        let g = &self.tg.graph;
        nodes
            .iter()
            .flat_map(|&i| g.nodes[i].output.iter().map(String::as_str))
            .collect()
    }

    fn with_constants(&self, nodes: &[usize]) -> Vec<usize> {
        with_constants(&self.tg.graph, nodes, &self.producer, &self.is_const)
    }

    /// What stage `s`'s forward gives (what it sends, what it stashes, the loss, the
    /// running statistics' updates) and its backward (what it sends, its parameters'
    /// gradients); an error where it would make the gradient of a parameter it does not
    /// hold.
    fn outputs(
        &self,
        s: usize,
        (fwd_send, bwd_send): (&[String], &[String]),
        stash: &[String],
        buffers: &[(String, String)],
        params: &[String],
        n: &Nodes,
    ) -> Result<Outputs> {
        let (fwd_made, bwd_made) = (self.made(&n.fwd), self.made(&n.bwd));
        let mut forward: Vec<String> = fwd_send
            .iter()
            .filter(|v| fwd_made.contains(v.as_str()))
            .cloned()
            .collect();
        for v in stash {
            if fwd_made.contains(v.as_str()) && !forward.contains(v) {
                forward.push(v.clone());
            }
        }
        if fwd_made.contains(LOSS) && !forward.iter().any(|v| v == LOSS) {
            forward.push(LOSS.into());
        }
        let updates: Vec<String> = buffers.iter().map(|(_, u)| u.clone()).collect();
        forward.extend(updates.iter().cloned());
        let made_here = |p: &&Param| bwd_made.contains(p.grad.as_str());
        if let Some(p) = self
            .tg
            .params
            .iter()
            .filter(made_here)
            .find(|p| !params.contains(&p.name))
        {
            return Err(Error::Partition {
                reason: format!(
                    "stage {s} would compute the gradient of `{}`, which another stage holds",
                    p.name
                ),
            });
        }
        let grads: Vec<String> = self
            .tg
            .params
            .iter()
            .filter(made_here)
            .map(|p| p.grad.clone())
            .collect();
        let mut backward: Vec<String> = bwd_send
            .iter()
            .filter(|v| bwd_made.contains(v.as_str()))
            .cloned()
            .collect();
        backward.extend(grads.iter().cloned());
        Ok(Outputs {
            forward,
            backward,
            grads,
            updates,
        })
    }

    /// The backward's split (see [`Split`]).
    fn split(&self, n: &Nodes, bwd_made: &HashSet<&str>, bwd_send: &[String]) -> Split {
        let g = &self.tg.graph;
        let targets: HashSet<&str> = bwd_send
            .iter()
            .filter(|v| bwd_made.contains(v.as_str()))
            .map(String::as_str)
            .collect();
        let input_part = ancestors(g, &n.bwd, &targets, &self.producer);
        let (inputs, weights): (Vec<usize>, Vec<usize>) =
            n.bwd.iter().copied().partition(|i| input_part.contains(i));
        let weight_nodes = self.with_constants(&weights);
        let input_made = self.made(&inputs);
        let i_to_w = external_inputs(g, &weight_nodes)
            .into_iter()
            .filter(|v| input_made.contains(v.as_str()))
            .collect();
        let mut targets: Vec<String> = targets.iter().map(|v| v.to_string()).collect();
        targets.sort_by_key(|v| self.producer[v.as_str()]);
        Split {
            input_nodes: self.with_constants(&inputs),
            weight_nodes,
            targets,
            i_to_w,
        }
    }

    /// The last stage's forward and backward as one graph: the loss, the backward's
    /// outputs and the running statistics' updates.
    fn fused(&self, s: usize, n: &Nodes, out: &Outputs) -> Result<crate::graph::ir::Graph> {
        let nodes = with(&n.fwd_full, &n.bwd_full);
        let mut outputs = vec![LOSS.to_string()];
        outputs.extend(out.backward.iter().cloned());
        outputs.extend(out.updates.iter().cloned());
        subgraph(
            self.tg,
            &nodes,
            &outputs,
            &format!("stage{s}_forward_backward"),
        )
    }

    /// Under [`Recompute::Stage`], with `bwd_nodes` the backward after the stage's forward:
    /// the input-gradient part starts with the forward too, the forward keeps nothing but
    /// what it sends (and the loss, the statistics' updates); the stash returned holds
    /// only what arrived and a backward graph reads.
    fn recompute(
        &self,
        n: &Nodes,
        bwd_nodes: &[usize],
        (fwd_send, fwd_recv): (&[String], &[String]),
        out: &mut Outputs,
        split: &mut Split,
    ) -> Vec<String> {
        let g = &self.tg.graph;
        split.input_nodes = with(&n.fwd_full, &split.input_nodes);
        let recomputed = self.made(&split.input_nodes);
        split.i_to_w = external_inputs(g, &split.weight_nodes)
            .into_iter()
            .filter(|v| recomputed.contains(v.as_str()))
            .collect();
        let updates = &out.updates;
        out.forward
            .retain(|v| fwd_send.contains(v) || v == LOSS || updates.contains(v));
        let read: HashSet<String> = [bwd_nodes, &split.input_nodes, &split.weight_nodes]
            .into_iter()
            .flat_map(|nodes| external_inputs(g, nodes))
            .collect();
        fwd_recv
            .iter()
            .filter(|v| read.contains(*v))
            .cloned()
            .collect()
    }

    /// An error where recomputing stage `s`'s forward would draw a random op again.
    fn no_random_ops(&self, s: usize, fwd: &[usize]) -> Result<()> {
        let g = &self.tg.graph;
        match fwd.iter().map(|&i| &g.nodes[i]).find(|n| draws_randomly(n)) {
            Some(n) => Err(Error::Partition {
                reason: format!(
                    "recompute = \"stage\" would run stage {s}'s `{}` ({}) again and draw anew, so its gradients would not match its forward; use recompute = \"none\"",
                    n.name, n.op_type
                ),
            }),
            None => Ok(()),
        }
    }

    /// The data inputs (model inputs, label) a stage's graphs read, sorted.
    fn used_data(&self, n: &Nodes) -> Vec<String> {
        let mut used: BTreeSet<String> = BTreeSet::new();
        for set in [&n.fwd_full, &n.bwd_full] {
            for v in external_inputs(&self.tg.graph, set) {
                if self.data.contains(v.as_str()) {
                    used.insert(v);
                }
            }
        }
        used.into_iter().collect()
    }
}

/// The evaluation forward's outputs: what it sends on, and on the loss's stage the loss
/// (and a classification loss's counts of correct predictions).
fn eval_outputs(fwd_send: &[String], fwd_made: &HashSet<&str>, has_loss: bool) -> Vec<String> {
    let mut out: Vec<String> = fwd_send
        .iter()
        .filter(|v| fwd_made.contains(v.as_str()))
        .cloned()
        .collect();
    if has_loss {
        out.push(LOSS.into());
        if [ACC_CORRECT, ACC_COUNTED]
            .iter()
            .all(|v| fwd_made.contains(v))
        {
            out.push(ACC_CORRECT.into());
            out.push(ACC_COUNTED.into());
        }
    }
    out
}

/// The nodes of `a` and `b`, in graph order, each once.
fn with(a: &[usize], b: &[usize]) -> Vec<usize> {
    let set: BTreeSet<usize> = a.iter().chain(b).copied().collect();
    set.into_iter().collect()
}

/// Op types whose output a second run would draw anew (Dropout only in training mode).
fn draws_randomly(n: &NodeProto) -> bool {
    match n.op_type.as_str() {
        "Dropout" => n.input.get(2).is_some_and(|v| !v.is_empty()),
        t => t.starts_with("Random") || matches!(t, "Bernoulli" | "Multinomial"),
    }
}
