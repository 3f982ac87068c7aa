//! Tensor (horizontal) parallelism: Megatron-LM's split, found in the forward graph.
//!
//! Each shard runs the same graph on its part of the split weights. Two operators of
//! pipetrain's domain carry the collectives, and run inside ONNX Runtime as custom
//! operators (`compute::shard_ops`) that call the shards' all-reduce:
//! - [`SHARD_ENTRY`] (Megatron's `f`) before each column-parallel `MatMul`: the identity
//!   forward; its gradient is the sum over the shards of the input's partial gradients;
//! - [`ALL_REDUCE`] (Megatron's `g`) after each row-parallel `MatMul`: the sum over the
//!   shards of their partial products forward; its gradient is the identity.
//!
//! The row-parallel bias is added after the sum, once. Everything outside the regions
//! (embeddings, normalizations, the head, the loss) is replicated and computes the same
//! bits on every shard, so replicated parameters get identical gradients without any
//! further collective.
//!
//! Why custom operators rather than cutting each stage graph at every all-reduce: the
//! stage graphs, the autodiff, recompute, gradient buckets and every schedule stay as they
//! are (a split graph is still one graph per pass), and the sum costs one kernel call
//! instead of a session boundary (two runs, the values copied out and back in) per
//! all-reduce.

mod linear;
mod regions;
mod spec;

use std::collections::{BTreeMap, HashMap, HashSet};

pub use spec::ShardSpec;

use crate::graph::ir::{make_node, Graph, Metas};
use crate::tensor::Tensor;
use crate::{Error, Result};
use regions::NewConst;

pub use crate::graph::custom_ops::{ALL_REDUCE, DOMAIN, SHARD_ENTRY};

/// How a graph was split across tensor shards.
#[derive(Debug, Clone, Default)]
pub struct ShardPlan {
    /// Tensor shards.
    pub shards: usize,
    /// Split parameters: how, and their whole shape.
    pub specs: BTreeMap<String, (ShardSpec, Vec<usize>)>,
    /// The split parameters' whole initial values.
    pub whole: HashMap<String, Tensor>,
    /// Values summed over the shards in each forward (row-parallel outputs).
    pub summed_forward: Vec<String>,
    /// Values whose gradients are summed in each backward (column-parallel inputs).
    pub summed_backward: Vec<String>,
    /// Regions left whole, with why.
    pub left_whole: Vec<(String, String)>,
}

impl ShardPlan {
    /// One line for the log: what is split, and what was left whole.
    pub fn summary(&self) -> String {
        let whole: usize = self
            .specs
            .values()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        let mut line = format!(
            "tensor parallel: {} parameters ({whole} values) split across {} shards; {} \
             all-reduces per forward, {} per backward",
            self.specs.len(),
            self.shards,
            self.summed_forward.len(),
            self.summed_backward.len()
        );
        if !self.left_whole.is_empty() {
            let list: Vec<String> = self
                .left_whole
                .iter()
                .map(|(n, why)| format!("`{n}` ({why})"))
                .collect();
            line.push_str(&format!("; left whole: {}", list.join(", ")));
        }
        line
    }

    /// Shard `rank`'s initial value of `name` (the value itself when it is not split).
    pub fn initial(&self, name: &str, rank: usize, value: &Tensor) -> Result<Tensor> {
        match (self.specs.get(name), self.whole.get(name)) {
            (Some((spec, shape)), Some(whole)) => {
                let v = whole.as_f32().ok_or_else(|| Error::BadTensor {
                    name: name.into(),
                    reason: "split parameters are float32".into(),
                })?;
                Tensor::f32(spec.shard_shape(shape), spec.slice(v, shape, rank))
            }
            _ => Ok(value.clone()),
        }
    }
}

/// Whether a node is one of pipetrain's shard collectives.
pub fn is_shard_op(op_type: &str, domain: &str) -> bool {
    domain == DOMAIN && (op_type == ALL_REDUCE || op_type == SHARD_ENTRY)
}

/// Splits `g` for `shards` tensor shards in place: split parameters hold shard 0's part,
/// constants (head counts, split sizes) are rewritten for one shard, and the collectives
/// are inserted. `metas`: every value's (whole) shape; `trainable`: the parameters.
///
/// # Errors
/// `TensorParallel` naming the node and the rule: no split pattern, a dimension not
/// divisible by `shards`, a split parameter also read elsewhere.
pub fn shard_graph(
    g: &mut Graph,
    metas: &Metas,
    shards: usize,
    trainable: &HashSet<&str>,
) -> Result<ShardPlan> {
    let found = regions::find(g, metas, shards, trainable)
        .map_err(|(node, rule)| Error::TensorParallel { node, rule })?;
    let mut plan = ShardPlan {
        shards,
        left_whole: found.left_whole,
        ..ShardPlan::default()
    };
    for (name, spec) in &found.params {
        let t = g
            .initializers
            .iter_mut()
            .find(|t| t.name == *name)
            .ok_or_else(|| Error::graph(format!("split parameter `{name}` is gone")))?;
        let whole = Tensor::from_proto(t)?;
        let shape = whole.shape.clone();
        let v = whole.as_f32().ok_or_else(|| Error::TensorParallel {
            node: name.clone(),
            rule: "split parameters must be float32".into(),
        })?;
        *t = Tensor::f32(spec.shard_shape(&shape), spec.slice(v, &shape, 0))?.to_proto(name);
        plan.specs.insert(name.clone(), (*spec, shape));
        plan.whole.insert(name.clone(), whole);
    }
    rewrite_constants(g, &found.consts);
    seed_dropouts(g);
    insert_collectives(g, &found.entries, &found.exits, &mut plan);
    g.import_domain(DOMAIN, 1);
    Ok(plan)
}

