//! Reading ONNX Runtime's profile files (`enable_profiling`, chrome://tracing JSON):
//! each training graph node's share of a session's kernel time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::graph::TrainingGraph;

/// One ONNX Runtime profile event (`chrome://tracing` format).
#[derive(Deserialize)]
struct OrtEvent {
    cat: String,
    name: String,
    ts: u64,
    dur: u64,
}

/// Per-node costs (each forward node's, each backward node's) and the unmatched share.
pub(super) type NodeTimes = (Vec<f64>, Vec<f64>, f64);

/// How a profile's runs are counted: `steps` optimizer steps of `micro_batches` each,
/// the first `warmup` steps left out.
#[derive(Clone, Copy)]
pub(super) struct Counting {
    pub(super) steps: usize,
    pub(super) micro_batches: usize,
    pub(super) warmup: usize,
}

/// Per micro-batch: each node's kernel time (a backward split over several sessions, the
/// first micro-batch's and the accumulating twin's, adds up).
pub(super) fn read_profile(
    dir: &Path,
    tg: &TrainingGraph,
    n: Counting,
) -> std::result::Result<NodeTimes, String> {
    let names = Names::of(tg);
    let f = tg.forward_len;
    let mut node = vec![0.0; tg.graph.nodes.len()];
    let (mut runs_seen, mut unmatched, mut total) = (0usize, 0.0, 0.0);
    let counted_mbs = ((n.steps - n.warmup) * n.micro_batches) as f64;
    for path in profile_files(dir)? {
        let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let events: Vec<OrtEvent> =
            serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let Some((from, runs)) = counted_runs(&events, n) else {
            continue;
        };
        let timed: Vec<(&str, u64)> = events
            .iter()
            .filter(|e| e.cat == "Node" && e.ts >= from)
            .filter_map(|e| Some((e.name.strip_suffix("_kernel_time")?, e.dur)))
            .collect();
        let op_of = |node: &str| names.find(node).map(|i| tg.graph.nodes[i].op_type.as_str());
        let overhead = profiler_overhead(&timed, &op_of);
        let mut kernels = 0.0;
        let mut attributed = vec![0.0; tg.graph.nodes.len()];
        for &(node, dur) in &timed {
            let secs = (dur as f64 - overhead).max(0.0) * 1e-6 / counted_mbs;
            kernels += secs;
            match names.find(node) {
                Some(i) => attributed[i] += secs,
                None => unmatched += secs,
            }
        }
        let matched: f64 = attributed.iter().sum();
        let scale = if matched > 0.0 {
            kernels / matched
        } else {
            0.0
        };
        for (i, t) in attributed.into_iter().enumerate() {
            node[i] += t * scale;
        }
        total += kernels;
        runs_seen += runs;
    }
    if runs_seen == 0 {
        return Err(format!(
            "no ONNX Runtime profile with runs after {} warm-up step(s) was written in {}",
            n.warmup,
            dir.display()
        ));
    }
    let backward = node.split_off(f);
    Ok((
        node,
        backward,
        if total > 0.0 { unmatched / total } else { 0.0 },
    ))
}

/// Operators whose kernel makes a view of its input (no arithmetic, no copy): under
/// ONNX Runtime's profiler what such a kernel is timed at is the profiler's own cost.
const VIEWS: [&str; 4] = ["Reshape", "Squeeze", "Unsqueeze", "Flatten"];

/// What ONNX Runtime's profiler adds to each kernel it times, microseconds: the median
/// time of the view kernels among `timed` (node, duration) events, `op_of` naming each
/// node's operator (0 where there are none).
///
/// Spread in proportion, it was work: in the GPT-2 fixture's profile its 54 `Reshape`
/// kernels a micro-batch took 4 us each, 22% of the kernels' time, where without the
/// profiler they take next to nothing. A stage of many small kernels looked dearer
/// than it is, and one of a few large ones cheaper.
fn profiler_overhead<'a>(
    timed: &[(&'a str, u64)],
    op_of: &dyn Fn(&'a str) -> Option<&'a str>,
) -> f64 {
    let views: Vec<f64> = timed
        .iter()
        .filter(|(node, _)| op_of(node).is_some_and(|op| VIEWS.contains(&op)))
        .map(|&(_, dur)| dur as f64)
        .collect();
    super::rounds::median(&views).unwrap_or(0.0)
}

/// The profile files of the stages' training sessions (not their evaluation's).
fn profile_files(dir: &Path) -> std::result::Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        if name.starts_with("pipetrain_stage") && !name.contains("_evaluate_") {
            out.push(path);
        }
    }
    Ok(out)
}

