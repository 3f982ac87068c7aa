//! BatchNormalization's running statistics as state that is not trained, updated as
//! PyTorch updates them in `train()`: after each forward, per micro-batch,
//! `running = momentum_onnx x running + (1 - momentum_onnx) x batch statistic`, the
//! variance unbiased (`x n / (n - 1)`, `n` values per channel), as PyTorch keeps it.
//! (ONNX Runtime's own `running_var` output is the biased one.)
//!
//! Each training-mode `BatchNormalization` whose running mean and variance are
//! initializers gets update nodes at the end of the forward (`ReduceMean`s of its input
//! and the arithmetic above). The node itself reads constant statistics in training (its
//! output does not depend on them there), and the running statistics become inputs of
//! the training graph (buffers) that the stage holding the node feeds and replaces after
//! each forward.
//!
//! Those constants hold values no other constant of a training graph holds
//! ([`placeholder`]). ONNX Runtime merges initializers of equal value, and its
//! training-mode BatchNormalization kernel writes its running outputs over its running
//! inputs: with zeros and ones there, a MobileViT's 8-channel stem wrote its running
//! variance over the vector of 8 ones that sums the classifier's bias gradient over a
//! batch of 8, and the first step's gradient norm was 1.4e-5 off (19.60661 against
//! PyTorch's 19.60689; one stage per layer, not sharing the session, was right). Evaluation graphs normalize with them (inference mode), as PyTorch's
//! `eval()` does, and the trained model is exported with them.

use std::collections::HashSet;

use crate::graph::ir::{
    attr_f, attr_i, int_attr, ints_attr, make_node, value_info, Graph, Metas, ValueMeta,
};
use crate::onnx::proto::{NodeProto, TensorProto};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// A running statistic: its initializer, the value that updates it, and the nodes.
#[derive(Debug, Clone)]
pub struct Buffer {
    /// The initializer (now a graph input), e.g. `bn1.running_mean`.
    pub name: String,
    /// The forward value holding its update.
    pub update: String,
    /// The `BatchNormalization` node that reads it, and at which input.
    pub reader: String,
    /// The input of `reader` it is (3: mean, 4: variance).
    pub slot: usize,
    /// The nodes that compute the update (they run where `reader` runs).
    pub nodes: Vec<String>,
    /// Its value in the model.
    pub init: Tensor,
}

/// Prefix of every node and value this module adds.
const PREFIX: &str = "running_stats/";

/// Adds the update nodes of every training-mode `BatchNormalization` with initializer
/// statistics to the end of `g`'s nodes, and turns those initializers into inputs.
///
/// # Errors
/// `BadTensor` for a statistic that cannot be read.
pub(crate) fn track_running_stats(g: &mut Graph, metas: &Metas) -> Result<Vec<Buffer>> {
    let readers: Vec<usize> = (0..g.nodes.len())
        .filter(|&i| {
            let n = &g.nodes[i];
            n.op_type == "BatchNormalization"
                && attr_i(n, "training_mode") == Some(1)
                && n.input.len() == 5
                && n.input[3..].iter().all(|v| g.initializer(v).is_some())
                && metas.get(&n.input[0]).is_some_and(|m| m.shape.len() >= 2)
        })
        .collect();
    let mut buffers = Vec::new();
    let mut taken: HashSet<String> = HashSet::new();
    let opset = g.opset();
    for (k, i) in readers.into_iter().enumerate() {
        let bn = g.nodes[i].clone();
        // A statistic shared by two nodes would have two updates: leave those alone.
        if !taken.insert(bn.input[3].clone()) || !taken.insert(bn.input[4].clone()) {
            continue;
        }
        let init = |name: &str| -> Result<Tensor> {
            Tensor::from_proto(g.initializer(name).expect("checked above"))
        };
        let stats = [init(&bn.input[3])?, init(&bn.input[4])?];
        let rank = metas[&bn.input[0]].shape.len();
        let update = update_nodes(&bn, k, rank, opset, &stats[0])?;
        g.nodes.extend(update.nodes.iter().cloned());
        g.initializers.extend(update.consts);
        for (slot, t) in (3..5).zip(stats) {
            let name = bn.input[slot].clone();
            g.initializers.retain(|c| c.name != name);
            g.nodes[i].input[slot] = update.fixed[slot - 3].clone();
            let meta = ValueMeta {
                dtype: t.dtype(),
                shape: t.shape.clone(),
            };
            g.inputs.push(value_info(&name, &meta));
            buffers.push(Buffer {
                name,
                update: update.values[slot - 3].clone(),
                reader: bn.name.clone(),
                slot,
                nodes: update.nodes.iter().map(|n| n.name.clone()).collect(),
                init: t,
            });
        }
    }
    Ok(buffers)
}

/// The value the `k`-th node's constant statistic `which` (0 mean, 1 variance) is filled
/// with: `4/3 + (2k + which) / 2^20`, positive, distinct per node and statistic, and no
/// value a graph computes with (see the module doc). The node's output does not depend
/// on it.
fn placeholder(k: usize, which: usize) -> f64 {
    4.0 / 3.0 + (2 * k + which) as f64 / f64::from(1 << 20)
}

/// What updates one node's statistics.
struct Update {
    nodes: Vec<NodeProto>,
    consts: Vec<TensorProto>,
    /// The new mean and variance.
    values: [String; 2],
    /// The constants the node reads in their place while training.
    fixed: [String; 2],
}

