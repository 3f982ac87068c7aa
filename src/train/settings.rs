//! The settings a run derives from its configuration: the stages' shared settings, the
//! loss scaler's starting state, ONNX Runtime's threads, and how long actors poll.

use std::time::Duration;

use pipetrain_actors::{LossScaling, ScalerState};

use crate::checkpoint::{slow_write, LoadedCheckpoint};
use crate::compute::{intra_threads_for, Runtime, SessionOptions};
use crate::config::TrainConfig;
use crate::data::StepBatches;
use crate::graph::{build_sharded_training_graph, TrainOptions, TrainingGraph};
use crate::onnx::proto::ModelProto;
use crate::pipeline::{AdasumSlot, HistogramTap, StageSettings, ZeroSlot};
use crate::tensor::Tensor;
use crate::Result;

/// The loss scaler's state at the first step: a resumed dynamic scaler's, else the
/// configuration's.
pub(super) fn starting_scaler(cfg: &TrainConfig, resume: Option<&LoadedCheckpoint>) -> ScalerState {
    let scaling = cfg.grad_policy().scaling;
    match (scaling, resume) {
        (LossScaling::Dynamic(_), Some(c)) if c.manifest.loss_scaler.mode == "dynamic" => {
            c.manifest.loss_scaler.state
        }
        _ => scaling.initial_state(),
    }
}

/// What every stage of `cfg`'s run shares.
pub(super) fn stage_settings(cfg: &TrainConfig, loss_scale: f64) -> StageSettings {
    let (d, m) = (cfg.data_parallel_size, cfg.gradient_accumulation_steps);
    StageSettings {
        split_backward: cfg.split_backward(),
        loss_scale,
        normalize: cfg.loss.normalize(),
        slow_save: slow_write(cfg.debug.checkpoint_write_delay_ms),
        // Buckets only pay with replicas to reduce among; Adasum combines whole
        // gradients (its coefficients are per tensor); a sharded optimizer state has
        // each replica's part reduce-scattered after the backward (sharded gradients,
        // ZeRO stage 2, go in buckets again).
        bucket_bytes: match (d, cfg.enable_adasum || cfg.deepspeed_zero_stage == 1) {
            (1, _) | (_, true) => 0,
            _ => (cfg.gradient_bucket_mb * (1 << 20) as f64) as usize,
        },
        micro_batches: m,
        param_groups: cfg.optimizer_attributes.clone(),
        ..StageSettings::new(cfg.optimizer.clone(), 1.0 / (m * d) as f64)
    }
}

/// How long stage actors poll for messages before parking: 2 ms when each of this
/// process's `actors` has a core of its own (mlp at pp = 2 hands over every 0.2-0.4 ms),
/// none when they share cores.
pub(super) fn stage_spin(actors: usize) -> Duration {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    if actors > 1 && actors <= cores {
        Duration::from_millis(2)
    } else {
        Duration::ZERO
    }
}

/// Intra-op threads of each session: `runtime.intra_op_threads` where set; else the
/// machine's cores shared among this process's `actors`, but one where the step's kernels
/// are too small to share ([`intra_threads_for`]).
pub(super) fn intra_op_threads(cfg: &TrainConfig, actors: usize, flops_per_node: f64) -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    match cfg.runtime.intra_op_threads {
        Some(n) => n,
        None => intra_threads_for(flops_per_node, cores / actors),
    }
}

