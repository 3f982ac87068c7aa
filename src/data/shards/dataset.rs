//! [`ShardDataset`]: a folder of shards as the batches of a run's steps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::cache::{Decoded, FileCache, ReadAhead};
use super::read::{count_samples, decode_sample, frames, shard_files};
use super::spec::ShardSplit;
use crate::data::StepBatches;
use crate::tensor::{Tensor, TensorData, TensorMap};
use crate::{Error, Result};

mod order;

/// Data sets up to this size (bytes of shard files) are kept whole in memory once read.
const PRELOAD_BYTES: u64 = 1 << 30;

/// Shard files kept decoded when the data set is larger than [`PRELOAD_BYTES`]: the files
/// a few consecutive batches read, and those read ahead. A shuffled sample order over all
/// files (`split = "samples"`) then reads shards again and again; `split = "files"`
/// streams through them.
const CACHE_FILES: usize = 4;

/// Steps whose files are read ahead of the one asked for. The data actors already ask
/// for batches two steps before their stage needs them; this reads the files of the two
/// steps after that.
const READ_AHEAD_STEPS: usize = 2;

/// A folder of shards as step batches.
///
/// With `split = "samples"` (the default), step `s`'s global batch is samples
/// `[s * B, (s + 1) * B)` of one sample order: the files' samples in file-name order,
/// shuffled per epoch when a seed is given; epochs follow each other without a gap, so a
/// batch may span two. Each replica's micro-batches are rows of that batch.
///
/// With `split = "files"` ([`ShardDataset::split_files`]), replica `r` of `D` reads only
/// the files `i` with `i % D == r` (ONNX Runtime's assignment), as a stream of its own:
/// its files in a seeded order per epoch, each file's samples shuffled within it. Its
/// part of step `s` is samples `[s * B / D, (s + 1) * B / D)` of that stream; the global
/// batch is the replicas' parts in replica order.
///
/// Opening counts each file's samples from their length prefixes (seeking past the
/// features) and decodes the first sample, which every other must match. Files are read
/// and checked whole when a batch first needs them, or before, by a read-ahead thread
/// that decodes the files of the steps after the one asked for. They are kept decoded in
/// a least-recently-used cache: all of them when the files total at most 1 GiB,
/// otherwise [`CACHE_FILES`].
pub struct ShardDataset {
    dir: PathBuf,
    cache: Arc<FileCache>,
    ahead: ReadAhead,
    /// `starts[i]`: the index of file `i`'s first sample; one more entry, the total.
    starts: Vec<usize>,
    /// (feature, model input), sorted by input.
    feeds: Vec<(String, String)>,
    batch: usize,
    seed: Option<u64>,
    /// With `split = "files"`: each replica's files, in file order.
    owned: Option<Vec<Vec<usize>>>,
    /// The sample orders last asked for, by (replica with `split = "files"`, epoch).
    orders: Mutex<Vec<(Stream, Arc<Vec<usize>>)>>,
}

/// A sample order: the data set's (`None`) or a replica's own, and its epoch.
type Stream = (Option<usize>, usize);

impl ShardDataset {
    /// Opens the shards of `dir` (ORT's rule: regular files ending `.pb`, not starting
    /// with `.`, sorted by name) for global batches of `global_batch` samples, split by
    /// samples.
    ///
    /// # Errors
    /// `Io` for an unreadable folder or file; `BadShard` for a malformed file or a
    /// mapped feature the first sample lacks; `Data` for a folder without samples, a map
    /// that feeds one input twice, or a batch larger than the data set.
    pub fn open(
        dir: &Path,
        input_name_map: &BTreeMap<String, String>,
        global_batch: usize,
        shuffle_seed: Option<u64>,
    ) -> Result<ShardDataset> {
        let bad = |what: &str, reason: String| Error::Data {
            path: dir.to_path_buf(),
            what: what.into(),
            reason,
        };
        let files = shard_files(dir)?;
        let mut starts = vec![0];
        let mut bytes_total = 0u64;
        let mut first = None;
        for (i, path) in files.iter().enumerate() {
            let (count, bytes) = count_samples(path)?;
            bytes_total += bytes;
            if first.is_none() && count > 0 {
                let bytes = std::fs::read(path).map_err(Error::io(path))?;
                if let Some(r) = frames(path, &bytes)?.first() {
                    first = Some((i, decode_sample(path, 0, r)?));
                }
            }
            starts.push(starts[i] + count);
        }
        let Some((first_file, first)) = first else {
            return Err(bad("shard folder", "no samples in any .pb file".into()));
        };
        let feeds: Vec<(String, String)> = if input_name_map.is_empty() {
            first.keys().map(|k| (k.clone(), k.clone())).collect()
        } else {
            let mut feeds = Vec::new();
            for (feature, input) in input_name_map {
                if !first.contains_key(feature) {
                    return Err(Error::BadShard {
                        path: files[first_file].clone(),
                        sample: 0,
                        feature: feature.clone(),
                        reason: format!(
                            "named in input_name_map, but the sample has only {:?}",
                            first.keys().collect::<Vec<_>>()
                        ),
                    });
                }
                if feeds.iter().any(|(_, i)| i == input) {
                    return Err(bad(
                        "input_name_map",
                        format!("two features feed `{input}`"),
                    ));
                }
                feeds.push((feature.clone(), input.clone()));
            }
            feeds.sort_by(|a, b| a.1.cmp(&b.1));
            feeds
        };
        let total = starts[files.len()];
        if global_batch == 0 || global_batch > total {
            return Err(bad(
                "batch size",
                format!("batches of {global_batch} samples from {total} samples"),
            ));
        }
        let capacity = if bytes_total <= PRELOAD_BYTES {
            files.len()
        } else {
            CACHE_FILES
        };
        let features = feeds.iter().map(|(f, _)| f.clone()).collect();
        let cache = Arc::new(FileCache::new(files, features, first, capacity));
        Ok(ShardDataset {
            dir: dir.to_path_buf(),
            ahead: ReadAhead::start(cache.clone()),
            cache,
            starts,
            feeds,
            batch: global_batch,
            seed: shuffle_seed,
            owned: None,
            orders: Mutex::new(Vec::new()),
        })
    }

