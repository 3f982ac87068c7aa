//! Opening an ONNX Runtime session for a model: its execution providers (the CPU's, and
//! the CUDA provider on a stream of the session's own), threads, profiling and
//! pipetrain's custom operators.

use ort::session::{builder::GraphOptimizationLevel, Session};
use prost::Message;

use super::shard_ops::{custom_domain, ShardLink};
use crate::compute::{Device, Runtime};
use crate::graph::custom_ops::DOMAIN;
use crate::onnx::proto::ModelProto;
use crate::{Error, Result};

/// How sessions are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    /// Threads inside one operator (ONNX Runtime's intra-op pool).
    pub intra_threads: usize,
    /// Threads across independent operators (1 = sequential execution).
    pub inter_threads: usize,
    /// Run ONNX Runtime's graph optimizations (fusions, constant folding).
    pub optimize: bool,
    /// Let idle intra-op threads spin waiting for work (faster for one session alone,
    /// slower when several sessions share the cores).
    pub spin: bool,
    /// Record ONNX Runtime's per-operator profile (a JSON file in the current folder,
    /// named after the session; see [`super::GraphSession::end_profiling`]).
    pub profile: bool,
    /// Where the graph computes: ONNX Runtime's CPU provider, or its CUDA provider on a
    /// stream of the session's own (builds with `--features cuda`), the CPU provider
    /// taking the nodes it has no CUDA kernel for.
    pub device: Device,
    /// On a GPU: sum in the same order every run (ONNX Runtime's deterministic kernels,
    /// embedding gradients as one-hot products). The CPU's kernels always do.
    pub deterministic: bool,
    /// Matrix products in this half type, the rest in float32 (`graph::autocast`);
    /// `None`: all float32.
    pub mixed_precision: Option<crate::graph::autocast::Half>,
    /// On a GPU: keep a stage's parameters, gradients and optimizer state in device
    /// memory and update there (`compute/resident.rs`), where the stage allows it.
    pub state_on_device: bool,
    /// On the CPU: take the device path all the same, over host memory
    /// (`compute/host_state.rs`; `debug.device_path_on_host`), to test it without a GPU.
    pub device_path_on_host: bool,
    /// On a GPU: pipetrain's CUDA kernels where ONNX Runtime's CUDA provider is slow or
    /// sums in no fixed order (`compute/cuda_ops.rs`: the embedding gradient); off, the
    /// graphs keep standard ops (the embedding gradient as a one-hot product).
    pub cuda_kernels: bool,
    /// On a GPU: ONNX Runtime captures the session's run as a CUDA graph and replays it
    /// (`compute/session/replay.rs`); with `device_path_on_host`, the same fixed inputs
    /// and outputs over host memory, without a graph.
    pub cuda_graph: bool,
}

/// Below this many floating-point operations per node of a training step (about, see
/// [`crate::graph::flops_per_node`]), a kernel split across ONNX Runtime's intra-op
/// threads loses more to the hand-over than it gains. Measured on a 2-core VM with the
/// built-in GPT-2 at widths 32-128 and batches 4-16 (one thread against two, alternating
/// runs): one thread 1.3x faster at 0.1 MFLOP a node and 1.05x at 0.37, two threads
/// 1.07x faster at 0.40, 1.06x at 0.75 and 1.5x at 7.5 (the peers' tiny GPT); the
/// exported fixtures (BERT, ViT, GPT-2, Llama, BART, ConvNeXt, 0.02-0.10) 1.2-1.7x
/// faster with one. The threshold sits where the two cross.
const THREADED_MIN_FLOPS_PER_NODE: f64 = 0.4e6;

/// Intra-op threads for a training session whose step does `flops_per_node`: `cores`,
/// or one where its kernels are too small to share.
pub fn intra_threads_for(flops_per_node: f64, cores: usize) -> usize {
    match flops_per_node < THREADED_MIN_FLOPS_PER_NODE {
        true => 1,
        false => cores.max(1),
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            intra_threads: 2,
            inter_threads: 1,
            optimize: true,
            spin: true,
            profile: false,
            device: Device::Cpu,
            deterministic: true,
            mixed_precision: None,
            state_on_device: true,
            device_path_on_host: false,
            cuda_kernels: true,
            cuda_graph: false,
        }
    }
}