/// ONNX Runtime session settings: `threads` intra-op threads (see [`intra_op_threads`])
/// for each of this process's `actors` (stage actors).
pub(super) fn session_options(cfg: &TrainConfig, actors: usize, threads: usize) -> SessionOptions {
    SessionOptions {
        intra_threads: threads,
        inter_threads: 1,
        optimize: !cfg.runtime.disable_optimizations,
        // One actor alone runs one training session (the fused forward + backward of a
        // single stage), and its threads spinning between kernels saves a wake-up each
        // (tiny_gpt +20% steps/s). With several sessions per stage (forward, backward) or
        // several actors, threads of an idle session spinning would steal the cores of
        // the busy one.
        spin: actors == 1 && cfg.stages() == 1 && !cfg.split_backward(),
        profile: cfg.runtime.profile,
        device: cfg.runtime.device,
        deterministic: cfg.runtime.deterministic,
        mixed_precision: cfg.half(),
        state_on_device: cfg.runtime.state_on_device,
        device_path_on_host: cfg.debug.device_path_on_host,
        cuda_kernels: cfg.runtime.cuda_kernels && !cfg.runtime.standard_ops_only,
        cuda_graph: cfg.runtime.cuda_graph,
    }
}

/// The training graph of `model` as `cfg` asks, its shapes measured on the first
/// micro-batch of `replica` in `step` (`batches` splits each step into replicas x
/// micro-batches).
pub(crate) fn training_graph(
    rt: &Runtime,
    cfg: &TrainConfig,
    model: &ModelProto,
    batches: &dyn StepBatches,
    step: usize,
    replica: usize,
) -> Result<TrainingGraph> {
    let m = cfg.gradient_accumulation_steps;
    let first = batches.part(step, replica * m, cfg.data_parallel_size * m)?;
    let example: Vec<(&str, &Tensor)> = first.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let opts = TrainOptions {
        inputs: cfg.inputs.clone(),
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: !cfg.runtime.standard_ops_only,
        // The fused kernels are CPU code: a graph on a GPU keeps the standard ops, but
        fused_kernels: cfg.runtime.fused_kernels
            && !cfg.runtime.standard_ops_only
            && cfg.runtime.device == crate::compute::Device::Cpu,
        // On a GPU, those of pipetrain's kernels written for it (`compute/cuda_fused.rs`).
        cuda_kernels: cfg!(feature = "cuda")
            && cfg.runtime.cuda_kernels
            && !cfg.runtime.standard_ops_only
            && cfg.runtime.device != crate::compute::Device::Cpu,
        // With them, those not yet run on a GPU, where asked (attention, LayerNormGrad).
        cuda_kernels_untried: cfg!(feature = "cuda")
            && cfg.runtime.cuda_kernels_untried
            && cfg.runtime.cuda_kernels
            && !cfg.runtime.standard_ops_only
            && cfg.runtime.device != crate::compute::Device::Cpu,
        flash_attention: cfg.runtime.flash_attention,
        params: cfg.params.clone(),
    };
    let mut tg =
        build_sharded_training_graph(rt, model, &opts, &example, cfg.horizontal_parallel_size)?;
    // On a GPU in a fixed order, row sums as products (ONNX Runtime's deterministic
    // reductions are cuDNN's, slow there: `graph/row_sums.rs`).
    let gpu = cfg.runtime.device != crate::compute::Device::Cpu;
    if gpu && cfg.runtime.deterministic && tg.shards.is_none() {
        let n = crate::graph::row_sums_as_products(&mut tg);
        tracing::debug!("{n} row sums and means written as products for the GPU");
    }
    // On the CPU, embedding gradients into tables the kernel zeroes, where ONNX Runtime
    // would keep a folded table of zeros to copy (`compute/fused/rows_add.rs`).
    if opts.fused_kernels {
        let n = crate::graph::scatter_adds_as_rows_add(&mut tg.graph);
        tracing::debug!("{n} embedding gradients as RowsAdd");
    }
    // Training-mode dropouts whose masks are drawn from the step and the micro-batch, so
    // that a run repeats and resumes bit for bit (`graph::keyed_dropout`): on the CPU with
    // pipetrain's kernels, on a GPU with its CUDA kernels (the same draw there).
    if opts.fused_kernels || opts.cuda_kernels {
        let n = crate::graph::key_dropouts(&mut tg);
        if n > 0 {
            tracing::debug!("{n} dropouts drawn from the step's key");
        }
    }
    // On the CPU, float32 products by OpenBLAS where the process has it (faster than
    // ONNX Runtime's MLAS at real sizes: `compute/blas`); mixed precision casts the
    // standard products instead.
    if let Some(blas) = rt
        .blas()
        .filter(|_| opts.fused_kernels && cfg.half().is_none())
    {
        let n = crate::graph::blas_products(&mut tg.graph, &tg.metas, blas.smallest_products());
        if n > 0 {
            let kernels = blas.kernels().map(|k| format!(" ({k} kernels)"));
            tracing::info!(
                "{n} float32 products by {}{}",
                blas.name(),
                kernels.unwrap_or_default()
            );
            if !blas.cut_keeps_bits() {
                tracing::info!(
                    "{} here changes a row's bits with the rows computed beside it: each \
                     product is cut into one block per core, whatever the threads",
                    blas.name()
                );
            }
        }
    }
    Ok(tg)
}

