//! `pipetrain plan CONFIG`: profile, search, print the best layouts, write the best, and
//! where asked run the top ones and the default layout for real beside their prediction.

use std::path::PathBuf;

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::Result;

use super::{plan, report, write_config, PlanOptions};

/// The command's arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// The training configuration (its model, data, global batch and optimizer).
    pub config: PathBuf,
    /// Workers to lay out: stage actors of one process (default: this machine's cores).
    #[arg(long, conflicts_with = "manifest")]
    pub devices: Option<usize>,
    /// Lay the workers out over this cluster manifest's nodes instead (its slots, one
    /// `pipetrain launch` process a node); the plan is written with the manifest beside
    /// it (`NAME.cluster.toml`) holding the chosen layout.
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// The latency between two nodes, microseconds (with `--link-gbps`); default: the
    /// link measured between two processes on this machine's loopback.
    #[arg(long, requires = "manifest", requires = "link_gbps")]
    pub link_latency_us: Option<f64>,
    /// The bandwidth between two nodes, gigabits per second (with `--link-latency-us`).
    #[arg(long, requires = "link_latency_us")]
    pub link_gbps: Option<f64>,
    /// Each worker's memory, GiB: layouts predicted to need more on a rank (its state,
    /// constants and activations) are dropped.
    #[arg(long)]
    pub memory_per_device: Option<f64>,
    /// Each process's memory, GiB: layouts whose process (its ranks, and ONNX Runtime,
    /// the libraries and the training graph beside them) is predicted to need more are
    /// dropped [default: the cap `train` refuses a run over: `runtime.memory_limit_gb`
    /// or this machine's cgroup limit].
    #[arg(long)]
    pub memory_per_process: Option<f64>,
    /// The most micro-batches per step to try.
    #[arg(long, default_value_t = 8)]
    pub max_micro_batches: usize,
    /// How many of the best layouts to print.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Write the best layout here as a configuration `train` accepts as it is.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write the table's layout of this rank instead of the best (`--out`): one that
    /// holds less memory, or to run a rival by hand [default: 1; with `--measure`, the
    /// fastest measured].
    #[arg(long, requires = "out", value_parser = clap::value_parser!(u64).range(1..))]
    pub pick: Option<u64>,
    /// Also run this many of the best layouts, and the default one, for real and print
    /// each one's measured step beside its prediction; then the fastest of each
    /// (dp, tp, pp) layout not among them. `--out` then writes the fastest measured
    /// of those that fit the memory cap, the default and the cut rivals included (the
    /// way an autotuner's trial runs settle it), unless
    /// `--pick` names a rank.
    #[arg(long, default_value_t = 0)]
    pub measure: usize,
    /// Steps of each measured run, at least (the first two not counted); more where
    /// these take under a second.
    #[arg(long, default_value_t = 12)]
    pub measure_steps: usize,
    /// Measure each run this many times, the runs taken in turn each round (so the
    /// machine's drift lands on all of them): each one's median, and its spread.
    #[arg(long, default_value_t = 1)]
    pub measure_rounds: usize,
    /// Steps of each profile run, at least (the first two not counted); its timed runs
    /// take more where these take under a second.
    #[arg(long, default_value_t = 8)]
    pub profile_steps: usize,
    /// Rounds of the profile's timed runs, the sizes in turn each round, each size the
    /// median of its rounds: steadier on a shared machine, and R times as long.
    #[arg(long, default_value_t = 1)]
    pub profile_rounds: usize,
    /// Keep what profiling measures in this file and plan from it again: read where it
    /// was measured for this configuration (the same files), workers, threads and
    /// profile settings, else measured and written (profiling is most of a plan's time).
    #[arg(long)]
    pub profile_cache: Option<PathBuf>,
    /// Write each forward node's measured time here (JSON), for a configuration's
    /// `partition = { balanced = { stages = N, by = "time" } }` with `pipeline.profile`.
    #[arg(long)]
    pub save_profile: Option<PathBuf>,
}