    /// Opens `dir` as `[data.shards]` says, for `replicas` data-parallel replicas.
    ///
    /// # Errors
    /// As [`ShardDataset::open`] and [`ShardDataset::split_files`].
    pub fn open_spec(
        spec: &super::ShardSpec,
        global_batch: usize,
        replicas: usize,
    ) -> Result<ShardDataset> {
        let set = ShardDataset::open(
            &spec.train_data_dir,
            &spec.input_name_map,
            global_batch,
            spec.shuffle_seed,
        )?;
        match spec.split {
            ShardSplit::Samples => Ok(set),
            ShardSplit::Files => set.split_files(replicas),
        }
    }

    /// Splits the data among `replicas` data-parallel replicas by files (`split =
    /// "files"`; see [`ShardDataset`]).
    ///
    /// # Errors
    /// `Data` (what: `split`) when there are fewer files than replicas, when the global
    /// batch does not split into `replicas` equal parts, or when a replica's files hold
    /// fewer samples than its part of a batch.
    pub fn split_files(mut self, replicas: usize) -> Result<ShardDataset> {
        let n = self.cache.files().len();
        let bad = |reason: String| Error::Data {
            path: self.dir.clone(),
            what: "split".into(),
            reason,
        };
        if replicas == 0 || replicas > n {
            return Err(bad(format!(
                "{n} shard file(s) for {replicas} data-parallel replicas: with split = \"files\" \
                 every replica needs a file of its own (file i goes to replica i % {replicas})"
            )));
        }
        if self.batch % replicas != 0 {
            return Err(bad(format!(
                "batches of {} samples do not split into {replicas} replicas",
                self.batch
            )));
        }
        let owned: Vec<Vec<usize>> = (0..replicas)
            .map(|r| (r..n).step_by(replicas).collect())
            .collect();
        let part = self.batch / replicas;
        for (r, files) in owned.iter().enumerate() {
            let samples: usize = files
                .iter()
                .map(|&f| self.starts[f + 1] - self.starts[f])
                .sum();
            if samples < part {
                return Err(bad(format!(
                    "replica {r}'s files ({}) hold {samples} samples, fewer than its {part} of \
                     each batch",
                    files.len()
                )));
            }
        }
        self.owned = Some(owned);
        Ok(self)
    }

    /// Keeps at most `files` shards decoded (at least one) instead of the default (all
    /// when they total at most 1 GiB, else [`CACHE_FILES`]).
    pub fn with_cache_files(self, files: usize) -> ShardDataset {
        self.cache.set_capacity(files);
        self
    }

    /// Samples in all shards together (one epoch).
    pub fn samples(&self) -> usize {
        self.starts[self.starts.len() - 1]
    }

    /// The shard files, in sample order.
    pub fn files(&self) -> &[PathBuf] {
        self.cache.files()
    }

    /// With `split = "files"`: the files (indices into [`ShardDataset::files`]) replica
    /// `replica` reads.
    pub fn files_of(&self, replica: usize) -> Option<&[usize]> {
        self.owned.as_ref()?.get(replica).map(Vec::as_slice)
    }

