//! A process's peak memory, predicted from its stage graphs before any session opens, and
//! the memory cap it must fit: a run predicted not to fit is refused before it trains,
//! with the prediction by part and what would fit.
//!
//! The prediction, per stage the process holds:
//! - **state**: parameters, their gradients and the optimizer's moments (none for plain
//!   SGD, one for momentum, two for Adam, AdamW and LAMB), in the parameters' type, and
//!   on a GPU, where a step has several micro-batches, the gradients of the one in
//!   flight (the first is written into the accumulators, the others arrive beside
//!   them; on the host each is added as it is made, `graph::accumulating`); with the
//!   optimizer state sharded (ZeRO stage 1), the moments of the largest replica's part;
//!   with the gradients sharded too (stage 2), that part's gradients and the buckets in
//!   flight instead of the whole gradients; with gradient buckets, their buffers (a
//!   second copy of the gradients);
//! - **stash**: the values its in-flight micro-batches keep between forward and backward
//!   at the schedule's peak (`memory::predicted_stash`);
//! - **workspace**: the most bytes the largest of its passes holds at once, walking the
//!   pass's nodes in order and freeing each value after its last reader, times
//!   [`ARENA_OVERHEAD`] (what ONNX Runtime's arena holds beyond that: its own order,
//!   kernels' scratch, blocks that do not fit freed holes); stages of one process run at
//!   once, so theirs add up;
//! - **constants**: the initializers that do not train, held by the stage graph and
//!   copied by ONNX Runtime into its session.
//!
//! and once per process a **fixed** part: what the process held when the prediction was
//! made (the runtime, the loaded model's structure, the data), measured, not predicted.
//! The process's peak so far (graph building's) is the floor of the prediction.

use std::collections::{HashMap, HashSet};

use crate::config::TrainConfig;
use crate::graph::{Graph, Metas, StageGraphs, TrainingGraph};
use crate::optim::OptimizerConfig;

/// ONNX Runtime's arena beside the ordered live peak of a pass: measured on GPT-2 small
/// (4 x 128), BERT-base (8 x 128) and ViT-B/16 (8 images), SGD, one stage, as the
/// growth of resident memory over a step after the sessions opened, divided by the
/// ordered live peak: 1.60, 1.35 and 1.23.
pub const ARENA_OVERHEAD: f64 = 1.4;

/// One stage's predicted bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageMemory {
    /// Parameters, gradients and optimizer moments.
    pub state: u64,
    /// Kept values of in-flight micro-batches, at the schedule's peak.
    pub stash: u64,
    /// The largest pass's live values at once.
    pub workspace: u64,
    /// Initializers that do not train, twice (the graph's and the session's).
    pub constants: u64,
}

impl StageMemory {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.state + self.stash + self.workspace + self.constants
    }
}

/// What one process is predicted to hold at its peak.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Per stage it runs (a stage of several replicas counts once per replica).
    pub stages: Vec<StageMemory>,
    /// What the process held before its sessions opened.
    pub fixed: u64,
    /// The process's peak before its sessions opened (graph building's).
    pub so_far: u64,
}

impl ProcessMemory {
    /// The predicted peak: the training's, or graph building's where that was higher.
    pub fn total(&self) -> u64 {
        self.training().max(self.so_far)
    }

    /// The predicted peak while training.
    pub fn training(&self) -> u64 {
        self.fixed + self.stages.iter().map(StageMemory::total).sum::<u64>()
    }

    /// `"3.21 GB (state 1.00, stash 0.62, workspace 1.31, constants 0.01, fixed 0.27;
    /// graph building's peak 2.10 GB)"`.
    pub fn describe(&self) -> String {
        let sum = |f: fn(&StageMemory) -> u64| self.stages.iter().map(f).sum::<u64>();
        format!(
            "{} (state {:.2}, stash {:.2}, workspace {:.2}, constants {:.2}, fixed {:.2}; \
             graph building's peak {})",
            gb(self.total()),
            sum(|s| s.state) as f64 / 1e9,
            sum(|s| s.stash) as f64 / 1e9,
            sum(|s| s.workspace) as f64 / 1e9,
            sum(|s| s.constants) as f64 / 1e9,
            self.fixed as f64 / 1e9,
            gb(self.so_far),
        )
    }
}

/// `bytes` in GB, two decimals.
pub(crate) fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

/// The optimizer's moments per parameter element.
pub(crate) fn moments(optimizer: &OptimizerConfig) -> u64 {
    match optimizer {
        OptimizerConfig::Sgd { momentum, .. } if *momentum == 0.0 => 0,
        OptimizerConfig::Sgd { .. } => 1,
        OptimizerConfig::Adam { .. }
        | OptimizerConfig::AdamW { .. }
        | OptimizerConfig::Lamb { .. } => 2,
    }
}

