//! What crosses a cut between two stages, in bytes: forward, the values made before it
//! that a node of the training step after it reads; back, the backward's values made by
//! the nodes of forward nodes after it that a backward node of a forward node before it
//! reads (the partial gradients cross unsummed where their sum is the earlier stage's).
//! As the stage builder hands them on (`graph::stages`), from the training graph alone:
//! `tests/it/plan_costs.rs` compares them at every cut of the tiny GPT.
//!
//! The training step runs only what the loss, the running statistics' updates and the
//! backward need: the accuracy's nodes after the loss are evaluation's, and a cut before
//! them hands nothing on in training.

use std::collections::{BTreeMap, HashMap};

use crate::graph::TrainingGraph;

/// A value read by nodes of other positions than its producer's.
#[derive(Debug, Clone)]
struct Handed {
    /// Its producer's position (in the cuttable nodes).
    made: usize,
    /// The positions of the nodes that read it.
    readers: Vec<usize>,
    /// Its bytes.
    bytes: f64,
}

/// The values that cross cuts, forward and back, at the micro-batch the graph's shapes
/// were measured at.
#[derive(Debug, Clone)]
pub(super) struct Crossings {
    /// Forward values later nodes of the training step read.
    handed: Vec<Handed>,
    /// The backward's values a backward node of another forward node reads, placed at
    /// their nodes' forward nodes.
    returned: Vec<Handed>,
    /// The micro-batch the sizes were measured at.
    pub samples: usize,
}

impl Crossings {
    /// The crossings of `tg` cut among its `live` forward nodes (`position` of each
    /// forward node among them; `trained`: which of them the training step runs), whose
    /// outputs `producer` places.
    pub fn of(
        tg: &TrainingGraph,
        (live, position, trained): (&[usize], &[Option<usize>], &[bool]),
        producer: &HashMap<&str, usize>,
    ) -> Crossings {
        let mut readers: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (p, &i) in live.iter().enumerate().filter(|&(p, _)| trained[p]) {
            for v in &tg.graph.nodes[i].input {
                if producer.get(v.as_str()).is_some_and(|&made| made < p) {
                    let r = readers.entry(v.as_str()).or_default();
                    if r.last() != Some(&p) {
                        r.push(p);
                    }
                }
            }
        }
        Crossings {
            handed: sized(tg, readers, producer),
            returned: returned(tg, position),
            samples: 1,
        }
    }

    /// Bytes crossing a cut at position `bound` for a micro-batch of `samples`, scaled
    /// from the measured one: forward, or back (`gradients`).
    pub fn bytes(&self, bound: usize, gradients: bool, samples: usize) -> f64 {
        let crosses = |h: &&Handed| match gradients {
            false => h.made < bound && h.readers.iter().any(|&r| r >= bound),
            true => h.made >= bound && h.readers.iter().any(|&r| r < bound),
        };
        let values = match gradients {
            false => &self.handed,
            true => &self.returned,
        };
        let measured: f64 = values.iter().filter(crosses).map(|h| h.bytes).sum();
        measured * samples as f64 / self.samples as f64
    }
}

/// Per position in `live`, whether a training step runs the node: the loss, the running
/// statistics' updates and every forward value the backward reads, and what they need.
pub(super) fn trained_nodes(
    tg: &TrainingGraph,
    producer: &HashMap<&str, usize>,
    live: &[usize],
) -> Vec<bool> {
    let backward = tg.graph.nodes[tg.forward_len..].iter();
    let mut todo: Vec<&str> = std::iter::once(crate::graph::LOSS)
        .chain(tg.buffers.iter().map(|b| b.update.as_str()))
        .chain(backward.flat_map(|n| n.input.iter().map(String::as_str)))
        .collect();
    let mut trained = vec![false; live.len()];
    while let Some(v) = todo.pop() {
        let Some(&p) = producer.get(v) else { continue };
        if !trained[p] {
            trained[p] = true;
            todo.extend(tg.graph.nodes[live[p]].input.iter().map(String::as_str));
        }
    }
    trained
}

/// The backward's values read by backward nodes of other forward nodes, each placed at
/// its producer's and readers' forward nodes (`position` among the cuttable ones;
/// constants' left out).
fn returned(tg: &TrainingGraph, position: &[Option<usize>]) -> Vec<Handed> {
    let backward = &tg.graph.nodes[tg.forward_len..];
    let at = |b: usize| position.get(tg.anchors[b]).copied().flatten();
    let mut made: HashMap<&str, usize> = HashMap::new();
    for (b, n) in backward.iter().enumerate() {
        if let Some(p) = at(b) {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                made.insert(o.as_str(), p);
            }
        }
    }
    let mut readers: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (b, n) in backward.iter().enumerate() {
        let Some(p) = at(b) else { continue };
        for v in &n.input {
            if made.get(v.as_str()).is_some_and(|&m| m != p) {
                readers.entry(v.as_str()).or_default().push(p);
            }
        }
    }
    sized(tg, readers, &made)
}

/// The values `readers` names, made where `made` says, with their bytes.
fn sized(
    tg: &TrainingGraph,
    readers: BTreeMap<&str, Vec<usize>>,
    made: &HashMap<&str, usize>,
) -> Vec<Handed> {
    readers
        .into_iter()
        .filter_map(|(v, readers)| {
            let meta = tg.metas.get(v)?;
            Some(Handed {
                made: *made.get(v)?,
                readers,
                bytes: (meta.numel() * meta.dtype.size()) as f64,
            })
        })
        .collect()
}
