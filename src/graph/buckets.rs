//! Gradient buckets: a graph that computes parameter gradients (a stage's backward, its
//! weight half, or the last stage's fused forward and backward) cut into pieces run one
//! after another, each ending once about a bucket's worth of gradients is complete. The
//! data-parallel all-reduce of a piece's gradients then starts while the next pieces
//! still run, as PyTorch DDP's buckets do (there, hooks fire inside one autograd pass;
//! here one ONNX Runtime session has no such hooks, so the pass itself is cut).
//!
//! The cut follows the graph's node order (topological): a value one piece makes and a
//! later one reads becomes an output of the first and an input of the second.

use std::collections::{HashMap, HashSet};

use crate::graph::ir::{value_info, Graph};
use crate::graph::training::TrainingGraph;
use crate::{Error, Result};

/// A gradient graph as pieces, and the parameter gradients each completes.
#[derive(Debug, Clone)]
pub struct GradChain {
    /// The pieces, in the order they run; together they give the whole graph's outputs.
    pub pieces: Vec<Graph>,
    /// Per piece: the gradient outputs it produces (its bucket).
    pub buckets: Vec<Vec<String>>,
}

/// Cuts `g` after the node that brings the gradients produced since the last cut to
/// `bucket_bytes` (of `grad_bytes`, bytes per gradient output), as long as gradients
/// remain for a later piece. `None` when that leaves a single piece.
///
/// # Errors
/// `Graph` when a value crossing between pieces has no known type in `tg`.
pub fn grad_chain(
    tg: &TrainingGraph,
    g: &Graph,
    grad_bytes: &HashMap<String, usize>,
    bucket_bytes: usize,
) -> Result<Option<GradChain>> {
    let outputs: HashSet<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
    let grads_of = |i: usize| -> Vec<&str> {
        g.nodes[i]
            .output
            .iter()
            .map(String::as_str)
            .filter(|o| outputs.contains(o) && grad_bytes.contains_key(*o))
            .collect()
    };
    let total: usize = (0..g.nodes.len())
        .flat_map(grads_of)
        .map(|o| grad_bytes[o])
        .sum();
    // Piece boundaries: [starts[k], starts[k + 1]).
    let mut starts = vec![0];
    let (mut filled, mut done) = (0, 0);
    for i in 0..g.nodes.len() {
        let made: usize = grads_of(i).iter().map(|o| grad_bytes[*o]).sum();
        filled += made;
        done += made;
        if bucket_bytes > 0 && filled >= bucket_bytes && done < total {
            starts.push(i + 1);
            filled = 0;
        }
    }
    if starts.len() == 1 {
        return Ok(None);
    }
    starts.push(g.nodes.len());
    let piece_of: Vec<usize> = (0..g.nodes.len())
        .map(|i| starts.partition_point(|&s| s <= i) - 1)
        .collect();
    // Constants are made again in each piece that reads them, not handed over.
    let constant: HashMap<&str, usize> = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type == "Constant" && n.input.is_empty())
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    // The last piece that reads each value.
    let mut last_reader: HashMap<&str, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for v in n
            .input
            .iter()
            .filter(|v| !v.is_empty() && !constant.contains_key(v.as_str()))
        {
            let p = last_reader.entry(v.as_str()).or_insert(0);
            *p = (*p).max(piece_of[i]);
        }
    }
    // A gradient a later piece reads would be taken into its bucket before that piece
    // runs: no cut then.
    let read_later = (0..g.nodes.len()).any(|i| {
        grads_of(i)
            .iter()
            .any(|o| last_reader.get(o).is_some_and(|&p| p > piece_of[i]))
    });
    if read_later {
        return Ok(None);
    }
    let inputs: HashMap<&str, _> = g.inputs.iter().map(|v| (v.name.as_str(), v)).collect();
    let typed = |v: &str| -> Result<_> {
        if let Some(vi) = inputs.get(v) {
            return Ok((*vi).clone());
        }
        let meta = tg.metas.get(v).ok_or_else(|| {
            Error::graph(format!(
                "{}: `{v}` crosses between gradient buckets and has no known type",
                g.name
            ))
        })?;
        Ok(value_info(v, meta))
    };
    let mut chain = GradChain {
        pieces: Vec::new(),
        buckets: Vec::new(),
    };
    for k in 0..starts.len() - 1 {
        let own = starts[k]..starts[k + 1];
        let mut copied: Vec<usize> = g.nodes[own.clone()]
            .iter()
            .flat_map(|n| n.input.iter())
            .filter_map(|v| constant.get(v.as_str()).copied())
            .filter(|i| !own.contains(i))
            .collect();
        copied.sort_unstable();
        copied.dedup();
        let nodes: Vec<_> = copied
            .iter()
            .map(|&i| g.nodes[i].clone())
            .chain(g.nodes[own.clone()].iter().cloned())
            .collect();
        let made: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str))
            .collect();
        let own_made: HashSet<&str> = g.nodes[own.clone()]
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str))
            .collect();
        let mut piece_outputs = Vec::new();
        for o in &g.outputs {
            if own_made.contains(o.name.as_str()) {
                piece_outputs.push(o.clone());
            }
        }
        for n in &g.nodes[own.clone()] {
            for v in n.output.iter().filter(|v| !v.is_empty()) {
                if last_reader.get(v.as_str()).is_some_and(|&p| p > k)
                    && !outputs.contains(v.as_str())
                {
                    piece_outputs.push(typed(v)?);
                }
            }
        }
        let mut read = HashSet::new();
        let mut piece_inputs = Vec::new();
        for n in &nodes {
            for v in n.input.iter().filter(|v| !v.is_empty()) {
                if !made.contains(v.as_str())
                    && g.initializer(v).is_none()
                    && read.insert(v.as_str())
                {
                    piece_inputs.push(typed(v)?);
                }
            }
        }
        let used: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.input.iter().map(String::as_str))
            .collect();
        chain
            .buckets
            .push(own.flat_map(grads_of).map(str::to_string).collect());
        let initializers = g
            .initializers
            .iter()
            .filter(|t| used.contains(t.name.as_str()))
            .cloned()
            .collect();
        chain.pieces.push(Graph {
            name: format!("{}_bucket{k}", g.name),
            nodes,
            inputs: piece_inputs,
            outputs: piece_outputs,
            initializers,
            opsets: g.opsets.clone(),
            ir_version: g.ir_version,
        });
    }
    Ok(Some(chain))
}
