//! `pipetrain plan CONFIG`: profile, search, print the best layouts, write the best, and
//! where asked run the top ones and the default layout for real beside their prediction.

use std::path::PathBuf;

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::Result;

use super::{plan, report, write_config, PlanOptions, PlanRow};

/// The command's arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// The training configuration (its model, data, global batch and optimizer).
    pub config: PathBuf,
    /// Workers to lay out: stage actors of one process (default: this machine's cores).
    #[arg(long)]
    pub devices: Option<usize>,
    /// Each worker's memory, GiB: layouts predicted to need more on a rank are dropped.
    #[arg(long)]
    pub memory_per_device: Option<f64>,
    /// The most micro-batches per step to try.
    #[arg(long, default_value_t = 8)]
    pub max_micro_batches: usize,
    /// How many of the best layouts to print.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Write the best layout here as a configuration `train` accepts as it is.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also run this many of the best layouts, and the default one, for real and print
    /// each one's measured step beside its prediction.
    #[arg(long, default_value_t = 0)]
    pub measure: usize,
    /// Steps of each measured run (the first two not counted).
    #[arg(long, default_value_t = 12)]
    pub measure_steps: usize,
    /// Steps of each profile run (the first two not counted).
    #[arg(long, default_value_t = 8)]
    pub profile_steps: usize,
}

/// Runs `pipetrain plan`.
///
/// # Errors
/// As [`plan`]; `Io` when the plan cannot be written; `Plan` when a measured run fails.
pub fn plan_command(args: &PlanArgs) -> Result<()> {
    let cfg = TrainConfig::load(&args.config)?;
    let rt = Runtime::from_env()?;
    let worker = std::env::current_exe().map_err(crate::Error::io(&args.config))?;
    let opts = PlanOptions {
        worker: &worker,
        workers: args
            .devices
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
        memory_per_worker: args
            .memory_per_device
            .map(|g| (g * (1u64 << 30) as f64) as u64),
        max_micro_batches: args.max_micro_batches,
        profile_steps: args.profile_steps,
    };
    let p = plan(&rt, &cfg, &args.config, &opts)?;
    print!("{}", report(&p, args.top));
    if let (Some(out), Some(best)) = (&args.out, p.best()) {
        write_config(&args.config, best, out)?;
        println!("wrote {}", out.display());
    }
    if args.measure > 0 {
        let mut runs: Vec<(String, &PlanRow)> = p
            .rows
            .iter()
            .filter(|r| r.fits(p.cap))
            .take(args.measure)
            .enumerate()
            .map(|(i, r)| (format!("{}", i + 1), r))
            .collect();
        if let Some(d) = &p.default {
            runs.push(("default".into(), d));
        }
        if let Some(time) = p
            .cut_rivals
            .first()
            .and_then(|(_, r)| p.rows.iter().find(|t| t.candidate == r.candidate))
        {
            runs.push(("by time".into(), time));
            for (by, r) in &p.cut_rivals {
                runs.push((format!("by {by}"), r));
            }
        }
        println!(
            "\nmeasured ({} steps each, 2 not counted):",
            args.measure_steps
        );
        println!("rank     predicted ms  measured ms  error   layout");
        let mut errors = Vec::new();
        for (name, row) in runs {
            let m = super::measure_step(&worker, &args.config, row, (args.measure_steps, 2))?;
            let err = row.simulated.step / m.step - 1.0;
            errors.push(err.abs());
            println!(
                "{name:<8} {:>12.2}  {:>11.2}  {:>+5.1}%  {}",
                row.simulated.step * 1e3,
                m.step * 1e3,
                err * 100.0,
                super::layout_text(&row.candidate)
            );
        }
        let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
        println!("mean absolute error: {:.1}%", mean * 100.0);
    }
    Ok(())
}