/// The predicted bytes of each of `stages` (given their stash peaks, `stash[s]`).
pub(crate) fn stage_memory(
    cfg: &TrainConfig,
    tg: &TrainingGraph,
    stages: &[StageGraphs],
    stash: &[u64],
) -> Vec<StageMemory> {
    let param_bytes: HashMap<&str, u64> = tg
        .params
        .iter()
        .map(|p| (p.name.as_str(), bytes_of(&p.meta)))
        .collect();
    // On the host a later micro-batch adds its gradients as they are made (the stage's
    // accumulating sessions); on a device they arrive in a buffer of their own first.
    let on_device = cfg.runtime.device != crate::compute::Device::Cpu;
    let accumulating = u64::from(cfg.gradient_accumulation_steps > 1 && on_device);
    let copies = 2 + accumulating;
    // Gradient buckets keep their own buffers, a second copy of a stage's gradients
    // where they are more than one bucket (`pipeline::buckets`).
    let bucket_bytes = super::settings::stage_settings(cfg, 1.0).bucket_bytes as u64;
    // Parameters' gradients are in `state`: written into the accumulators, or (a later
    // micro-batch's) the accumulating copy.
    let grads: HashSet<&str> = tg.params.iter().map(|p| p.grad.as_str()).collect();
    stages
        .iter()
        .map(|g| {
            let sizes: Vec<u64> = (g.io.params.iter())
                .filter_map(|p| param_bytes.get(p.as_str()).copied())
                .collect();
            let params: u64 = sizes.iter().sum();
            let buckets = match bucket_bytes > 0 && params > bucket_bytes {
                true => params,
                false => 0,
            };
            let own = updated_bytes(cfg, &sizes);
            // Sharded gradients (ZeRO stage 2): this replica's part, and the buckets out.
            // A bucket holds whole tensors: the largest may be over the bucket size.
            let largest = sizes.iter().max().copied().unwrap_or(0);
            let grad_bytes = match cfg.shards_gradients() {
                true => own + (IN_FLIGHT_BUCKETS * bucket_bytes + largest).min(params),
                false => (copies - 1) * params + buckets,
            };
            StageMemory {
                state: params + grad_bytes + moments(&cfg.optimizer) * own,
                stash: stash.get(g.stage).copied().unwrap_or(0),
                workspace: (workspace(g, &tg.metas, &grads) as f64 * ARENA_OVERHEAD) as u64,
                constants: 2 * constants(g),
            }
        })
        .collect()
}

/// Gradient buckets a stage with sharded gradients holds at once: those out for
/// reduction (`pipeline::zero_grads`), the one filling and a spare.
const IN_FLIGHT_BUCKETS: u64 = 4;

/// The bytes of the parameters (of `sizes` bytes each) whose optimizer state one
/// replica keeps: all of them, or with the state sharded across the data-parallel
/// replicas (ZeRO stages 1 and 2), the largest replica's part.
fn updated_bytes(cfg: &TrainConfig, sizes: &[u64]) -> u64 {
    let dp = cfg.data_parallel_size;
    if !cfg.shards_optimizer_state() {
        return sizes.iter().sum();
    }
    let layout = crate::optim::ParamLayout::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| (i.to_string(), vec![b as usize])),
    );
    (layout.partition(dp).into_iter())
        .map(|t| layout.values_of(t).len() as u64)
        .max()
        .unwrap_or(0)
}

/// The most bytes one of `g`'s training passes holds at once, besides `grads`.
fn workspace(g: &StageGraphs, metas: &Metas, grads: &HashSet<&str>) -> u64 {
    let passes: Vec<&Graph> = match &g.fused {
        Some(fused) => vec![fused, &g.backward_input, &g.backward_weight],
        None => vec![
            &g.forward,
            &g.backward,
            &g.backward_input,
            &g.backward_weight,
        ],
    };
    passes
        .into_iter()
        .map(|p| live_peak_besides(p, metas, grads))
        .max()
        .unwrap_or(0)
}

/// The bytes of the initializers in `g`'s graphs (each counted once).
fn constants(g: &StageGraphs) -> u64 {
    let mut seen: HashSet<&str> = HashSet::new();
    [&g.forward, &g.backward]
        .into_iter()
        .chain(g.fused.as_ref())
        .flat_map(|p| p.initializers.iter())
        .filter(|t| seen.insert(t.name.as_str()))
        .map(|t| {
            let n: i64 = t.dims.iter().product();
            let size = crate::tensor::DType::from_onnx(t.data_type).map_or(4, |d| d.size());
            n.max(0) as u64 * size as u64
        })
        .sum()
}

/// Operators whose output is their first input's buffer seen another way (ONNX Runtime
/// aliases them, no copy).
const ALIASES: [&str; 5] = ["Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"];

/// The most bytes of node outputs alive at once when `g`'s nodes run in order, each
/// buffer freed after the last reader of any value that views it (the graph's outputs
/// stay).
#[cfg(test)]
fn live_peak(g: &Graph, metas: &Metas) -> u64 {
    live_peak_besides(g, metas, &HashSet::new())
}