/// The training graph's nodes by name, to find a profile event's node: by its own name,
/// or for a node ONNX Runtime made by fusing (`<node>/MatMulAddFusion`), by the node it
/// was named after; for a node a stage's session adds after a value (a gradient's
/// accumulation, `<gradient>/accumulate`), by the node that makes the value.
///
/// Unmatched, a parameter's accumulation was spread over every node: on the vocabulary
/// GPT the token embedding's (0.55 ms a micro-batch under the profiler, 4% of the
/// backward) landed mostly on other stages, and a first stage holding the embedding
/// alone was predicted a weight gradient of 0.30 ms that measured 0.74-0.77.
struct Names<'a>(HashMap<&'a str, usize>);

impl<'a> Names<'a> {
    fn of(tg: &'a TrainingGraph) -> Self {
        let nodes = tg.graph.nodes.iter();
        Names::from_nodes(nodes.map(|n| (n.name.as_str(), n.output.iter().map(String::as_str))))
    }

    /// From each node's name and outputs, in order: a node's own name first, then the
    /// values it makes where no node has their name.
    fn from_nodes<O: Iterator<Item = &'a str>>(nodes: impl Iterator<Item = (&'a str, O)>) -> Self {
        let mut names = HashMap::new();
        let mut values = Vec::new();
        for (i, (name, outputs)) in nodes.enumerate() {
            names.insert(name, i);
            values.extend(outputs.filter(|o| !o.is_empty()).map(|o| (o, i)));
        }
        for (value, i) in values {
            names.entry(value).or_insert(i);
        }
        Names(names)
    }

    fn find(&self, node: &str) -> Option<usize> {
        let mut name = node;
        loop {
            if let Some(&i) = self.0.get(name) {
                return Some(i);
            }
            name = &name[..name.rfind('/')?];
        }
    }
}

/// Where a session's counted runs start (the runs of the first `warmup` steps left out),
/// and how many there are.
fn counted_runs(events: &[OrtEvent], n: Counting) -> Option<(u64, usize)> {
    let mut runs: Vec<&OrtEvent> = events
        .iter()
        .filter(|e| e.cat == "Session" && e.name == "model_run")
        .collect();
    runs.sort_by_key(|e| e.ts);
    let skip = runs.len() / n.steps.max(1) * n.warmup;
    let counted = runs.get(skip..).filter(|r| !r.is_empty())?;
    Some((counted[0].ts, counted.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profiler_s_cost_a_kernel_is_what_its_view_kernels_take() {
        fn op_of(node: &str) -> Option<&str> {
            node.split('_').next()
        }
        let timed = [
            ("Reshape_1", 4),
            ("MatMul_1", 40),
            ("Squeeze_1", 3),
            ("Reshape_2", 5),
            ("Add_1", 6),
        ];
        assert_eq!(profiler_overhead(&timed, &op_of), 4.0);
        // No view kernel: nothing taken off.
        assert_eq!(profiler_overhead(&timed[1..2], &op_of), 0.0);
    }

    #[test]
    fn a_gradient_s_accumulation_is_the_node_that_makes_the_gradient_s() {
        let nodes = [
            ("embed", vec!["h"]),
            ("grad/embed/Scatter", vec!["wte.weight_grad"]),
            ("head", vec!["logits"]),
        ];
        let names = Names::from_nodes(nodes.iter().map(|(n, o)| (*n, o.iter().copied())));
        assert_eq!(names.find("wte.weight_grad/accumulate"), Some(1));
        // By node name first, a fused node by the node it was named after.
        assert_eq!(names.find("head"), Some(2));
        assert_eq!(names.find("head/MatMulAddFusion"), Some(2));
        assert_eq!(names.find("other/accumulate"), None);
    }
}
