//! Synthetic, learnable data sets, generated deterministically from seeds: a language
//! for GPT-2, class-conditional images for SqueezeNet, a teacher's labels for the MLP.
//! Each fits the matching built-in model's defaults (`crate::models`) and trains with
//! the `next_token` (language) or `arrays` (images, teacher) data layout.
//!
//! Two seeds: `seed` fixes the task (the language's rules, the image classes' textures,
//! the teacher's weights) and `sample_seed` the samples drawn from it, so a second file
//! with another `sample_seed` is held-out data of the same task.
//!
//! # Layout
//! - `language`, `images`, `teacher`: one task each, with its configuration.
//! - this file: [`SynthSpec`], [`generate`], and `pipetrain data synth ... -o data.npz`.

mod images;
mod language;
mod teacher;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use images::ImagesConfig;
pub use language::LanguageConfig;
pub use teacher::TeacherConfig;

#[cfg(feature = "cli")]
use super::write_npz;
use crate::models::rule;
use crate::tensor::Tensor;
use crate::Result;

/// The most elements one generated array may hold (4 GiB of float32).
pub const MAX_ELEMENTS: usize = 1 << 30;

/// The most transition rules a language may have.
const MAX_CONTEXTS: usize = 1 << 24;

/// Which data set to generate (a TOML table with `kind = "language"`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SynthSpec {
    /// Token rows of a sparse Markov chain: `tokens` int64 [samples, seq + 1].
    Language(LanguageConfig),
    /// Class-conditional textures: `x` float32 [samples, C, H, W], `y` int64 [samples].
    Images(ImagesConfig),
    /// A random teacher network's labels: `x` float32 [samples, inputs], `y` int64.
    Teacher(TeacherConfig),
}

impl SynthSpec {
    /// Checks the configuration; `path` names the file in errors.
    ///
    /// # Errors
    /// `Config` naming the field (`synth.samples`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        match self {
            SynthSpec::Language(c) => c.validate(path),
            SynthSpec::Images(c) => c.validate(path),
            SynthSpec::Teacher(c) => c.validate(path),
        }
    }

    /// The kind's name, as in `kind = "..."`.
    pub fn kind(&self) -> &'static str {
        match self {
            SynthSpec::Language(_) => "language",
            SynthSpec::Images(_) => "images",
            SynthSpec::Teacher(_) => "teacher",
        }
    }
}

/// Generates the data set's arrays, by name, after checking the configuration.
///
/// # Errors
/// `Config` as [`SynthSpec::validate`] (the file named `<synth>`).
pub fn generate(spec: &SynthSpec) -> Result<HashMap<String, Tensor>> {
    spec.validate(Path::new("<synth>"))?;
    let arrays = match spec {
        SynthSpec::Language(c) => vec![("tokens", c.generate()?)],
        SynthSpec::Images(c) => {
            let (x, y) = c.generate()?;
            vec![("x", x), ("y", y)]
        }
        SynthSpec::Teacher(c) => {
            let (x, y) = c.generate()?;
            vec![("x", x), ("y", y)]
        }
    };
    Ok(arrays
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect())
}

/// The generator of a task's fixed parts (rules, textures, teacher weights).
fn task_rng(seed: u64) -> ChaCha8Rng {
    rng(seed, 0, *b"task\0\0\0\0")
}

/// The generator of the samples drawn from a task: its own stream for each
/// `sample_seed`, never the task's.
fn sample_rng(seed: u64, sample_seed: u64) -> ChaCha8Rng {
    rng(seed, sample_seed, *b"samples\0")
}

fn rng(seed: u64, sample_seed: u64, purpose: [u8; 8]) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&sample_seed.to_le_bytes());
    key[16..24].copy_from_slice(&purpose);
    ChaCha8Rng::from_seed(key)
}