/// How one session differs from the usual: its memory arena, the shard link its
/// collectives sum through, a profile file of its own.
pub(super) struct Extras<'a> {
    /// Keep an arena (off for one-off runs, whose memory should go back at once).
    pub arena: bool,
    /// Where a tensor shard's collectives sum (a group of one without it).
    pub link: Option<&'a ShardLink>,
    /// Record ONNX Runtime's profile to `<profile_to>_<time>.json`.
    pub profile_to: Option<&'a std::path::Path>,
}

impl Extras<'_> {
    /// A session that keeps an arena, alone in its shard group, profiled only as its
    /// options say.
    pub const USUAL: Extras<'static> = Extras {
        arena: true,
        link: None,
        profile_to: None,
    };
}

/// Creates the ONNX Runtime session for `model` (`label` names it in errors), with the
/// stream it computes on when on a GPU (to be dropped after the session).
///
/// # Errors
/// `Ort` when ONNX Runtime rejects the model; `Device` when the GPU asked for cannot be had.
pub(super) fn open(
    rt: &Runtime,
    model: &ModelProto,
    opts: &SessionOptions,
    label: &str,
    extras: Extras<'_>,
) -> Result<(Session, OwnStream)> {
    let custom = model.opset_import.iter().any(|o| o.domain == DOMAIN);
    let bytes = model.encode_to_vec();
    let ctx = || format!("creating the session for {label}");
    let level = if opts.optimize {
        GraphOptimizationLevel::All
    } else {
        GraphOptimizationLevel::Disable
    };
    let (gpu, stream) = gpu_provider(opts.device, opts.cuda_graph)?;
    let session = Session::builder(rt.env())
        .and_then(|b| {
            let cpu = ort::ep::CPU::default()
                .with_arena_allocator(extras.arena)
                .build();
            let providers: Vec<_> = gpu.into_iter().chain([cpu]).collect();
            b.with_execution_providers(providers).map_err(Into::into)
        })
        .and_then(|b| b.with_optimization_level(level).map_err(Into::into))
        // The process's shared CPU arena, which grows by what is asked for
        // (`compute::arena`), where the session keeps an arena at all; without ONNX
        // Runtime's memory pattern, which asks the arena for a run's whole plan as one
        // more block after the first run has grown it tensor by tensor (GPT-2 small,
        // 4 x 128: peak resident memory 4.08 GB with it, 3.22 GB without).
        .and_then(|b| match extras.arena && opts.device == Device::Cpu {
            true => b
                .with_config_entry("session.use_env_allocators", "1")
                .map_err(Into::into)
                .and_then(|b| b.with_memory_pattern(false).map_err(Into::into)),
            false => Ok(b),
        })
        // Exact resume on a GPU asks for the same sums every run: ONNX Runtime's
        // deterministic kernels where it has them (the CPU's are already).
        .and_then(|b| {
            b.with_deterministic_compute(opts.device != Device::Cpu && opts.deterministic)
                .map_err(Into::into)
        })
        .and_then(|b| b.with_intra_threads(opts.intra_threads).map_err(Into::into))
        .and_then(|b| b.with_inter_threads(opts.inter_threads).map_err(Into::into))
        .and_then(|b| {
            b.with_parallel_execution(opts.inter_threads > 1)
                .map_err(Into::into)
        })
        .and_then(|b| {
            // Idle intra-op threads spin for work by default; with several sessions
            // on few cores (pipeline stages), spinning threads of an idle session
            // steal the cores a busy one needs.
            b.with_config_entry(
                "session.intra_op.allow_spinning",
                if opts.spin { "1" } else { "0" },
            )
            .map_err(Into::into)
        })
        .and_then(|b| {
            // Spinning between a run's kernels, not after the run: between runs the
            // optimizer step and the engine's own threads (scheduler, coordinator,
            // data) need the cores. A thread still spinning there left them one core,
            // where they took the stage's thread off its core for whole time slices
            // (the peers' mlp: 99th percentile of a step 2.8-4.5 -> 1.7-1.8 ms, mean
            // 1.51-1.62 -> 1.47-1.50 ms; waking the thread at a run's start costs
            // 25-90 us of that).
            b.with_config_entry(
                "session.force_spinning_stop",
                if opts.spin { "1" } else { "0" },
            )
            .map_err(Into::into)
        })
        .and_then(|b| match extras.profile_to {
            Some(to) => b.with_profiling(to).map_err(Into::into),
            None if opts.profile => {
                let name: String = label
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .collect();
                b.with_profiling(format!("pipetrain_{name}"))
                    .map_err(Into::into)
            }
            None => Ok(b),
        })
        .and_then(|b| match custom {
            true => {
                let alone = ShardLink::alone();
                let blas = rt.blas().map(|b| (b, opts.intra_threads));
                let domain = custom_domain(extras.link.unwrap_or(&alone), blas)?;
                b.with_operators(domain).map_err(Into::into)
            }
            false => Ok(b),
        })
        .and_then(|mut b| {
            let first = first_with_custom_domain(custom);
            let session = b.commit_from_memory(&bytes);
            if let (Some(mut known), Ok(_)) = (first, &session) {
                *known = true;
            }
            session
        })
        .map_err(Error::ort(ctx()))?;
    Ok((session, stream))
}

