//! The `pipetrain` command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pipetrain::compute::Runtime;
use pipetrain::config::{ScheduleKind, TrainConfig};
use pipetrain::telemetry::timeline_svg;
use pipetrain::train::EarlierRun;
use pipetrain::{Error, Result};
use pipetrain_schedules::{lower, simulate, CostModel, LowerOptions, StageCost};

#[derive(Parser)]
#[command(
    name = "pipetrain",
    version,
    about = "Pipeline-parallel training of ONNX models on ONNX Runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show which ONNX Runtime library pipetrain uses, its version and execution providers.
    Doctor,
    /// Train a model as a TOML configuration says (see examples/).
    Train {
        /// The configuration file.
        config: PathBuf,
        /// Write one JSON object per optimizer step to this file (JSON Lines).
        #[arg(long)]
        metrics: Option<PathBuf>,
        /// Record what every actor did to this file (JSON), for `schedule replay|draw`.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Record what every actor did as a Chrome trace (JSON) that the Perfetto UI and
        /// chrome://tracing open: a process per replica, a track per pipeline rank.
        #[arg(long)]
        chrome_trace: Option<PathBuf>,
        /// Resume from the newest complete checkpoint in `checkpoints_dir` (start from
        /// scratch when there is none); `checkpoint_to_load_path` names one explicitly.
        #[arg(long)]
        resume: bool,
        /// Start from step 0 in a `checkpoints_dir` that holds an earlier run's
        /// checkpoints, moving them aside first (without `--resume` or `--fresh`, such a
        /// folder is refused).
        #[arg(long, conflicts_with = "resume")]
        fresh: bool,
    },
    /// Say what would keep an ONNX model from training as the user's model: initializers
    /// merged by an eval-mode export, operators without a gradient, a fixed batch; with a
    /// configuration, whether its training graph builds.
    Check {
        /// The ONNX model.
        model: PathBuf,
        /// A training configuration to build the training graph with (its model is
        /// replaced by MODEL).
        config: Option<PathBuf>,
    },
    /// Train on several nodes: run this on every node of a cluster manifest, with the
    /// same manifest and configuration (see examples/cluster.toml).
    Launch(pipetrain::launch::LaunchArgs),
    /// Checkpoints: inspect one, or list a checkpoints folder.
    Checkpoint {
        #[command(subcommand)]
        command: CheckpointCommand,
    },
    /// Write a built-in model (GPT-2, SqueezeNet, MLP) as ONNX with initial weights.
    Model(pipetrain::models::ModelArgs),
    /// Data sets: synthetic ones made by pipetrain; ONNX Runtime `.pb` shards packed.
    Data {
        #[command(subcommand)]
        command: pipetrain::data::synth::DataCommand,
    },
    /// Write the inference model (ONNX) of a checkpoint.
    Export {
        /// The checkpoint folder.
        #[arg(long)]
        checkpoint: PathBuf,
        /// The model it was trained from (default: the path its manifest records).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The ONNX file to write.
        #[arg(long, short)]
        output: PathBuf,
    },
    /// Choose the layout (data x tensor x pipeline), cuts, schedule, micro-batches, recompute
    /// and ZeRO stage of a configuration from costs measured on this machine and a memory cap; print the
    /// best and write the best as a configuration.
    Plan(pipetrain::plan::PlanArgs),
    /// Pipeline schedules: print, simulate, draw, replay.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
}

