//! Writing shards, and `pipetrain data pack`: an `.npz` or safetensors file's arrays,
//! row by row, into `<prefix>_<k>.pb` shard files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use prost::Message;

use super::read::Sample;
use crate::onnx::write_atomically;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The bytes of one sample record: a little-endian `u32` byte count of what follows, then
/// per feature (in name order) a little-endian `u32` byte count and the feature's
/// serialized `TensorProto` (raw little-endian data, `name` = the feature name).
///
/// # Errors
/// `BadTensor` when a feature, or the whole sample, exceeds the format's 4 GiB lengths.
pub fn encode_sample(sample: &Sample) -> Result<Vec<u8>> {
    let too_big = |name: &str| Error::BadTensor {
        name: name.into(),
        reason: "over 4 GiB serialized, more than a shard record's length can say".into(),
    };
    let mut body = Vec::new();
    for (name, tensor) in sample {
        let bytes = tensor.to_proto(name).encode_to_vec();
        let len = u32::try_from(bytes.len()).map_err(|_| too_big(name))?;
        body.extend_from_slice(&len.to_le_bytes());
        body.extend_from_slice(&bytes);
    }
    let len = u32::try_from(body.len()).map_err(|_| too_big(super::read::WHOLE_SAMPLE))?;
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Writes `samples` as one shard at `path`, atomically: through a temporary name renamed
/// over `path`, so a failed write never leaves a half-written `.pb` that reads as good.
///
/// # Errors
/// `Data` naming the sample when it exceeds the format's 4 GiB lengths; `Io` when the
/// file cannot be written.
pub fn write_shard(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut bytes = Vec::new();
    for (i, sample) in samples.iter().enumerate() {
        let record = encode_sample(sample).map_err(|e| Error::Data {
            path: path.to_path_buf(),
            what: format!("sample {i}"),
            reason: e.to_string(),
        })?;
        bytes.extend_from_slice(&record);
    }
    write_atomically(path, &bytes)
}

/// `pipetrain data pack`: which file to cut into shards, and where.
#[derive(Debug, Clone, clap::Args)]
pub struct PackArgs {
    /// The `.npz` (or `.safetensors`) file; its arrays share their first dimension.
    #[arg(long)]
    pub input: PathBuf,
    /// The folder to write the shards to (created; must hold no `.pb` files yet).
    #[arg(long)]
    pub out: PathBuf,
    /// Samples (rows) per shard file; the last shard holds the rest.
    #[arg(long)]
    pub samples_per_shard: usize,
    /// Shard file names: `<prefix>_<k>.pb`, `k` zero-padded so names sort in order.
    #[arg(long, default_value = "train")]
    pub prefix: String,
}

/// Runs `pipetrain data pack`; returns a one-line summary.
///
/// # Errors
/// As [`pack`].
pub fn pack_command(args: PackArgs) -> Result<String> {
    let files = pack(&args.input, &args.out, args.samples_per_shard, &args.prefix)?;
    Ok(format!(
        "packed {} into {} shard files in {}",
        args.input.display(),
        files.len(),
        args.out.display()
    ))
}

/// Cuts the arrays of `input` (`.npz`, or `.safetensors` by extension) into samples, row
/// `i` of every array (without the first axis) being sample `i`'s feature of the array's
/// name, and writes them `samples_per_shard` to a file as `out/<prefix>_<k>.pb`.
/// Returns the files written, in order.
///
/// # Errors
/// `Config` naming the option for a zero `samples_per_shard` or a prefix that is not a
/// plain file name; `Data` for a scalar array, arrays of different row counts, no rows, or
/// an output folder that already holds shards; `Io`/`Data` from reading or writing.
pub fn pack(
    input: &Path,
    out: &Path,
    samples_per_shard: usize,
    prefix: &str,
) -> Result<Vec<PathBuf>> {
    let option = |field: &str, rule: &str| Error::Config {
        path: "<command line>".into(),
        field: field.into(),
        rule: rule.into(),
    };
    if samples_per_shard == 0 {
        return Err(option("--samples-per-shard", "must be at least 1"));
    }
    if prefix.is_empty() || prefix.starts_with('.') || prefix.contains(['/', '\\']) {
        return Err(option(
            "--prefix",
            "must be a plain file name part (not empty, no `/`, not starting with `.`)",
        ));
    }
    let arrays = read_arrays(input)?;
    let bad = |what: &str, reason: String| Error::Data {
        path: input.to_path_buf(),
        what: what.into(),
        reason,
    };
    let mut names: Vec<&String> = arrays.keys().collect();
    names.sort();
    let mut rows = None;
    for name in &names {
        let n = *arrays[*name]
            .shape
            .first()
            .ok_or_else(|| bad(name, "a scalar has no rows to make samples of".into()))?;
        if rows.is_some_and(|r| r != n) {
            return Err(bad(
                name,
                format!("{n} rows, but other arrays have {}", rows.unwrap_or(0)),
            ));
        }
        rows = Some(n);
    }
    let rows = rows
        .filter(|&r| r > 0)
        .ok_or_else(|| bad("file", "no rows".into()))?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    if has_shards(out)? {
        return Err(Error::Data {
            path: out.to_path_buf(),
            what: "output folder".into(),
            reason: "already holds .pb files; they would mix with the new shards".into(),
        });
    }
    let count = rows.div_ceil(samples_per_shard);
    let width = (count - 1).to_string().len().max(5);
    let mut written = Vec::with_capacity(count);
    for k in 0..count {
        let range = k * samples_per_shard..((k + 1) * samples_per_shard).min(rows);
        let mut samples = Vec::with_capacity(range.len());
        for i in range {
            let mut sample = Sample::new();
            for name in &names {
                sample.insert((*name).clone(), row(&arrays[*name], i)?);
            }
            samples.push(sample);
        }
        let path = out.join(format!("{prefix}_{k:0width$}.pb"));
        write_shard(&path, &samples)?;
        written.push(path);
    }
    Ok(written)
}

/// Row `i` of `t`, without the first axis.
fn row(t: &Tensor, i: usize) -> Result<Tensor> {
    let mut r = t.gather_rows(&[i])?;
    r.shape.remove(0);
    Ok(r)
}

fn read_arrays(input: &Path) -> Result<HashMap<String, Tensor>> {
    match input.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => crate::data::read_safetensors(input),
        _ => crate::data::read_npz(input),
    }
}

/// Whether `dir` holds a file that a shard data set would read.
fn has_shards(dir: &Path) -> Result<bool> {
    Ok(!super::read::shard_files(dir)?.is_empty())
}
