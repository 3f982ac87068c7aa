//! How a stage trains besides its graphs ([`StageSettings`]), and where it copies the
//! values named for TensorBoard histograms ([`HistogramTap`]).

use std::time::Duration;

use crate::compute::{ReplicaLink, ShardLink};
use crate::graph::LossNormalize;
use crate::optim::{OptimizerConfig, ParamGroup};

/// How a stage trains, besides its graphs.
#[derive(Debug, Clone)]
pub struct StageSettings {
    /// Run the backward as input-gradient and weight-gradient halves (zero-bubble).
    pub split_backward: bool,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Parameters with their own optimizer settings (first match wins).
    pub param_groups: Vec<ParamGroup>,
    /// 1 / (micro-batches x replicas): summing micro-batch gradients over the step and
    /// over replicas then gives the mean gradient of the global batch.
    pub seed_scale: f64,
    /// The first step's loss scale.
    pub loss_scale: f64,
    /// How the loss is normalized under accumulation.
    pub normalize: LossNormalize,
    /// Optimizer steps (from 0) at which this stage's gradient gets a +inf: a test aid.
    pub overflow_at: Vec<u64>,
    /// Checkpoint writes in pieces with this pause between them: a test aid.
    pub slow_save: Option<Duration>,
    /// Hold the first forward of this optimizer step (from 0) this long: a test aid.
    pub stall: Option<(u64, Duration)>,
    /// Copies of named parameters and their gradients every step, for histograms.
    pub histograms: Option<HistogramTap>,
    /// Gradient buckets of about this many bytes, each reduced across replicas while
    /// the rest of the step's last backward runs; 0: no buckets (one reduction after
    /// the backward).
    pub bucket_bytes: usize,
    /// Micro-batches per step (each contributes once to the gradients).
    pub micro_batches: usize,
    /// This replica's place when the replicas' gradients combine by Adasum rather than
    /// by their sum (`enable_adasum`).
    pub adasum: Option<super::AdasumSlot>,
    /// This stage's tensor shard: its collectives' group (`None`: not split).
    pub shard: Option<ShardLink>,
    /// This replica's part of the optimizer state, sharded across the data-parallel
    /// replicas (`deepspeed_zero_stage = 1`; `None`: each replica keeps all of it).
    pub zero: Option<super::ZeroSlot>,
    /// This stage's place among its data-parallel replicas where they all run in this
    /// process on its device and sum their gradients in device memory
    /// (`compute/replicas.rs`; `None`: through the engine's collective).
    pub replicas: Option<ReplicaLink>,
}

/// Where a stage sends copies of the parameters (and gradients) named for TensorBoard
/// histograms. Only data-parallel replica 0's stages send (every replica holds the same
/// values): its first tensor shard's, or each of its `shards` where the model is split
/// and they run in this process (the log puts a split parameter's parts together).
#[derive(Debug, Clone)]
pub struct HistogramTap {
    /// Parameter names to copy.
    pub names: Vec<String>,
    /// The tensor shards that send, from shard 0 (1: shard 0 alone).
    pub shards: usize,
    /// Where the copies go.
    pub tx: flume::Sender<Tapped>,
}

/// A copy of a named tensor, from one tensor shard.
#[derive(Debug, Clone)]
pub struct Tapped {
    /// `"param/<name>"` or `"grad/<name>"`.
    pub tag: String,
    /// The step (0-based).
    pub step: u64,
    /// The tensor shard it came from (0 where the model is not split).
    pub shard: usize,
    /// Its values (the shard's part of a split parameter).
    pub values: Vec<f32>,
}

impl StageSettings {
    /// A stage training with `optimizer`, micro-batch gradients weighted by `seed_scale`,
    /// no loss scaling, no split backward, no gradient buckets, no test aids.
    pub fn new(optimizer: OptimizerConfig, seed_scale: f64) -> StageSettings {
        StageSettings {
            split_backward: false,
            optimizer,
            param_groups: Vec::new(),
            seed_scale,
            loss_scale: 1.0,
            normalize: LossNormalize::MicroBatch,
            overflow_at: Vec::new(),
            slow_save: None,
            stall: None,
            histograms: None,
            bucket_bytes: 0,
            micro_batches: 1,
            adasum: None,
            shard: None,
            zero: None,
            replicas: None,
        }
    }
}
