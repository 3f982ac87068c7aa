//! Finding Megatron-LM's split in a forward graph: regions that start at a
//! column-parallel `MatMul` (weight split along its output features), run through ops
//! that keep the split (bias, activations, reshapes into heads, attention) and end at a
//! row-parallel `MatMul` (weight split along its input features).
//!
//! The walk follows every value computed from a column-parallel output and tracks the
//! axis along which it is split. A region that meets an op that cannot keep the split
//! (a normalization over the split axis, a graph output, a computed reshape) is left
//! whole: its weights stay replicated, as Megatron leaves embeddings and heads. A region
//! whose split would be wrong rather than impossible (a head count or width not divisible
//! by the shard count, a split parameter also read elsewhere) is an error.

use std::collections::{HashMap, HashSet};

mod ops;

use super::linear::{linear, Linear};
use super::spec::ShardSpec;
use crate::graph::ir::{attr_i, attr_ints, node_label, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

/// How a value is split: along `axis`, in alignment `group`, within `region`.
#[derive(Debug, Clone, Copy)]
struct Split {
    axis: usize,
    group: usize,
    region: usize,
}

/// What a per-op rule gives: the split of each output it splits, or why the node cannot
/// keep the split.
type Step = Result<Vec<(String, Split)>, String>;

/// A constant that a region node reads, rewritten for one shard.
#[derive(Debug, Clone)]
pub(super) enum NewConst {
    /// Input `input` of node `node` becomes this int64 tensor.
    Input {
        node: usize,
        input: usize,
        values: Vec<i64>,
    },
    /// Attribute `split` of node `node` becomes these sizes.
    SplitAttr { node: usize, values: Vec<i64> },
}

/// What the walk found, for the regions that keep their split.
#[derive(Debug, Default)]
pub(super) struct Found {
    /// Split parameters.
    pub params: Vec<(String, ShardSpec)>,
    /// Column-parallel `MatMul` nodes (their first input enters the split).
    pub entries: Vec<usize>,
    /// Row-parallel `MatMul` nodes (their output is summed over the shards).
    pub exits: Vec<usize>,
    /// Constants rewritten for one shard.
    pub consts: Vec<NewConst>,
    /// Why regions were left whole: `(start node, reason)`.
    pub left_whole: Vec<(String, String)>,
}

/// One walk over the graph with the column-parallel starts in `excluded` left out.
struct Walk<'a> {
    g: &'a Graph,
    metas: &'a Metas,
    shards: usize,
    trainable: &'a HashSet<&'a str>,
    constants: HashMap<String, Tensor>,
    readers: HashMap<&'a str, Vec<usize>>,
    producers: HashMap<&'a str, usize>,
    split: HashMap<String, Split>,
    parent: Vec<usize>,
    starts: Vec<usize>,
    failed: Vec<Option<String>>,
    /// Sections of each alignment group.
    sections: Vec<usize>,
    /// `(region, parameter, axis, group)`.
    params: Vec<(usize, String, usize, usize)>,
    consts: Vec<(usize, NewConst)>,
    entries: Vec<(usize, usize)>,
    exits: Vec<(usize, usize)>,
    /// Errors raised only if their region keeps its split: `(region, node, rule)`.
    fatal: Vec<(usize, String, String)>,
}

/// Finds the regions of `g` that split across `shards` (`metas`: every value's shape,
/// whole; `trainable`: the parameters).
///
/// # Errors
/// `(node, rule)` for a region that would split wrongly, or when no region splits.
pub(super) fn find(
    g: &Graph,
    metas: &Metas,
    shards: usize,
    trainable: &HashSet<&str>,
) -> Result<Found, (String, String)> {
    let mut excluded = HashSet::new();
    let mut left_whole = Vec::new();
    loop {
        let mut w = Walk::new(g, metas, shards, trainable);
        w.run(&excluded);
        let newly: Vec<usize> = (0..w.starts.len())
            .filter(|&r| w.failed[w.root(r)].is_some())
            .collect();
        if newly.is_empty() {
            if w.starts.is_empty() {
                let why = left_whole
                    .iter()
                    .take(3)
                    .map(|(n, r)| format!("`{n}`: {r}"))
                    .collect::<Vec<_>>()
                    .join("; ");
                return Err((
                    g.name.clone(),
                    format!(
                        "no split pattern found (a column-parallel MatMul, ops that keep the \
                         split, a row-parallel MatMul){}",
                        if why.is_empty() {
                            String::new()
                        } else {
                            format!("; left whole: {why}")
                        }
                    ),
                ));
            }
            return w.found(left_whole);
        }
        for r in newly {
            let root = w.root(r);
            let reason = w.failed[root].clone().unwrap_or_default();
            left_whole.push((node_label(&g.nodes[w.starts[r]]), reason));
            excluded.insert(w.starts[r]);
        }
    }
}