/// Checks that an array of `dims` stays within [`MAX_ELEMENTS`].
fn elements_limit(path: &Path, field: &str, dims: &[usize]) -> Result<()> {
    let n = dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d));
    rule(
        n.is_some_and(|n| n <= MAX_ELEMENTS),
        path,
        field,
        format!("an array of shape {dims:?} is over {MAX_ELEMENTS} elements"),
    )
}

/// `pipetrain data ...`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DataCommand {
    /// Generates a synthetic data set and writes it as `.npz`.
    Synth(SynthArgs),
    /// Cuts an `.npz` (or safetensors) file's arrays into ONNX Runtime `.pb` shards.
    Pack(super::shards::PackArgs),
}

/// `pipetrain data synth ...`: which data set to write.
#[derive(Debug, Clone, clap::Args)]
pub struct SynthArgs {
    /// The data set.
    #[command(subcommand)]
    pub command: SynthCommand,
}

/// One synthetic data set with its options and the output file.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum SynthCommand {
    /// A sparse Markov-chain language: `tokens` int64 [samples, seq + 1].
    Language {
        /// The data set's configuration.
        #[command(flatten)]
        config: LanguageConfig,
        /// The `.npz` file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Class-conditional textures: `x` float32 [samples, C, H, W], `y` int64 [samples].
    Images {
        /// The data set's configuration.
        #[command(flatten)]
        config: ImagesConfig,
        /// The `.npz` file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// A random teacher network's labels: `x` float32 [samples, inputs], `y` int64.
    Teacher {
        /// The data set's configuration.
        #[command(flatten)]
        config: TeacherConfig,
        /// The `.npz` file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// Runs `pipetrain data ...`; returns a one-line summary.
///
/// # Errors
/// As [`synth_command`].
#[cfg(feature = "cli")]
pub fn data_command(cmd: DataCommand) -> Result<String> {
    match cmd {
        DataCommand::Synth(args) => synth_command(args),
        DataCommand::Pack(args) => super::shards::pack_command(args),
    }
}

/// Generates the data set and writes it (atomically, creating folders); returns a
/// one-line summary: kind, arrays and shapes, the entropy floor of a language, file.
///
/// # Errors
/// `Config` naming the command-line option (`--samples`) and the rule; `Io` when the
/// file cannot be written.
#[cfg(feature = "cli")]
pub fn synth_command(args: SynthArgs) -> Result<String> {
    let (spec, output) = match args.command {
        SynthCommand::Language { config, output } => (SynthSpec::Language(config), output),
        SynthCommand::Images { config, output } => (SynthSpec::Images(config), output),
        SynthCommand::Teacher { config, output } => (SynthSpec::Teacher(config), output),
    };
    spec.validate(Path::new("<command line>"))
        .map_err(|e| match e {
            crate::Error::Config { path, field, rule } => crate::Error::Config {
                path,
                field: format!("--{}", field.trim_start_matches("synth.").replace('_', "-")),
                rule,
            },
            other => other,
        })?;
    let arrays = generate(&spec)?;
    let mut names: Vec<&str> = arrays.keys().map(String::as_str).collect();
    names.sort_unstable();
    let refs: Vec<(&str, &Tensor)> = names.iter().map(|n| (*n, &arrays[*n])).collect();
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(crate::Error::io(dir))?;
    }
    write_npz(&output, &refs)?;
    let shapes: Vec<String> = refs
        .iter()
        .map(|(n, t)| {
            let dtype = format!("{:?}", t.dtype()).to_lowercase();
            format!("{n} {dtype} {:?}", t.shape)
        })
        .collect();
    let floor = match &spec {
        SynthSpec::Language(c) => format!(" (entropy floor {:.4} nats/token)", c.entropy_floor()),
        _ => String::new(),
    };
    Ok(format!(
        "{}: {}{floor}, written to {}",
        spec.kind(),
        shapes.join(", "),
        output.display()
    ))
}

#[cfg(test)]
mod tests;