/// Runs `pipetrain plan`.
///
/// # Errors
/// As [`plan`]; `Io` when the plan cannot be written; `Plan` when a measured run fails.
pub fn plan_command(args: &PlanArgs) -> Result<()> {
    let cfg = TrainConfig::load(&args.config)?;
    let rt = Runtime::from_env()?;
    // Before the link of a manifest's nodes is measured in this process.
    let baseline = super::process::Baseline::now();
    let worker = std::env::current_exe().map_err(crate::Error::io(&args.config))?;
    let given = args.link_latency_us.zip(args.link_gbps);
    let cluster = match &args.manifest {
        Some(m) => Some(super::cluster::load(m, given)?),
        None => None,
    };
    let workers = match &cluster {
        Some((_, nodes, _)) => nodes.total(),
        None => args
            .devices
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
    };
    let opts = PlanOptions {
        worker: &worker,
        workers,
        baseline: Some(baseline),
        caps: super::Caps {
            device: args.memory_per_device.map(gib),
            process: match args.memory_per_process {
                Some(g) => Some((gib(g), "--memory-per-process".into())),
                // An address-space limit counts what is reserved and never touched,
                // which the plan does not predict.
                None => crate::train::memory_cap(cfg.runtime.memory_limit_gb)
                    .filter(|c| !c.address_space)
                    .map(|c| (c.bytes, c.source)),
            },
        },
        max_micro_batches: args.max_micro_batches,
        profile_steps: args.profile_steps,
        profile_rounds: args.profile_rounds.max(1),
        profile_cache: args.profile_cache.as_deref(),
        cluster: cluster
            .as_ref()
            .map(|(m, nodes, link)| super::ClusterOptions {
                nodes: nodes.clone(),
                link: *link,
                calibrate: Some(m.clone())
                    .filter(|m| given.is_none() && super::cluster::all_here(m)),
            }),
    };
    let p = plan(&rt, &cfg, &args.config, &opts)?;
    print!("{}", report(&p, args.top));
    if let (Some(out), Some(times)) = (&args.save_profile, &p.node_times) {
        let text = serde_json::to_vec_pretty(times)
            .map_err(|e| super::plan_error("the profile file", e.to_string()))?;
        crate::onnx::save_bytes(out, &text)?;
        println!("wrote {}", out.display());
    }
    let manifest = cluster.as_ref().map(|(m, _, _)| m);
    let elsewhere = manifest.filter(|m| !super::cluster::all_here(m));
    let measuring = args.measure > 0 && elsewhere.is_none();
    // With runs to settle it, the fastest measured is written after them.
    let pick = match (&args.out, args.pick) {
        (None, _) => None,
        (Some(_), None) if measuring => None,
        (Some(_), pick) => p.ranked(pick.unwrap_or(1) as usize)?,
    };
    if let Some(best) = pick {
        let chosen = match args.pick {
            Some(n) if n > 1 => format!("the layout it ranked {n} by predicted step"),
            _ => "the layout it predicted fastest".to_string(),
        };
        write_row(args, &p, best, manifest, (&chosen, ""))?;
    }
    if let Some(m) = elsewhere.filter(|_| args.measure > 0) {
        println!(
            "\nnot measured: {}'s nodes are not all on this machine",
            m.path().display()
        );
    }
    if !measuring {
        return Ok(());
    }
    let fastest = super::proof::measure(&p, args, (&cfg, &worker), manifest)?;
    if let (Some(_), None) = (&args.out, args.pick) {
        // Where no run finished, the predicted best.
        let (best, chosen, why) = match fastest {
            Some((best, which)) => (
                Some(best),
                format!("the fastest of the layouts it ran ({which})"),
                format!(" (the fastest measured: {which})"),
            ),
            None => (
                p.ranked(1)?,
                "the layout it predicted fastest (no run finished)".into(),
                " (no run measured: the predicted best)".into(),
            ),
        };
        if let Some(best) = best {
            write_row(args, &p, best, manifest, (&chosen, &why))?;
        }
    }
    Ok(())
}

/// `g` GiB in bytes.
fn gib(g: f64) -> u64 {
    (g * (1u64 << 30) as f64) as u64
}

/// Writes `best` to `--out` (and, over a manifest, the manifest beside it), its header
/// saying how it was `chosen`, and says so on stdout with `why`.
fn write_row(
    args: &PlanArgs,
    p: &super::Plan,
    best: &super::PlanRow,
    manifest: Option<&crate::cluster::ClusterManifest>,
    (chosen, why): (&str, &str),
) -> Result<()> {
    let Some(out) = &args.out else {
        return Ok(());
    };
    // Processes of one machine would each take every core: the plan's threads are set.
    let threads = manifest.map(|_| p.threads);
    write_config(&args.config, best, threads, (out, chosen))?;
    println!("wrote {}{why}", out.display());
    if let Some(m) = manifest {
        let path = super::cluster::manifest_path(out);
        super::cluster::write_manifest(m, &best.candidate, &path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