#[derive(clap::Args, Clone)]
struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v, v_half or v_min.
    #[arg(long, default_value = "1f1b")]
    kind: String,
    /// Pipeline ranks.
    #[arg(long, default_value_t = 4)]
    stages: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// Stages per rank (interleaved_1f1b).
    #[arg(long, default_value_t = 2)]
    virtual_stages: usize,
    /// Forward time of one micro-batch on one rank (where a rank holds v virtual
    /// stages, each stage's forward takes 1/v of it).
    #[arg(long, default_value_t = 1.0)]
    forward: f64,
    /// Input-gradient time of a micro-batch on a rank (the backward is input + weight).
    #[arg(long, default_value_t = 1.0)]
    backward_input: f64,
    /// Weight-gradient time of a micro-batch on a rank.
    #[arg(long, default_value_t = 1.0)]
    backward_weight: f64,
    /// Time of each transfer between ranks.
    #[arg(long, default_value_t = 0.0)]
    comm: f64,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Step, layout, optimizer, data position, loss scaler, tensors and sizes of a
    /// checkpoint (loading it completely, so a damaged one is reported); given a
    /// checkpoints folder, each checkpoint in it and whether it is complete.
    Inspect {
        /// A checkpoint folder, or a `checkpoints_dir`.
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ScheduleCommand {
    /// Print each rank's actions (with sends and receives).
    Show(ScheduleArgs),
    /// Simulate under a cost model: makespan, bubble, idle and peak activations.
    Simulate(ScheduleArgs),
    /// Draw the simulated timeline as SVG (or a recorded run's with --trace).
    Draw {
        #[command(flatten)]
        args: ScheduleArgs,
        /// Draw this recorded run (`train --trace`) instead: its first step, replica 0.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// The SVG file to write.
        #[arg(long, short)]
        output: PathBuf,
    },
    /// For a training configuration's model, data, pipeline size and micro-batches:
    /// each schedule's bubble and each rank's peak activation memory (the stash kept
    /// between forward and backward), with and without recompute, from the stage
    /// graphs' value sizes; no training step runs.
    Memory {
        /// The training configuration.
        config: PathBuf,
    },
    /// Re-drive a recorded run (`train --trace`) offline with simulated stages on a
    /// virtual clock and check that every actor ran its actions in the recorded order.
    Replay {
        /// The trace file.
        trace: PathBuf,
    },
}

fn main() -> ExitCode {
    // ONNX Runtime's own warnings (target `onnxruntime`) are about its internals (an
    // unused initializer it drops): shown when RUST_LOG asks for them.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,onnxruntime=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Doctor => doctor(),
        Command::Plan(args) => pipetrain::plan::plan_command(&args),
        Command::Train {
            config,
            metrics,
            trace,
            chrome_trace,
            resume,
            fresh,
        } => match pipetrain::train::train_command(
            &config,
            metrics.as_deref(),
            (trace.as_deref(), chrome_trace.as_deref()),
            match (resume, fresh) {
                (true, _) => EarlierRun::Resume,
                (_, true) => EarlierRun::MoveAside,
                _ => EarlierRun::Refuse,
            },
        ) {
            Ok(Some(sig)) => return stopped_by(sig),
            other => other.map(|_| ()),
        },
        Command::Check { model, config } => match pipetrain::compute::Runtime::from_env()
            .and_then(|rt| pipetrain::train::check_model(&rt, &model, config.as_deref()))
        {
            Ok(report) => {
                print!("{}", report.text);
                // Errors fail the command (a user's CI can gate on it); warnings do not.
                return ExitCode::from(u8::from(report.errors > 0));
            }
            Err(e) => Err(e),
        },
        Command::Launch(args) => match pipetrain::launch::launch(&args) {
            Ok(end) => return ExitCode::from(end.status()),
            Err(e) => Err(e),
        },
        Command::Schedule { command } => schedule(command),
        Command::Checkpoint {
            command: CheckpointCommand::Inspect { dir },
        } => pipetrain::checkpoint::inspect(&dir).map(|text| print!("{text}")),
        Command::Model(args) => {
            pipetrain::models::model_command(args.command).map(|line| println!("{line}"))
        }
        Command::Data { command } => {
            pipetrain::data::synth::data_command(command).map(|line| println!("{line}"))
        }
        Command::Export {
            checkpoint,
            model,
            output,
        } => pipetrain::checkpoint::export(&checkpoint, model.as_deref(), &output)
            .map(|()| println!("wrote {}", output.display())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The status of a run stopped by a signal after saving its work: the shell's for that
/// signal (130 for SIGINT, 143 for SIGTERM).
fn stopped_by(sig: i32) -> ExitCode {
    ExitCode::from((128 + sig) as u8)
}

fn doctor() -> Result<()> {
    let rt = Runtime::from_env()?;
    let info = rt.info();
    println!("library:   {}", info.library.display());
    println!("found by:  {}", info.found_by);
    println!("version:   {}", info.version);
    println!("providers: {}", info.providers.join(", "));
    match (&info.blas, info.blas_name) {
        (Some(path), Some(name)) => println!(
            "blas:      {} ({name}{}: large float32 products on the CPU)",
            path.display(),
            info.blas_kernels
                .as_deref()
                .map(|k| format!(", {k} kernels"))
                .unwrap_or_default()
        ),
        _ => match &info.blas_declined {
            Some(why) => println!("blas:      none: {why}"),
            None => println!(
                "blas:      none (bash scripts/setup.sh installs OpenBLAS, and MKL on an Intel \
                 CPU; or set PIPETRAIN_BLAS: large float32 products run faster on it)"
            ),
        },
    }
    match pipetrain::compute::cuda_devices() {
        Ok(found) if found.names.is_empty() => {
            println!("cuda:      {} (no devices)", found.library)
        }
        Ok(found) => {
            for (i, name) in found.names.iter().enumerate() {
                println!("cuda:{i}:    {name} ({})", found.library);
            }
            gpu_checks(info.providers.iter().any(|p| p == "CUDAExecutionProvider"));
        }
        Err(why) => println!("cuda:      {why}"),
    }
    Ok(())
}

/// What `doctor` says of the GPU path on a machine with a GPU: whether this build has it,
/// whether the library has ONNX Runtime's CUDA provider, whether NCCL reduces, and
/// whether cuBLAS loads (`runtime.cuda_kernels_untried`'s attention needs it), and what
/// the flash attention kernels take on the device (registers, spills, blocks an SM holds).
fn gpu_checks(provider: bool) {
    if !cfg!(feature = "cuda") {
        println!("gpu path:  not in this build (build with `--features cuda`)");
        return;
    }
    println!(
        "provider:  {}",
        if provider {
            "CUDAExecutionProvider offered by the library"
        } else {
            "this library has no CUDAExecutionProvider: use onnxruntime-gpu's (`scripts/setup.sh --cuda`, or ORT_DYLIB_PATH)"
        }
    );
    #[cfg(feature = "cuda")]
    {
        match pipetrain::compute::cuda::nccl_self_check(0) {
            Ok(()) => println!("nccl:      one-rank all-reduce on cuda:0 ok"),
            Err(why) => println!("nccl:      {why}"),
        }
        println!("cublas:    {}", pipetrain::compute::cuda::cublas_found());
        match pipetrain::compute::cuda::flash_kernels(0) {
            Ok(use_) => println!("flash:     {use_}"),
            Err(why) => println!("flash:     {why}"),
        }
    }
}

fn schedule_error(e: impl std::fmt::Display) -> Error {
    Error::Config {
        path: "<command line>".into(),
        field: "schedule".into(),
        rule: e.to_string(),
    }
}

fn build_schedule(a: &ScheduleArgs) -> Result<pipetrain_schedules::Schedule> {
    let (p, m) = (a.stages, a.micro_batches);
    let kind = ScheduleKind::from_name(&a.kind).ok_or_else(|| {
        let names: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
        schedule_error(format!("unknown kind `{}` ({})", a.kind, names.join(", ")))
    })?;
    let spec = kind.spec(p, a.virtual_stages, m);
    let compute = spec.generate().map_err(schedule_error)?;
    lower(
        &compute,
        LowerOptions {
            all_reduce: true,
            optimizer_step: true,
        },
    )
    .map_err(schedule_error)
}

/// How to read `schedule show`: an action is its stage, its kind and its micro-batch;
/// the kinds this schedule uses, in words.
fn legend(s: &pipetrain_schedules::Schedule) -> String {
    let mut used: Vec<pipetrain_schedules::ActionKind> = Vec::new();
    for a in s.ranks().iter().flatten() {
        if !used.contains(&a.kind()) {
            used.push(a.kind());
        }
    }
    used.sort_by_key(|k| {
        pipetrain_schedules::ActionKind::ALL
            .iter()
            .position(|x| x == k)
    });
    let mut text = String::from(
        "# each action is STAGE KIND MICRO-BATCH: `1F3` is stage 1's forward of micro-batch 3\n",
    );
    for k in used {
        text.push_str(&format!("#   {:<9} {}\n", k.token(), k.meaning()));
    }
    text
}

/// The simulated timeline of `a`'s schedule. The costs are a rank's: where a rank holds
/// several (virtual) stages, each stage's forward and backward cost their share.
fn timeline(a: &ScheduleArgs) -> Result<pipetrain_schedules::Timeline> {
    let s = build_schedule(a)?;
    let per_rank = (s.stages() / s.ranks().len().max(1)).max(1) as f64;
    let mut costs = CostModel::uniform(
        s.stages(),
        StageCost::split(
            a.forward / per_rank,
            a.backward_input / per_rank,
            a.backward_weight / per_rank,
        ),
    );
    costs.comm_latency = a.comm;
    simulate(&s, &costs).map_err(schedule_error)
}

fn schedule(cmd: ScheduleCommand) -> Result<()> {
    match cmd {
        ScheduleCommand::Show(a) => {
            let s = build_schedule(&a)?;
            print!("{}", legend(&s));
            for (rank, actions) in s.ranks().iter().enumerate() {
                let text: Vec<String> = actions.iter().map(ToString::to_string).collect();
                println!("rank {rank}: {}", text.join(" "));
            }
        }
        ScheduleCommand::Simulate(a) => {
            let t = timeline(&a)?;
            println!("makespan         {:.3}", t.makespan());
            println!("bubble fraction  {:.4}", t.bubble_fraction());
            for (rank, idle) in t.idle().iter().enumerate() {
                println!("rank {rank} idle      {idle:.3}");
            }
            let peaks: Vec<String> = t.peak_in_flight().iter().map(ToString::to_string).collect();
            println!("peak in-flight activations per stage: {}", peaks.join(" "));
        }
        ScheduleCommand::Draw {
            args,
            trace,
            output,
        } => {
            let (t, title) =
                match trace {
                    Some(path) => {
                        let run = read_trace(&path)?;
                        let first = run.steps.first().and_then(|r| r.first()).ok_or_else(|| {
                            Error::Data {
                                path: path.clone(),
                                what: "trace".into(),
                                reason: "no step recorded".into(),
                            }
                        })?;
                        let t = first
                            .to_timeline(run.schedule.stages())
                            .map_err(schedule_error)?;
                        (t, format!("recorded run: {}", path.display()))
                    }
                    None => (
                        timeline(&args)?,
                        format!(
                            "{} p={} m={} (simulated)",
                            args.kind, args.stages, args.micro_batches
                        ),
                    ),
                };
            pipetrain::onnx::save_bytes(&output, timeline_svg(&t, &title).as_bytes())?;
            println!("wrote {}", output.display());
        }
        ScheduleCommand::Memory { config } => {
            let cfg = TrainConfig::load(&config)?;
            let rt = pipetrain::compute::Runtime::from_env()?;
            let rows = pipetrain::train::memory_table(&rt, &cfg, &config)?;
            print!("{}", pipetrain::train::memory_report(&cfg, &rows));
        }
        ScheduleCommand::Replay { trace } => {
            let run = read_trace(&trace)?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .map_err(Error::io(&trace))?;
            let (_, divergence) = rt
                .block_on(pipetrain_actors::replay(&run))
                .map_err(Error::runtime)?;
            match divergence {
                None => println!(
                    "replayed {} step(s) x {} replica(s): every actor ran its actions in the recorded order",
                    run.steps.len(),
                    run.replicas
                ),
                Some(d) => {
                    return Err(Error::Data {
                        path: trace,
                        what: "replay".into(),
                        reason: format!("{d:?}"),
                    })
                }
            }
        }
    }
    Ok(())
}

fn read_trace(path: &Path) -> Result<pipetrain_actors::RunTrace> {
    let text = std::fs::read(path).map_err(Error::io(path))?;
    serde_json::from_slice(&text).map_err(|e| Error::Data {
        path: path.to_path_buf(),
        what: "trace".into(),
        reason: e.to_string(),
    })
}
