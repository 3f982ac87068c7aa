//! Which backward nodes a stage's input-gradient pass (`I`) runs, and which only its
//! weight-gradient pass (`W`) does, for given cuts: as the stage builder decides it
//! (`graph::stages`), from the training graph alone.
//!
//! A stage's `I` makes the gradients it hands back: the values its backward nodes make
//! that a backward node of an earlier stage reads, with everything of its own they need.
//! The rest of its backward is `W`. Which values cross depends on the cut (a bias's
//! reshaped gradient crosses only where the cut falls between a product and its bias), so
//! this is worked out for each set of cuts, not once per node.

use std::collections::HashMap;

use crate::graph::TrainingGraph;

/// The backward nodes (`tg.graph.nodes[tg.forward_len..]`) as a graph: each one's forward
/// node, the backward nodes it reads from, and the forward nodes of those that read it.
#[derive(Debug, Clone)]
pub struct BackwardGraph {
    anchors: Vec<usize>,
    reads: Vec<Vec<usize>>,
    read_by: Vec<Vec<usize>>,
}

impl BackwardGraph {
    /// The backward of `tg`.
    pub fn of(tg: &TrainingGraph) -> BackwardGraph {
        let nodes = &tg.graph.nodes[tg.forward_len..];
        let mut producer: HashMap<&str, usize> = HashMap::new();
        for (b, n) in nodes.iter().enumerate() {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.as_str(), b);
            }
        }
        let mut reads = vec![Vec::new(); nodes.len()];
        let mut read_by = vec![Vec::new(); nodes.len()];
        for (b, n) in nodes.iter().enumerate() {
            for i in &n.input {
                if let Some(&p) = producer.get(i.as_str()) {
                    reads[b].push(p);
                    read_by[p].push(tg.anchors[b]);
                }
            }
        }
        BackwardGraph {
            anchors: tg.anchors.clone(),
            reads,
            read_by,
        }
    }

    /// How many backward nodes there are.
    pub fn len(&self) -> usize {
        self.anchors.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.anchors.is_empty()
    }

    /// Each backward node's forward node.
    pub fn anchor(&self, b: usize) -> usize {
        self.anchors[b]
    }

    /// Per backward node, whether its stage runs it in its `I` pass, where `stage_of`
    /// gives each forward node's stage (`None` for constants).
    pub fn input_part(&self, stage_of: &dyn Fn(usize) -> Option<usize>) -> Vec<bool> {
        let stage: Vec<Option<usize>> = self.anchors.iter().map(|&a| stage_of(a)).collect();
        let mut on = vec![false; self.len()];
        let mut todo: Vec<usize> = (0..self.len())
            .filter(|&b| {
                stage[b].is_some_and(|s| {
                    self.read_by[b]
                        .iter()
                        .any(|&a| stage_of(a).is_some_and(|r| r < s))
                })
            })
            .collect();
        while let Some(b) = todo.pop() {
            if on[b] {
                continue;
            }
            on[b] = true;
            let own = stage[b];
            todo.extend(self.reads[b].iter().filter(|&&p| stage[p] == own && !on[p]));
        }
        on
    }
}