/// The nodes computing `bn`'s new running mean and variance from its input (of rank
/// `rank`, channels on axis 1).
fn update_nodes(
    bn: &NodeProto,
    k: usize,
    rank: usize,
    opset: i64,
    mean: &Tensor,
) -> Result<Update> {
    let p = format!("{PREFIX}{k}/");
    let v = |s: &str| format!("{p}{s}");
    let momentum = f64::from(attr_f(bn, "momentum").unwrap_or(0.9));
    let c = mean.len();
    let scalar = |x: f64| -> Result<Tensor> {
        match mean.dtype() {
            DType::F64 => Tensor::f64(vec![], vec![x]),
            _ => Tensor::f32(vec![], vec![x as f32]),
        }
    };
    let filled = |x: f64| -> Result<Tensor> {
        match mean.dtype() {
            DType::F64 => Tensor::f64(vec![c], vec![x; c]),
            _ => Tensor::f32(vec![c], vec![x as f32; c]),
        }
    };
    let axes: Vec<i64> = std::iter::once(0).chain(2..rank as i64).collect();
    let mut consts = vec![
        scalar(momentum)?.to_proto(&v("momentum")),
        scalar(1.0 - momentum)?.to_proto(&v("rest")),
        scalar(c as f64)?.to_proto(&v("channels")),
        scalar(1.0)?.to_proto(&v("one")),
        filled(placeholder(k, 0))?.to_proto(&v("fixed_mean")),
        filled(placeholder(k, 1))?.to_proto(&v("fixed_var")),
        Tensor::i64(vec![axes.len()], axes.clone())?.to_proto(&v("axes")),
    ];
    consts.truncate(if opset >= 18 { 7 } else { 6 });
    let (x, rm, rv) = (&bn.input[0], &bn.input[3], &bn.input[4]);
    let to = match mean.dtype() {
        DType::F64 => 11,
        _ => 1,
    };
    let node = |op: &str, name: &str, ins: &[&str], attrs| {
        make_node(op, &v(name), ins, &[&v(name)], attrs)
    };
    let reduce = |name: &str, input: &str, keep: i64| match opset >= 18 {
        true => node(
            "ReduceMean",
            name,
            &[input, &v("axes")],
            vec![int_attr("keepdims", keep)],
        ),
        false => node(
            "ReduceMean",
            name,
            &[input],
            vec![ints_attr("axes", &axes), int_attr("keepdims", keep)],
        ),
    };
    let nodes = vec![
        reduce("batch_mean_kept", x, 1),
        node("Sub", "centered", &[x, &v("batch_mean_kept")], vec![]),
        node("Mul", "squared", &[&v("centered"), &v("centered")], vec![]),
        reduce("batch_var", &v("squared"), 0),
        reduce("batch_mean", x, 0),
        node("Size", "size", &[x], vec![]),
        node("Cast", "size_f", &[&v("size")], vec![int_attr("to", to)]),
        node("Div", "n", &[&v("size_f"), &v("channels")], vec![]),
        node("Sub", "n_1", &[&v("n"), &v("one")], vec![]),
        node("Div", "unbias", &[&v("n"), &v("n_1")], vec![]),
        node("Mul", "kept_mean", &[rm, &v("momentum")], vec![]),
        node("Mul", "new_mean", &[&v("batch_mean"), &v("rest")], vec![]),
        node("Add", "mean", &[&v("kept_mean"), &v("new_mean")], vec![]),
        node(
            "Mul",
            "var_unbiased",
            &[&v("batch_var"), &v("unbias")],
            vec![],
        ),
        node("Mul", "kept_var", &[rv, &v("momentum")], vec![]),
        node("Mul", "new_var", &[&v("var_unbiased"), &v("rest")], vec![]),
        node("Add", "var", &[&v("kept_var"), &v("new_var")], vec![]),
    ];
    Ok(Update {
        nodes,
        consts,
        values: [v("mean"), v("var")],
        fixed: [v("fixed_mean"), v("fixed_var")],
    })
}

/// Makes `g` (an evaluation graph) normalize with the running statistics: drops the
/// update nodes and puts the nodes that read `buffers` in inference mode.
pub(crate) fn inference_mode(g: &mut Graph, buffers: &[Buffer]) {
    if buffers.is_empty() {
        return;
    }
    let readers: HashSet<&str> = buffers.iter().map(|b| b.reader.as_str()).collect();
    g.nodes.retain(|n| !n.name.starts_with(PREFIX));
    for n in g
        .nodes
        .iter_mut()
        .filter(|n| readers.contains(n.name.as_str()))
    {
        n.attribute.retain(|a| a.name != "training_mode");
        n.output.truncate(1);
        // The statistics it normalizes with: the buffers (in training it reads constants
        // in their place, which its output does not depend on).
        for b in buffers.iter().filter(|b| b.reader == n.name) {
            n.input[b.slot] = b.name.clone();
        }
    }
    let held: Vec<&Buffer> = buffers.iter().filter(|b| readers_here(g, b)).collect();
    for b in held {
        if !g.inputs.iter().any(|v| v.name == b.name) {
            let meta = ValueMeta {
                dtype: b.init.dtype(),
                shape: b.init.shape.clone(),
            };
            g.inputs.push(value_info(&b.name, &meta));
        }
    }
    g.outputs.retain(|o| !o.name.starts_with(PREFIX));
}

/// Whether `g` holds the node that reads buffer `b`.
fn readers_here(g: &Graph, b: &Buffer) -> bool {
    g.nodes.iter().any(|n| n.name == b.reader)
}

/// `g` with the running statistics it reads as constants holding their initial values:
/// for runners that train a micro-batch at a time and keep no state (checks, benches).
pub fn buffers_as_constants(g: &Graph, buffers: &[Buffer]) -> Graph {
    let mut g = g.clone();
    for b in buffers {
        if let Some(i) = g.inputs.iter().position(|v| v.name == b.name) {
            g.inputs.remove(i);
            g.initializers.push(b.init.to_proto(&b.name));
        }
    }
    g
}