/// Logs what `pipetrain check` would say of the model before it trains: initializers an
/// eval-mode export merged. (A fixed batch that does not fit the micro-batch is an error
/// of its own once shapes are measured, and one that fits needs no word.)
pub(super) fn warn_about_model(cfg: &TrainConfig, model: &ModelProto) -> Result<()> {
    let mut findings = crate::graph::check::inspect(&crate::graph::Graph::from_model(model)?);
    findings.fixed_batch.clear();
    for warning in findings.warnings() {
        tracing::warn!("{}: {warning}", cfg.model_name());
    }
    Ok(())
}

/// The settings of engine replica `replica`'s stage `s`, from those every stage shares
/// (all but its tensor shard's link).
pub(super) fn replica_settings(
    cfg: &TrainConfig,
    shared: &StageSettings,
    (replica, s): (usize, usize),
    tap: Option<&HistogramTap>,
) -> StageSettings {
    // The data-parallel replica this engine replica is a tensor shard of.
    let dp = replica / cfg.horizontal_parallel_size.max(1);
    let mut st = shared.clone();
    // Data-parallel replica 0's shards that send (engine replica = dp x hp + shard).
    if replica < tap.map_or(0, |t| t.shards.max(1)) {
        st.histograms = tap.cloned();
    }
    st.adasum = cfg.enable_adasum.then_some(AdasumSlot {
        replica,
        replicas: cfg.data_parallel_size,
    });
    st.zero = cfg.shards_optimizer_state().then_some(ZeroSlot {
        rank: dp,
        ranks: cfg.data_parallel_size,
        gradients: cfg.shards_gradients(),
    });
    // The test aids name a data-parallel replica: every tensor shard of it.
    st.overflow_at = cfg
        .debug
        .inject_grad_overflow
        .iter()
        .filter(|f| f.stage == s && f.replica == dp)
        .map(|f| f.step - 1)
        .collect();
    st.stall = cfg
        .debug
        .stall
        .filter(|f| f.stage == s && f.replica == dp)
        .map(|f| (f.step - 1, Duration::from_secs(f.seconds)));
    st
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A configuration of the built-in MLP, `top` among its top-level keys and `tail`
    /// (tables) after the rest.
    pub(in crate::train) fn parse(top: &str, tail: &str) -> Result<TrainConfig> {
        let text = format!(
            "batch_size = 4\nnum_train_steps = 1\n{top}[model]\nkind = \"mlp\"\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
             [data]\nsynth = {{ kind = \"teacher\", samples = 8 }}\n\
             layout = {{ kind = \"arrays\", feeds = {{ x = \"x\", y = \"y\" }} }}\n\
             [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.1\n{tail}"
        );
        TrainConfig::parse(&text, std::path::Path::new("t.toml"))
    }

    fn config(runtime: &str) -> TrainConfig {
        parse("", runtime).unwrap()
    }

    #[test]
    fn small_kernels_run_on_one_thread_large_ones_share_the_cores() {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let auto = config("");
        assert_eq!(intra_op_threads(&auto, 1, 0.05e6), 1);
        assert_eq!(intra_op_threads(&auto, 1, 7.5e6), cores);
        assert_eq!(intra_op_threads(&auto, 2, 7.5e6), (cores / 2).max(1));
        // What the configuration sets wins either way.
        let set = config("[runtime]\nintra_op_threads = 3\n");
        assert_eq!(intra_op_threads(&set, 1, 0.05e6), 3);
        assert_eq!(intra_op_threads(&set, 4, 7.5e6), 3);
    }

    /// `debug.nccl_one_rank` is refused, naming the field, on the CPU, with the state on
    /// the host, and with more than one data-parallel replica.
    #[test]
    fn one_rank_nccl_is_refused_where_it_cannot_run() {
        let parse = |runtime: &str, dp: usize| {
            let top = format!("data_parallel_size = {dp}\n");
            let tail = format!("[debug]\nnccl_one_rank = true\n[runtime]\n{runtime}");
            parse(&top, &tail).map(|_| ()).map_err(|e| e.to_string())
        };
        let cpu = parse("", 1).unwrap_err();
        assert!(
            cpu.contains("debug.nccl_one_rank") && cpu.contains("runtime.device"),
            "{cpu}"
        );
        let host = parse("device = \"cuda\"\nstate_on_device = false\n", 1).unwrap_err();
        assert!(host.contains("state_on_device"), "{host}");
        let two = parse("device = \"cuda\"\n", 2).unwrap_err();
        assert!(two.contains("not 2"), "{two}");
        assert!(parse("device = \"cuda\"\n", 1).is_ok());
    }

    /// `debug.device_path_on_host` is refused, naming the field, on a GPU and with the
    /// state on the host; on the CPU it takes the device path.
    #[test]
    fn the_device_path_on_the_host_is_refused_where_it_means_nothing() {
        let parse = |runtime: &str| {
            let tail = format!("[debug]\ndevice_path_on_host = true\n[runtime]\n{runtime}");
            parse("", &tail).map_err(|e| e.to_string())
        };
        let gpu = parse("device = \"cuda\"\n").unwrap_err();
        assert!(
            gpu.contains("debug.device_path_on_host") && gpu.contains("for the CPU"),
            "{gpu}"
        );
        let host = parse("state_on_device = false\n").unwrap_err();
        assert!(host.contains("state_on_device"), "{host}");
        let cfg = parse("").unwrap();
        let opts = session_options(&cfg, 1, 1);
        assert!(opts.device_path_on_host);
        let settings = stage_settings(&cfg, 1.0);
        assert!(crate::pipeline::state_fits_device(&opts, &settings));
        let plain = session_options(&config(""), 1, 1);
        assert!(!crate::pipeline::state_fits_device(&plain, &settings));
    }

    /// `runtime.cuda_graph` is refused, naming the field and the rule, on the CPU (but
    /// over the device path there), with the state on the host, and beyond one stage and
    /// one replica; allowed, the stage's sessions are opened to record a graph.
    #[test]
    fn a_cuda_graph_is_refused_where_it_cannot_replay() {
        let parse = |top: &str, runtime: &str| {
            let tail = format!("[runtime]\ncuda_graph = true\n{runtime}");
            parse(top, &tail).map_err(|e| e.to_string())
        };
        let cpu = parse("", "").unwrap_err();
        assert!(
            cpu.contains("runtime.cuda_graph") && cpu.contains("needs a GPU"),
            "{cpu}"
        );
        let host = parse("", "device = \"cuda\"\nstate_on_device = false\n").unwrap_err();
        assert!(host.contains("state_on_device"), "{host}");
        let two = parse("data_parallel_size = 2\n", "device = \"cuda\"\n").unwrap_err();
        assert!(two.contains("1 stages x 2 replicas"), "{two}");
        assert!(parse("", "device = \"cuda\"\n").is_ok());
        let on_host = parse("", "[debug]\ndevice_path_on_host = true\n").unwrap();
        assert!(session_options(&on_host, 1, 1).cuda_graph);
    }
}