/// [`live_peak`], counting no bytes for the values in `besides`.
fn live_peak_besides(g: &Graph, metas: &Metas, besides: &HashSet<&str>) -> u64 {
    // Each value's buffer: its own, or the buffer of the value it aliases.
    let mut buffer: HashMap<&str, &str> = HashMap::new();
    for n in &g.nodes {
        let Some(o) = n.output.first().filter(|o| !o.is_empty()) else {
            continue;
        };
        match (ALIASES.contains(&n.op_type.as_str()), n.input.first()) {
            (true, Some(x)) if !x.is_empty() => {
                let root = buffer.get(x.as_str()).copied().unwrap_or(x.as_str());
                buffer.insert(o.as_str(), root);
            }
            _ => {}
        }
    }
    let root = |v: &'_ str| -> String { buffer.get(v).copied().unwrap_or(v).to_string() };
    let kept: HashSet<String> = g.outputs.iter().map(|v| root(&v.name)).collect();
    let mut last_read: HashMap<String, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for v in n.input.iter().chain(&n.output).filter(|v| !v.is_empty()) {
            last_read.insert(root(v), i);
        }
    }
    // A gradient is often an alias (`Identity`) of the product that computes it.
    let besides: HashSet<String> = besides.iter().map(|v| root(v)).collect();
    let size = |n: &str| match besides.contains(n) {
        true => 0,
        false => metas.get(n).map_or(0, bytes_of),
    };
    let (mut live, mut peak) = (0u64, 0u64);
    let mut held: HashMap<String, u64> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            let r = root(o);
            if r == *o && !held.contains_key(&r) {
                held.insert(r, size(o));
                live += size(o);
            }
        }
        peak = peak.max(live);
        let done: Vec<String> = held
            .keys()
            .filter(|r| !kept.contains(*r) && last_read.get(*r).is_none_or(|&last| last <= i))
            .cloned()
            .collect();
        for r in done {
            live -= held.remove(&r).unwrap_or(0);
        }
    }
    peak
}

fn bytes_of(m: &crate::graph::ValueMeta) -> u64 {
    (m.numel() * m.dtype.size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{value_info, ValueMeta};
    use crate::onnx::proto::NodeProto;
    use crate::tensor::DType;

    fn node(inputs: &[&str], output: &str) -> NodeProto {
        NodeProto {
            op_type: "Relu".into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.to_string()],
            ..Default::default()
        }
    }

    #[test]
    fn a_value_is_freed_after_its_last_reader_and_outputs_stay() {
        // x -> a -> b -> c (output); a is also read by c's node: a lives until then.
        let meta = |n: usize| ValueMeta {
            dtype: DType::F32,
            shape: vec![n],
        };
        let metas: Metas = [("a", 100), ("b", 10), ("c", 1), ("d", 1000)]
            .into_iter()
            .map(|(k, n)| (k.to_string(), meta(n)))
            .collect();
        let g = Graph {
            nodes: vec![
                node(&["x"], "a"),
                node(&["a"], "b"),
                node(&["a", "b"], "c"),
                node(&["x"], "d"),
            ],
            outputs: vec![value_info("c", &meta(1))],
            ..Default::default()
        };
        // Peak: d (4000) beside the output c (4) after a and b were freed, against
        // a + b + c = 444 earlier.
        assert_eq!(live_peak(&g, &metas), 4004);
        let g = Graph {
            nodes: g.nodes[..3].to_vec(),
            ..g
        };
        assert_eq!(live_peak(&g, &metas), 444);
    }

    #[test]
    fn a_sharded_optimizer_state_counts_the_largest_replicas_part() {
        let text = "model_path = \"m.onnx\"\nbatch_size = 1\nnum_train_steps = 1\n\
                    data_parallel_size = 3\ndeepspeed_zero_stage = 1\n\
                    [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"y\"\nlabel = \"t\"\n\
                    [data]\npath = \"d.npz\"\n[optimizer]\nkind = \"adamw\"\n\
                    [lr_schedule]\nkind = \"constant\"\nlr = 0.1\n";
        let mut cfg: TrainConfig = toml::from_str(text).unwrap();
        let sizes = [400, 40, 300, 260];
        // Whole tensors: 400 | 340 | 260 of 1000.
        assert_eq!(updated_bytes(&cfg, &sizes), 400);
        cfg.deepspeed_zero_stage = 0;
        assert_eq!(updated_bytes(&cfg, &sizes), 1000);
        cfg.deepspeed_zero_stage = 1;
        cfg.data_parallel_size = 1;
        assert_eq!(updated_bytes(&cfg, &sizes), 1000, "no replicas to share it");
    }

    #[test]
    fn the_optimizer_decides_the_moments() {
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        assert_eq!(moments(&sgd), 0);
        assert_eq!(moments(&OptimizerConfig::default()), 2);
    }
}