    /// Whether file `file` is decoded and kept now (what has been read, or read ahead).
    pub fn is_cached(&self, file: usize) -> bool {
        self.cache.is_cached(file)
    }

    /// The model inputs fed, each with the file feature feeding it, sorted by input.
    pub fn feeds(&self) -> &[(String, String)] {
        &self.feeds
    }

    /// Samples per global batch.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// The batch of `samples`, then the read-ahead of `ahead`: asked for once the
    /// samples' own files are the cache's most recently used, so that reading ahead
    /// evicts older files rather than these.
    fn gather_then_read_ahead(&self, samples: &[usize], ahead: Vec<usize>) -> Result<TensorMap> {
        let batch = self.gather(samples)?;
        self.ahead.ask(self.files_of_samples(samples).len(), ahead);
        Ok(batch)
    }

    /// The global batch of `step`: each fed feature stacked as `[B, ..sample shape]`
    /// under its model input's name (with `split = "files"`, the replicas' parts in
    /// replica order).
    ///
    /// # Errors
    /// `Io`/`BadShard` when a shard needed cannot be read or differs from the first
    /// sample (naming file, sample and feature).
    pub fn batch(&self, step: usize) -> Result<TensorMap> {
        let parts = self.owned.as_ref().map_or(1, Vec::len);
        let (mut samples, mut ahead) = (Vec::with_capacity(self.batch), Vec::new());
        for p in 0..parts {
            let (now, later) = self.part_samples(step, p, parts)?;
            samples.extend(now);
            ahead.extend(
                later
                    .into_iter()
                    .filter(|f| !ahead.contains(f))
                    .collect::<Vec<_>>(),
            );
        }
        self.gather_then_read_ahead(&samples, ahead)
    }

    /// Part `part` of `parts` of step `step`'s batch, reading only its samples (with
    /// `split = "files"`, from its replica's files): part `r * m + k` is micro-batch `k`
    /// of replica `r` when each of the replicas takes `m` parts.
    ///
    /// # Errors
    /// As [`ShardDataset::batch`]; `BadTensor` when the batch does not split evenly.
    pub fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        let (samples, ahead) = self.part_samples(step, part, parts)?;
        self.gather_then_read_ahead(&samples, ahead)
    }

    /// The fed features of `samples`, stacked.
    fn gather(&self, samples: &[usize]) -> Result<TensorMap> {
        let mut held: Vec<(usize, Decoded)> = Vec::new();
        let mut picked = Vec::with_capacity(samples.len());
        for &index in samples {
            let file = self.file_of(index);
            let decoded = match held.iter().find(|(f, _)| *f == file) {
                Some((_, d)) => d.clone(),
                None => {
                    let d = self.cache.get(file)?;
                    held.push((file, d.clone()));
                    d
                }
            };
            picked.push((decoded, index - self.starts[file]));
        }
        let mut out = TensorMap::new();
        for (j, (_, input)) in self.feeds.iter().enumerate() {
            let rows: Vec<&Tensor> = picked.iter().map(|(s, i)| &s[*i][j]).collect();
            out.insert(input.clone(), stack(input, &rows)?);
        }
        Ok(out)
    }

    fn fail(&self, reason: String) -> Error {
        Error::Data {
            path: self.dir.clone(),
            what: "shard data set".into(),
            reason,
        }
    }
}

impl StepBatches for ShardDataset {
    fn batch(&self, step: usize) -> Result<TensorMap> {
        ShardDataset::batch(self, step)
    }

    fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        ShardDataset::part(self, step, part, parts)
    }
}

/// Stacks equally shaped rows into `[rows, ..row shape]`.
fn stack(name: &str, rows: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = rows.first() else {
        return Err(Error::BadTensor {
            name: name.into(),
            reason: "no rows to stack".into(),
        });
    };
    let mismatch = || Error::BadTensor {
        name: name.into(),
        reason: "rows of different element types".into(),
    };
    macro_rules! cat {
        ($variant:ident) => {{
            let mut out = Vec::with_capacity(first.len() * rows.len());
            for r in rows {
                match &r.data {
                    TensorData::$variant(v) => out.extend_from_slice(v),
                    _ => return Err(mismatch()),
                }
            }
            TensorData::$variant(out)
        }};
    }
    let data = match &first.data {
        TensorData::F32(_) => cat!(F32),
        TensorData::F64(_) => cat!(F64),
        TensorData::I64(_) => cat!(I64),
        TensorData::I32(_) => cat!(I32),
        TensorData::Bool(_) => cat!(Bool),
    };
    let mut shape = vec![rows.len()];
    shape.extend_from_slice(&first.shape);
    Tensor::new(shape, data)
}