/// Gives every Dropout without a `seed` one of its own, the same on every shard (all
/// shards run this graph). Unseeded, ONNX Runtime draws each Dropout's masks from one
/// process-wide generator, in whatever order the shards' threads reach it (and from
/// unrelated generators in other processes), so replicated activations would differ
/// between shards and their copies of the replicated parameters drift apart.
fn seed_dropouts(g: &mut Graph) {
    for (i, n) in g.nodes.iter_mut().enumerate() {
        if n.op_type == "Dropout" && !n.attribute.iter().any(|a| a.name == "seed") {
            n.attribute
                .push(crate::graph::ir::int_attr("seed", 0x7e45_0000 + i as i64));
        }
    }
}

/// Gives each rewritten constant a new initializer of its own (others may read the
/// original) and points its node at it.
fn rewrite_constants(g: &mut Graph, consts: &[NewConst]) {
    for c in consts {
        match c {
            NewConst::Input {
                node,
                input,
                values,
            } => {
                let old = g.nodes[*node].input[*input].clone();
                let name = format!("{old}/shard_{}", values_key(values));
                if g.initializer(&name).is_none() {
                    let t = Tensor::i64(vec![values.len()], values.clone())
                        .expect("a vector's shape matches its length");
                    g.initializers.push(t.to_proto(&name));
                }
                g.nodes[*node].input[*input] = name;
            }
            NewConst::SplitAttr { node, values } => {
                for a in g.nodes[*node]
                    .attribute
                    .iter_mut()
                    .filter(|a| a.name == "split")
                {
                    a.ints = values.clone();
                }
            }
        }
    }
}

fn values_key(values: &[i64]) -> String {
    values
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

/// `ShardEntry` before the column-parallel `MatMul`s (one per input value, shared by
/// the `MatMul`s reading it) and `AllReduce` after the row-parallel ones.
fn insert_collectives(g: &mut Graph, entries: &[usize], exits: &[usize], plan: &mut ShardPlan) {
    let mut before: BTreeMap<usize, Vec<crate::onnx::proto::NodeProto>> = BTreeMap::new();
    let mut after: BTreeMap<usize, Vec<crate::onnx::proto::NodeProto>> = BTreeMap::new();
    let mut entered: HashMap<String, String> = HashMap::new();
    let mut sorted = entries.to_vec();
    sorted.sort_unstable();
    for i in sorted {
        let x = g.nodes[i].input[0].clone();
        let inside = match entered.get(&x) {
            Some(v) => v.clone(),
            None => {
                let v = format!("{x}/shard_entry");
                let mut n = make_node(
                    SHARD_ENTRY,
                    &format!("{x}/ShardEntry"),
                    &[&x],
                    &[&v],
                    vec![],
                );
                n.domain = DOMAIN.into();
                before.entry(i).or_default().push(n);
                entered.insert(x.clone(), v.clone());
                plan.summed_backward.push(x.clone());
                v
            }
        };
        g.nodes[i].input[0] = inside;
    }
    for &i in exits {
        let y = g.nodes[i].output[0].clone();
        let partial = format!("{y}/partial");
        g.nodes[i].output[0] = partial.clone();
        // A row-parallel `Gemm`'s bias is added once, after the sum.
        let bias = match g.nodes[i].op_type == "Gemm" && g.nodes[i].input.len() > 2 {
            true => g.nodes[i].input.pop().filter(|b| !b.is_empty()),
            false => None,
        };
        let summed = bias.as_ref().map_or(y.clone(), |_| format!("{y}/summed"));
        let name = format!("{y}/AllReduce");
        let mut n = make_node(ALL_REDUCE, &name, &[&partial], &[&summed], vec![]);
        n.domain = DOMAIN.into();
        let mut nodes = vec![n];
        if let Some(b) = bias {
            let add = make_node("Add", &format!("{y}/bias"), &[&summed, &b], &[&y], vec![]);
            nodes.push(add);
        }
        after.insert(i, nodes);
        plan.summed_forward.push(y);
    }
    let nodes = std::mem::take(&mut g.nodes);
    for (i, n) in nodes.into_iter().enumerate() {
        g.nodes.extend(before.remove(&i).unwrap_or_default());
        g.nodes.push(n);
        g.nodes.extend(after.remove(&i).unwrap_or_default());
    }
}

#[cfg(test)]
mod seeds {
    use super::*;
    use crate::graph::ir::{attr_i, int_attr, make_node};

    #[test]
    fn every_dropout_gets_a_seed_of_its_own_and_seeded_ones_keep_theirs() {
        let mut g = Graph {
            nodes: vec![
                make_node("Dropout", "a", &["x", "r"], &["y"], vec![]),
                make_node("Relu", "b", &["y"], &["z"], vec![]),
                make_node(
                    "Dropout",
                    "c",
                    &["z", "r"],
                    &["w"],
                    vec![int_attr("seed", 7)],
                ),
                make_node("Dropout", "d", &["w", "r"], &["v"], vec![]),
            ],
            ..Default::default()
        };
        seed_dropouts(&mut g);
        let seeds: Vec<Option<i64>> = g.nodes.iter().map(|n| attr_i(n, "seed")).collect();
        assert_eq!(seeds, [Some(0x7e45_0000), None, Some(7), Some(0x7e45_0003)]);
    }
}
