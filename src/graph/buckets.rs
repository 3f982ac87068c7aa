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
use std::ops::Range;

use crate::graph::ir::{value_info, Graph};
use crate::graph::training::TrainingGraph;
use crate::onnx::proto::{NodeProto, ValueInfoProto};
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
    let reads = Reads::new(tg, g, grad_bytes);
    let Some(starts) = reads.piece_starts(bucket_bytes) else {
        return Ok(None);
    };
    let reads = reads.with_pieces(&starts);
    // A gradient a later piece reads would be taken into its bucket before that piece
    // runs: no cut then.
    if reads.gradient_read_later() {
        return Ok(None);
    }
    let mut chain = GradChain {
        pieces: Vec::new(),
        buckets: Vec::new(),
    };
    for (k, own) in starts.windows(2).map(|w| w[0]..w[1]).enumerate() {
        chain.pieces.push(reads.piece(k, own.clone())?);
        chain.buckets.push(
            own.flat_map(|i| reads.grads_of(i))
                .map(str::to_string)
                .collect(),
        );
    }
    Ok(Some(chain))
}

/// What the cut needs to know of `g`: its gradient outputs, the constants each piece
/// makes again for itself, and (once the pieces are known) the last piece that reads
/// each value.
struct Reads<'a> {
    tg: &'a TrainingGraph,
    g: &'a Graph,
    grad_bytes: &'a HashMap<String, usize>,
    outputs: HashSet<&'a str>,
    /// `Constant` nodes without inputs, by output: made again in each piece that reads
    /// them, not handed over.
    constant: HashMap<&'a str, usize>,
    /// Per node, its piece.
    piece_of: Vec<usize>,
    /// The last piece that reads each value.
    last_reader: HashMap<&'a str, usize>,
}

impl<'a> Reads<'a> {
    fn new(tg: &'a TrainingGraph, g: &'a Graph, grad_bytes: &'a HashMap<String, usize>) -> Self {
        let constant = g
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Constant" && n.input.is_empty())
            .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
            .collect();
        Reads {
            tg,
            g,
            grad_bytes,
            outputs: g.outputs.iter().map(|o| o.name.as_str()).collect(),
            constant,
            piece_of: Vec::new(),
            last_reader: HashMap::new(),
        }
    }

