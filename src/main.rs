//! The `pipetrain` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor => doctor(),
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
    let rt = pipetrain::compute::Runtime::from_env()?;
    let info = rt.info();
    println!("library:   {}", info.library.display());
    println!("found by:  {}", info.found_by);
    println!("version:   {}", info.version);
    println!("providers: {}", info.providers.join(", "));
    Ok(())
}
