//! Which backward nodes a stage's input-gradient pass (`I`) runs, and which only its
//! weight-gradient pass (`W`) does, from the training graph alone.
//!
//! A backward node is on the input-gradient path when what it makes flows on to the
//! backward of another forward node (the gradient going back through the model), either
//! directly or through nodes of its own forward node that do. The rest only make
//! parameter gradients. Cut anywhere, a stage's `I` graph runs the first kind (it must
//! hand the gradient of its inputs back) and its `W` graph the second, so one
//! classification serves every cut.

use std::collections::HashMap;

use crate::graph::TrainingGraph;

/// Per backward node (`tg.graph.nodes[tg.forward_len..]`), whether it is on the
/// input-gradient path.
pub fn input_grad_nodes(tg: &TrainingGraph) -> Vec<bool> {
    let nodes = &tg.graph.nodes[tg.forward_len..];
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (b, n) in nodes.iter().enumerate() {
        for i in &n.input {
            consumers.entry(i.as_str()).or_default().push(b);
        }
    }
    let mut chain = vec![false; nodes.len()];
    // Consumers come after their producers: settle them first.
    for b in (0..nodes.len()).rev() {
        chain[b] = nodes[b]
            .output
            .iter()
            .filter_map(|o| consumers.get(o.as_str()))
            .flatten()
            .any(|&c| chain[c] || tg.anchors[c] != tg.anchors[b]);
    }
    chain
}