    /// The gradient outputs node `i` makes.
    fn grads_of(&self, i: usize) -> Vec<&'a str> {
        self.g.nodes[i]
            .output
            .iter()
            .map(String::as_str)
            .filter(|o| self.outputs.contains(o) && self.grad_bytes.contains_key(*o))
            .collect()
    }

    fn bytes_of(&self, i: usize) -> usize {
        self.grads_of(i).iter().map(|o| self.grad_bytes[*o]).sum()
    }

    /// Piece boundaries (`[starts[k], starts[k + 1])`, the last the node count): a cut
    /// after each node that fills a bucket while gradients remain; `None` for one piece.
    fn piece_starts(&self, bucket_bytes: usize) -> Option<Vec<usize>> {
        let n = self.g.nodes.len();
        let total: usize = (0..n).map(|i| self.bytes_of(i)).sum();
        let mut starts = vec![0];
        let (mut filled, mut done) = (0, 0);
        for i in 0..n {
            let made = self.bytes_of(i);
            filled += made;
            done += made;
            if bucket_bytes > 0 && filled >= bucket_bytes && done < total {
                starts.push(i + 1);
                filled = 0;
            }
        }
        (starts.len() > 1).then(|| {
            starts.push(n);
            starts
        })
    }

    /// With the pieces cut at `starts`: each node's piece and each value's last reader.
    fn with_pieces(mut self, starts: &[usize]) -> Self {
        let g = self.g;
        self.piece_of = (0..g.nodes.len())
            .map(|i| starts.partition_point(|&s| s <= i) - 1)
            .collect();
        for (i, n) in g.nodes.iter().enumerate() {
            let read = n.input.iter().map(String::as_str);
            for v in read.filter(|v| !v.is_empty() && !self.constant.contains_key(v)) {
                let p = self.last_reader.entry(v).or_insert(0);
                *p = (*p).max(self.piece_of[i]);
            }
        }
        self
    }

    /// Whether a gradient is read by a piece after the one that makes it.
    fn gradient_read_later(&self) -> bool {
        (0..self.g.nodes.len()).any(|i| {
            self.grads_of(i).iter().any(|o| {
                self.last_reader
                    .get(o)
                    .is_some_and(|&p| p > self.piece_of[i])
            })
        })
    }

    /// `v` typed: as the graph's input, else from the measured shapes.
    fn typed(&self, v: &str) -> Result<ValueInfoProto> {
        if let Some(vi) = self.g.inputs.iter().find(|i| i.name == v) {
            return Ok(vi.clone());
        }
        let meta = self.tg.metas.get(v).ok_or_else(|| {
            Error::graph(format!(
                "{}: `{v}` crosses between gradient buckets and has no known type",
                self.g.name
            ))
        })?;
        Ok(value_info(v, meta))
    }

    /// Piece `k`, the nodes `own`: the constants it reads made again first, then its own.
    fn piece(&self, k: usize, own: Range<usize>) -> Result<Graph> {
        let g = self.g;
        let mut copied: Vec<usize> = g.nodes[own.clone()]
            .iter()
            .flat_map(|n| n.input.iter())
            .filter_map(|v| self.constant.get(v.as_str()).copied())
            .filter(|i| !own.contains(i))
            .collect();
        copied.sort_unstable();
        copied.dedup();
        let nodes: Vec<NodeProto> = copied
            .iter()
            .map(|&i| g.nodes[i].clone())
            .chain(g.nodes[own.clone()].iter().cloned())
            .collect();
        let used: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| &n.input)
            .map(String::as_str)
            .collect();
        let initializers = g
            .initializers
            .iter()
            .filter(|t| used.contains(t.name.as_str()))
            .cloned()
            .collect();
        Ok(Graph {
            name: format!("{}_bucket{k}", g.name),
            inputs: self.piece_inputs(&nodes)?,
            outputs: self.piece_outputs(k, own)?,
            nodes,
            initializers,
            opsets: g.opsets.clone(),
            ir_version: g.ir_version,
        })
    }

    /// What piece `k` (its own nodes `own`) hands on: the graph's outputs it makes and
    /// the values later pieces read.
    fn piece_outputs(&self, k: usize, own: Range<usize>) -> Result<Vec<ValueInfoProto>> {
        let own = &self.g.nodes[own];
        let made: HashSet<&str> = own
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str))
            .collect();
        let mut outputs: Vec<_> = self
            .g
            .outputs
            .iter()
            .filter(|o| made.contains(o.name.as_str()))
            .cloned()
            .collect();
        for v in own.iter().flat_map(|n| &n.output).filter(|v| !v.is_empty()) {
            let later = self.last_reader.get(v.as_str()).is_some_and(|&p| p > k);
            if later && !self.outputs.contains(v.as_str()) {
                outputs.push(self.typed(v)?);
            }
        }
        Ok(outputs)
    }

    /// What a piece of `nodes` reads and does not make (initializers aside), once each.
    fn piece_inputs(&self, nodes: &[NodeProto]) -> Result<Vec<ValueInfoProto>> {
        let made: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str))
            .collect();
        let mut read = HashSet::new();
        let mut inputs = Vec::new();
        for v in nodes
            .iter()
            .flat_map(|n| &n.input)
            .filter(|v| !v.is_empty())
        {
            if !made.contains(v.as_str())
                && self.g.initializer(v).is_none()
                && read.insert(v.as_str())
            {
                inputs.push(self.typed(v)?);
            }
        }
        Ok(inputs)
    }
}
