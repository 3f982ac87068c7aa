//! The `pipetrain` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pipetrain::compute::Runtime;
use pipetrain::config::TrainConfig;

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
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor(),
        Command::Train { config } => train(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn doctor() -> pipetrain::Result<()> {
    let rt = Runtime::from_env()?;
    let info = rt.info();
    println!("library:   {}", info.library.display());
    println!("found by:  {}", info.found_by);
    println!("version:   {}", info.version);
    println!("providers: {}", info.providers.join(", "));
    Ok(())
}

fn train(config: &std::path::Path) -> pipetrain::Result<()> {
    let cfg = TrainConfig::load(config)?;
    let rt = Runtime::from_env()?;
    eprintln!(
        "pipetrain: {} with ONNX Runtime {} ({})",
        cfg.model_path.display(),
        rt.info().version,
        rt.info().library.display()
    );
    let total = cfg.num_train_steps;
    let every = cfg.display_loss_steps;
    let summary = pipetrain::train::train(&rt, &cfg, config, |r| {
        if r.step % every == 0 || r.step + 1 == total {
            let rate = (r.step + 1) as f64 / r.elapsed.as_secs_f64().max(1e-9);
            println!(
                "step {:>6}/{total}  loss {:.6}  {rate:.1} steps/s",
                r.step, r.loss
            );
        }
    })?;
    let secs = summary.elapsed.as_secs_f64().max(1e-9);
    println!(
        "done: {} steps on {} stage(s) in {secs:.2}s, {:.1} steps/s, {:.0} samples/s, final loss {:.6}",
        summary.steps,
        summary.stages,
        summary.steps as f64 / secs,
        (summary.steps * summary.batch_size) as f64 / secs,
        summary.final_loss
    );
    if let Some(out) = &cfg.output_path {
        println!("trained model: {}", out.display());
    }
    Ok(())
}