impl<'a> Walk<'a> {
    fn new(
        g: &'a Graph,
        metas: &'a Metas,
        shards: usize,
        trainable: &'a HashSet<&'a str>,
    ) -> Walk<'a> {
        Walk {
            g,
            metas,
            shards,
            trainable,
            constants: g.constants(),
            readers: g.consumers(),
            producers: g.producers(),
            split: HashMap::new(),
            parent: Vec::new(),
            starts: Vec::new(),
            failed: Vec::new(),
            sections: Vec::new(),
            params: Vec::new(),
            consts: Vec::new(),
            entries: Vec::new(),
            exits: Vec::new(),
            fatal: Vec::new(),
        }
    }

    fn root(&self, mut r: usize) -> usize {
        while self.parent[r] != r {
            r = self.parent[r];
        }
        r
    }

    fn merge(&mut self, a: usize, b: usize) -> usize {
        let (ra, rb) = (self.root(a), self.root(b));
        if ra != rb {
            self.parent[rb] = ra;
            if self.failed[ra].is_none() {
                self.failed[ra] = self.failed[rb].take();
            }
        }
        ra
    }

    fn fail(&mut self, region: usize, reason: String) {
        let r = self.root(region);
        self.failed[r].get_or_insert(reason);
    }

    fn rank(&self, v: &str) -> Option<usize> {
        self.metas.get(v).map(|m| m.shape.len())
    }

    fn shape(&self, v: &str) -> Option<&[usize]> {
        self.metas.get(v).map(|m| m.shape.as_slice())
    }

    fn new_group(&mut self) -> usize {
        self.sections.push(1);
        self.sections.len() - 1
    }

    /// The linear layer `n` computes, if it is one.
    fn linear(&self, n: &NodeProto) -> Option<Linear<'a>> {
        linear(self.g, n, self.trainable, (&self.producers, &self.readers))
    }

    fn read_elsewhere(&self, param: &str) -> bool {
        self.readers.get(param).is_some_and(|r| r.len() > 1)
    }

    /// Records split parameter `name` (along `axis`, aligned with `group`), and the
    /// error it would be to split it when another node reads it too.
    fn split_param(&mut self, region: usize, name: &str, axis: usize, group: usize) {
        self.params.push((region, name.to_string(), axis, group));
        if self.read_elsewhere(name) {
            self.fatal.push((
                region,
                name.to_string(),
                "a split parameter is also read by another node (parameters shared across a \
                 split are not supported)"
                    .into(),
            ));
        }
    }

    fn run(&mut self, excluded: &HashSet<usize>) {
        for (i, n) in self.g.nodes.iter().enumerate() {
            let ins: Vec<(usize, Split)> = n
                .input
                .iter()
                .enumerate()
                .filter_map(|(k, v)| self.split.get(v).map(|s| (k, *s)))
                .collect();
            if ins.is_empty() {
                if !excluded.contains(&i) {
                    self.try_start(i, n);
                }
                continue;
            }
            let region = ins
                .iter()
                .skip(1)
                .fold(ins[0].1.region, |r, (_, s)| self.merge(r, s.region));
            let root = self.root(region);
            let outs = match self.failed[root] {
                Some(_) => Err(String::new()),
                None => self.step(i, n, &ins, root),
            };
            match outs {
                Ok(outs) => {
                    for (o, s) in outs {
                        self.split.insert(o, s);
                    }
                }
                Err(reason) => {
                    if !reason.is_empty() {
                        self.fail(root, format!("`{}`: {reason}", node_label(n)));
                    }
                    for o in n.output.iter().filter(|o| !o.is_empty()) {
                        let s = Split {
                            axis: 0,
                            group: 0,
                            region: root,
                        };
                        self.split.insert(o.clone(), s);
                    }
                }
            }
        }
        for o in &self.g.outputs {
            if let Some(s) = self.split.get(&o.name).copied() {
                self.fail(
                    s.region,
                    format!("graph output `{}` would be split", o.name),
                );
            }
        }
        for r in 0..self.starts.len() {
            let root = self.root(r);
            if self.failed[root].is_none() && !self.exits.iter().any(|&(e, _)| self.root(e) == root)
            {
                self.fail(root, "never meets a row-parallel MatMul".into());
            }
        }
    }

    /// A column-parallel start: a linear layer of an activation.
    fn try_start(&mut self, i: usize, n: &NodeProto) {
        let Some(lin) = self.linear(n) else { return };
        let Some(rank) = self.rank(&n.input[0]).filter(|&r| r >= 2) else {
            return;
        };
        if self.g.initializer(&n.input[0]).is_some() {
            return;
        }
        let region = self.starts.len();
        self.starts.push(i);
        self.parent.push(region);
        self.failed.push(None);
        let group = self.new_group();
        self.split_param(region, lin.weight, lin.out_axis, group);
        if let Some(b) = lin.bias {
            let axis = self.shape(b).map_or(0, |s| s.len().saturating_sub(1));
            self.split_param(region, b, axis, group);
        }
        self.entries.push((region, i));
        let s = Split {
            axis: rank - 1,
            group,
            region,
        };
        self.split.insert(n.output[0].clone(), s);
    }

    /// The split of `n`'s outputs from its split inputs `ins`, or why it cannot keep it.
    fn step(&mut self, i: usize, n: &NodeProto, ins: &[(usize, Split)], region: usize) -> Step {
        if !n.domain.is_empty() && n.domain != "ai.onnx" {
            return Err(format!("`{}` of domain {}", n.op_type, n.domain));
        }
        let first = ins[0].1;
        let same = |axis: usize| Split {
            axis,
            group: first.group,
            region,
        };
        let all = |s: Split| -> Vec<(String, Split)> {
            n.output
                .iter()
                .filter(|o| !o.is_empty())
                .map(|o| (o.clone(), s))
                .collect()
        };
        match n.op_type.as_str() {
            "Relu" | "Gelu" | "Erf" | "Tanh" | "Sigmoid" | "Sqrt" | "Exp" | "Log" | "Neg"
            | "Abs" | "Cast" | "Identity" | "Dropout" | "Softplus" | "Reciprocal" | "Sin"
            | "Cos" | "HardSigmoid" | "HardSwish" | "LeakyRelu" => Ok(all(same(first.axis))),
            "Softmax" | "LogSoftmax" => {
                let rank = self.rank(&n.input[0]).ok_or("no shape")? as i64;
                let axis = attr_i(n, "axis").unwrap_or(-1);
                match (axis + rank) % rank == first.axis as i64 {
                    true => Err("normalizes along the split axis".into()),
                    false => Ok(all(same(first.axis))),
                }
            }
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Where" | "Max" | "Min" => {
                self.elementwise(n, ins, region)
            }
            "Transpose" => {
                let rank = self.rank(&n.input[0]).ok_or("no shape")?;
                let perm = attr_ints(n, "perm")
                    .unwrap_or_else(|| (0..rank as i64).rev().collect::<Vec<_>>());
                let j = perm
                    .iter()
                    .position(|&p| p == first.axis as i64)
                    .ok_or("a permutation without the split axis")?;
                Ok(all(same(j)))
            }
            "CastLike" if ins.iter().all(|&(k, _)| k == 0) => Ok(all(same(first.axis))),
            "Reshape" => self.reshape(i, n, first, region),
            "Split" => self.split_node(i, n, first, region),
            "Slice" => self.slice(n, first),
            "Concat" => self.concat(n, ins, region),
            "Unsqueeze" | "Squeeze" => self.unsqueeze(n, first, region),
            "Expand" => self.expand(i, n, first, region),
            "MatMul" | "Gemm" => self.matmul(i, n, ins, region),
            op => Err(format!("`{op}` does not keep a tensor-parallel split")),
        }
    }

    /// The successful regions' parameters, starts, ends and constants.
    fn found(self, left_whole: Vec<(String, String)>) -> Result<Found, (String, String)> {
        if let Some((_, node, rule)) = self.fatal.iter().find(|(r, _, _)| {
            let root = self.root(*r);
            self.failed[root].is_none()
        }) {
            return Err((node.clone(), rule.clone()));
        }
        let mut out = Found {
            left_whole,
            ..Found::default()
        };
        for (_, name, axis, group) in &self.params {
            let spec = ShardSpec {
                axis: *axis,
                sections: self.sections[*group],
                shards: self.shards,
            };
            let full = self
                .g
                .initializer(name)
                .map(|t| t.dims.iter().map(|&d| d as usize).collect::<Vec<_>>())
                .unwrap_or_default();
            if !spec.fits(&full) {
                return Err((
                    name.clone(),
                    format!(
                        "its dimension {} along axis {axis} ({} sections) is not divisible by {}",
                        full.get(*axis).copied().unwrap_or(0),
                        spec.sections,
                        self.shards
                    ),
                ));
            }
            if !out.params.iter().any(|(p, _)| p == name) {
                out.params.push((name.clone(), spec));
            }
        }
        out.entries = self.entries.iter().map(|&(_, n)| n).collect();
        out.exits = self.exits.iter().map(|&(_, n)| n).collect();
        out.consts = self.consts.into_iter().map(|(_, c)| c).collect();
        Ok(out)
    }
}