/// Whether a session with pipetrain's operator domain has been created in this process.
static CUSTOM_DOMAIN_KNOWN: std::sync::Mutex<bool> = std::sync::Mutex::new(false);

/// The stream a session on a GPU owns (nothing in a build without CUDA).
#[cfg(feature = "cuda")]
pub(super) type OwnStream = Option<super::cuda::DeviceStream>;
#[cfg(not(feature = "cuda"))]
pub(super) type OwnStream = ();

/// ONNX Runtime's CUDA provider for a session on `device` (none for the CPU), computing on
/// a new stream that the session keeps, capturing its run as a CUDA graph with
/// `cuda_graph`. TF32 stays off: float32 products as the CPU's.
fn gpu_provider(
    device: Device,
    cuda_graph: bool,
) -> Result<(Option<ort::ep::ExecutionProviderDispatch>, OwnStream)> {
    let Device::Cuda(index) = device else {
        return Ok((None, OwnStream::default()));
    };
    #[cfg(feature = "cuda")]
    {
        let stream = super::cuda::DeviceStream::new(index).map_err(|reason| Error::Device {
            device: device.to_string(),
            reason,
        })?;
        let cuda = ort::ep::CUDA::default()
            .with_device_id(index as i32)
            .with_tf32(false)
            .with_cuda_graph(cuda_graph);
        // SAFETY: the stream outlives the session: both belong to the `GraphSession`,
        // which declares (so drops) its ONNX Runtime session first.
        let cuda = unsafe { cuda.with_compute_stream(stream.raw()) };
        Ok((Some(cuda.build().error_on_failure()), Some(stream)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (index, cuda_graph);
        Err(Error::Device {
            device: device.to_string(),
            reason: "this build has no CUDA path; build pipetrain with `--features cuda`".into(),
        })
    }
}

/// ONNX Runtime enters a custom operator domain into a process-wide table when the first
/// session using it is created, checking and inserting without a lock: two sessions
/// created at once can both insert, and one fails ("the domain is already exist"). Until
/// one has been created, sessions with pipetrain's domain are created one at a time
/// (the guard, held over the creation); after that, concurrently (`None`).
fn first_with_custom_domain(custom: bool) -> Option<std::sync::MutexGuard<'static, bool>> {
    if !custom {
        return None;
    }
    let known = CUSTOM_DOMAIN_KNOWN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    (!*known).then_some(known)
}
