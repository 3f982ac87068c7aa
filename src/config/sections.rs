//! The sections of a training configuration: pipeline, runtime (and data, defined in
//! [`crate::data`]).

use pipetrain_schedules::ScheduleSpec;
use serde::{Deserialize, Serialize};

use super::one;
pub use crate::data::{DataConfig, DataLayout};
use crate::graph::Partition;

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (PipeDream-flush).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` stages per rank.
    #[serde(rename = "interleaved_1f1b")]
    Interleaved1f1b,
    /// Zero-bubble ZB-H1: backward split into input and weight gradients.
    ZbH1,
    /// Zero-bubble ZB-V: two stages per rank folded into a V (rank `r` holds stages `r`
    /// and `2p - 1 - r`), backward split as ZB-H1's.
    ZbV,
    /// DeepSeek's DualPipeV: ZB-V's placement, each rank pairing a forward of one of its
    /// stages with a backward of the other in the steady state.
    #[serde(rename = "dualpipe_v")]
    DualPipeV,
    /// Qi et al.'s V-Half: ZB-V's placement with about half of 1F1B's activation memory,
    /// for a somewhat longer bubble.
    #[serde(rename = "v_half")]
    VHalf,
    /// Qi et al.'s V-Min: ZB-V's placement with about a third of 1F1B's activation memory,
    /// for a longer bubble still.
    #[serde(rename = "v_min")]
    VMin,
}

impl ScheduleKind {
    /// Every kind, in the order tables list them.
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1f1b,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
        ScheduleKind::VHalf,
        ScheduleKind::VMin,
    ];

    /// The kind's name in a configuration (`pipeline.schedule`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1f1b => "interleaved_1f1b",
            ScheduleKind::ZbH1 => "zb_h1",
            ScheduleKind::ZbV => "zb_v",
            ScheduleKind::DualPipeV => "dualpipe_v",
            ScheduleKind::VHalf => "v_half",
            ScheduleKind::VMin => "v_min",
        }
    }

    /// The kind a configuration names `name`.
    pub fn from_name(name: &str) -> Option<ScheduleKind> {
        ScheduleKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether the kind folds two stages onto each rank in a V (rank `r` holds stages
    /// `r` and `2p - 1 - r`).
    pub fn v_shaped(self) -> bool {
        matches!(
            self,
            ScheduleKind::ZbV | ScheduleKind::DualPipeV | ScheduleKind::VHalf | ScheduleKind::VMin
        )
    }

    /// Whether stages run their backward as input-gradient and weight-gradient halves.
    pub fn splits_backward(self) -> bool {
        self == ScheduleKind::ZbH1 || self.v_shaped()
    }

    /// Pipeline stages for `ranks` ranks (`virtual_stages` each where the kind takes it).
    pub fn stages(self, ranks: usize, virtual_stages: usize) -> usize {
        match self {
            k if k.v_shaped() => 2 * ranks,
            ScheduleKind::Interleaved1f1b => ranks * virtual_stages,
            _ => ranks,
        }
    }

    /// The schedule to generate for `ranks` ranks and `micro_batches` micro-batches.
    pub fn spec(self, ranks: usize, virtual_stages: usize, micro_batches: usize) -> ScheduleSpec {
        let (stages, m) = (ranks, micro_batches);
        match self {
            ScheduleKind::Gpipe => ScheduleSpec::GPipe {
                stages,
                micro_batches: m,
            },
            ScheduleKind::OneFOneB => ScheduleSpec::OneFOneB {
                stages,
                micro_batches: m,
            },
            ScheduleKind::Interleaved1f1b => ScheduleSpec::Interleaved1F1B {
                ranks,
                virtual_stages,
                micro_batches: m,
            },
            ScheduleKind::ZbH1 => ScheduleSpec::ZbH1 {
                stages,
                micro_batches: m,
            },
            ScheduleKind::ZbV => ScheduleSpec::ZbV {
                ranks,
                micro_batches: m,
            },
            ScheduleKind::DualPipeV => ScheduleSpec::DualPipeV {
                ranks,
                micro_batches: m,
            },
            ScheduleKind::VHalf => ScheduleSpec::VHalf {
                ranks,
                micro_batches: m,
            },
            ScheduleKind::VMin => ScheduleSpec::VMin {
                ranks,
                micro_batches: m,
            },
        }
    }
}

/// Pipeline schedule and partition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// The schedule.
    #[serde(default)]
    pub schedule: ScheduleKind,
    /// Stages per rank (interleaved schedules).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// How to cut the model; default: balanced by FLOPs.
    #[serde(default)]
    pub partition: Option<Partition>,
    /// The nodes' measured times that `partition = { balanced = { by = "time" } }`
    /// balances (written by `pipetrain plan --save-profile`).
    #[serde(default)]
    pub profile: Option<std::path::PathBuf>,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: ScheduleKind::default(),
            virtual_stages: 1,
            partition: None,
            profile: None,
        }
    }
}

/// ONNX Runtime settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Threads per operator; default: the machine's cores shared among the stage actors.
    #[serde(default)]
    pub intra_op_threads: Option<usize>,
    /// Switch off ONNX Runtime's graph optimizations.
    #[serde(default)]
    pub disable_optimizations: bool,
    /// Keep backward graphs to standard ONNX ops (no `com.microsoft.FusedMatMul`).
    #[serde(default)]
    pub standard_ops_only: bool,
    /// Where to compute: `"cpu"` (default), `"cuda"` or `"cuda:N"`.
    #[serde(default)]
    pub device: crate::compute::Device,
    /// GPUs to spread this process's ranks over (`["cuda:0", "cuda:1"]`): rank r, in the
    /// manifest's order (`(dp x pipeline stages + stage) x tensor shards + shard`), on
    /// entry `r % len`. Empty (default): every rank on `device`. With `device` a GPU;
    /// a launched job places its ranks by its nodes' `gpus` instead.
    #[serde(default)]
    pub devices: Vec<crate::compute::Device>,
    /// Record ONNX Runtime's per-operator profile of every session: a JSON file per
    /// session in the working folder (`pipetrain_<session>_<time>.json`, ONNX Runtime's
    /// `enable_profiling`), written when the run ends.
    #[serde(default)]
    pub profile: bool,
    /// Run backward patterns that stock ONNX Runtime spreads over many small kernels
    /// (LayerNormalization's backward) as pipetrain's fused kernels (custom operators;
    /// default on; off with `standard_ops_only`).
    #[serde(default = "on")]
    pub fused_kernels: bool,
    /// On a GPU, sums in the same order every run, so that a run repeats and resumes
    /// bit for bit: ONNX Runtime's deterministic kernels, and embedding gradients as
    /// one-hot products instead of atomic scatters (default on; the CPU always is).
    #[serde(default = "on")]
    pub deterministic: bool,
    /// On a GPU, keeps each stage's parameters, gradients and optimizer state in device
    /// memory and runs the update there (default on). Stages that need them on the host
    /// keep them there: tensor shards, gradient buckets, Adasum, histograms, LAMB.
    #[serde(default = "on")]
    pub state_on_device: bool,
    /// On a GPU, pipetrain's CUDA kernels where ONNX Runtime's CUDA provider is slow or
    /// sums in no fixed order (default on): the embedding gradient as `RowsAdd`, GPT-2's
    /// tanh GELU as `TanhGelu`/`TanhGeluGrad`, softmax's backward as `SoftmaxGrad`
    /// (`compute/cuda_ops.rs`, `compute/cuda_fused.rs`). Off: standard ops only there.
    #[serde(default = "on")]
    pub cuda_kernels: bool,
    /// On a GPU with `cuda_kernels`, also those of pipetrain's CUDA kernels that have not
    /// yet run on a GPU (default off, until a lent GPU has measured them against the
    /// standard ops): scaled dot-product attention and its backward as one operator each
    /// (products on cuBLAS where the tensors lie, the softmax and its backward as one row
    /// kernel each; `compute/cuda_attention.rs`), and LayerNorm's backward as one
    /// `LayerNormGrad` (`compute/cuda_layer_norm.rs`).
    #[serde(default)]
    pub cuda_kernels_untried: bool,
    /// Fused attention keeps each query row's log-sum-exp (`[B, H, T]`) instead of its
    /// probabilities (`[B, H, T, S]`) between the forward and the backward, which
    /// computes them again: on the CPU with `fused_kernels` (a pair of batch entry and
    /// head at a time), on a GPU with `cuda_kernels_untried` (the flash kernels,
    /// `compute/kernels/flash.rs`; heads of 16, 32, 64 or 128 values, the others keep
    /// their probabilities).
    #[serde(default)]
    pub flash_attention: bool,
    /// On a GPU, ONNX Runtime captures a training session's run as a CUDA graph once and
    /// replays it each step (its CUDA provider's `enable_cuda_graph`): one launch instead
    /// of one per kernel. Every step's inputs then have one shape, and their values are
    /// copied into fixed device buffers before each replay (`compute/session/replay.rs`).
    /// For one stage and one replica with its state on the device (default off, until a
    /// lent GPU has measured it).
    #[serde(default)]
    pub cuda_graph: bool,
    /// The most memory (GB, resident) each process may use, where the machine sets no
    /// tighter cap (a cgroup's limit or `RLIMIT_AS`, which are read): a run predicted to
    /// need more is refused before it trains, saying what would fit.
    #[serde(default)]
    pub memory_limit_gb: Option<f64>,
    /// Refuse a run predicted over the memory cap (default on); off, the run warns and
    /// goes on (the prediction is within about 20% of the measured peak, either way).
    #[serde(default = "on")]
    pub refuse_over_memory_cap: bool,
    /// How a launched job's data-parallel replicas sum their gradients across nodes:
    /// the bandwidth-optimal ring (default), or a chain in replica order, bitwise one
    /// process's sum at any number of replicas (see [`AllReduce`]).
    #[serde(default)]
    pub all_reduce: AllReduce,
}

/// The algorithm of a launched job's gradient sum across nodes. In one process the
/// replicas always sum in replica order, `((g0 + g1) + g2) + ...`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AllReduce {
    /// Reduce-scatter then all-gather round a ring: `2 (n - 1) / n` of the buffer in and
    /// out of each node. Each segment's sum starts at another replica, so at three
    /// replicas or more its bits differ from one process's (two are exact: `a + b` is
    /// `b + a`).
    #[default]
    Ring,
    /// The running sum passes replica 0 -> 1 -> ... -> n - 1, each adding its own, and
    /// the total comes back down the chain, piece by piece in both directions at once:
    /// one process's sum bit for bit, for `n / (n - 1)` of the ring's bytes a node.
    Chain,
}

fn on() -> bool {
    true
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            intra_op_threads: None,
            disable_optimizations: false,
            standard_ops_only: false,
            device: Default::default(),
            devices: Vec::new(),
            profile: false,
            fused_kernels: true,
            deterministic: true,
            state_on_device: true,
            cuda_kernels: true,
            cuda_kernels_untried: false,
            flash_attention: false,
            cuda_graph: false,
            memory_limit_gb: None,
            refuse_over_memory_cap: true,
            all_reduce: AllReduce::Ring,
        }
    }
}
