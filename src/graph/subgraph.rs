//! Pieces of the training graph as graphs of their own: which nodes a part needs
//! (constants included), what it reads from outside, and the subgraph itself with typed
//! inputs and outputs.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::graph::ir::{value_info, Graph};
use crate::graph::training::TrainingGraph;
use crate::{Error, Result};

/// `nodes` plus the constant nodes they (transitively) read, in graph order.
pub(super) fn with_constants(
    g: &Graph,
    nodes: &[usize],
    producer: &HashMap<&str, usize>,
    is_const: &[bool],
) -> Vec<usize> {
    let mut set: BTreeSet<usize> = nodes.iter().copied().collect();
    let mut todo: Vec<usize> = nodes.to_vec();
    while let Some(i) = todo.pop() {
        for v in &g.nodes[i].input {
            if let Some(&p) = producer.get(v.as_str()) {
                if is_const.get(p).copied().unwrap_or(false) && set.insert(p) {
                    todo.push(p);
                }
            }
        }
    }
    set.into_iter().collect()
}

/// Values `nodes` read that none of them produces (initializers excluded).
pub(super) fn external_inputs(g: &Graph, nodes: &[usize]) -> Vec<String> {
    let made: HashSet<&str> = nodes
        .iter()
        .flat_map(|&i| g.nodes[i].output.iter().map(String::as_str))
        .collect();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for &i in nodes {
        for v in &g.nodes[i].input {
            if !v.is_empty()
                && !made.contains(v.as_str())
                && g.initializer(v).is_none()
                && seen.insert(v.as_str())
            {
                out.push(v.clone());
            }
        }
    }
    out
}

/// The nodes among `within` that `targets` depend on.
pub(super) fn ancestors(
    g: &Graph,
    within: &[usize],
    targets: &HashSet<&str>,
    producer: &HashMap<&str, usize>,
) -> HashSet<usize> {
    let allowed: HashSet<usize> = within.iter().copied().collect();
    let mut found = HashSet::new();
    let mut todo: Vec<usize> = targets
        .iter()
        .filter_map(|t| producer.get(t).copied())
        .collect();
    while let Some(i) = todo.pop() {
        if !allowed.contains(&i) || !found.insert(i) {
            continue;
        }
        for v in &g.nodes[i].input {
            if let Some(&p) = producer.get(v.as_str()) {
                todo.push(p);
            }
        }
    }
    found
}

/// A graph of `nodes` with typed inputs for everything they read from outside.
pub(super) fn subgraph(
    tg: &TrainingGraph,
    nodes: &[usize],
    outputs: &[String],
    name: &str,
) -> Result<Graph> {
    let g = &tg.graph;
    // Only the nodes the outputs need (evaluation-only values such as the accuracy
    // counts stay out of the training graphs).
    let mut needed: HashSet<&str> = outputs.iter().map(String::as_str).collect();
    let mut kept: Vec<usize> = Vec::with_capacity(nodes.len());
    for &i in nodes.iter().rev() {
        let n = &g.nodes[i];
        if n.output.iter().any(|o| needed.contains(o.as_str())) {
            needed.extend(n.input.iter().map(String::as_str));
            kept.push(i);
        }
    }
    kept.reverse();
    let nodes = &kept[..];
    let typed = |v: &str| {
        let meta = tg
            .metas
            .get(v)
            .ok_or_else(|| Error::graph(format!("{name}: no type known for `{v}`")))?;
        Ok(value_info(v, meta))
    };
    let inputs = external_inputs(g, nodes)
        .iter()
        .map(|v| typed(v))
        .collect::<Result<Vec<_>>>()?;
    let used: HashSet<&str> = nodes
        .iter()
        .flat_map(|&i| g.nodes[i].input.iter().map(String::as_str))
        .collect();
    Ok(Graph {
        name: name.into(),
        nodes: nodes.iter().map(|&i| g.nodes[i].clone()).collect(),
        inputs,
        outputs: outputs
            .iter()
            .map(|v| typed(v))
            .collect::<Result<Vec<_>>>()?,
        initializers: g
            .initializers
            .iter()
            .filter(|t| used.contains(t.name.as_str()))
            .cloned()
            .collect(),
        opsets: g.opsets.clone(),
        ir_version: g.ir_version,
    })
}
