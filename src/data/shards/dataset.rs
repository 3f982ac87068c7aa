//! [`ShardDataset`]: a folder of shards as the batches of a run's steps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::read::{check_like, count_samples, decode_sample, frames, shard_files, Sample};
use crate::data::StepBatches;
use crate::tensor::{Tensor, TensorData, TensorMap};
use crate::{Error, Result};

/// Data sets up to this size (bytes of shard files) are kept whole in memory once read.
const PRELOAD_BYTES: u64 = 1 << 30;

/// Shard files kept decoded when the data set is larger than [`PRELOAD_BYTES`]: enough
/// for the files a few consecutive unshuffled batches touch. A shuffled order over more
/// data than this reads shards again and again (ORT shuffles within one shard instead).
const CACHE_FILES: usize = 4;

/// A folder of shards as step batches. Step `s`'s global batch is samples
/// `[s * B, (s + 1) * B)` of the sample order, which is the files' samples in file-name
/// order, shuffled per epoch when a seed is given; epochs follow each other without a
/// gap, so a batch may span two.
///
/// Opening counts each file's samples from their length prefixes (seeking past the
/// features) and decodes the first sample, which every other must match. Files are read
/// and checked whole when a batch first needs them, and kept decoded in a small
/// least-recently-used cache: all of them when the files total at most 1 GiB, otherwise
/// [`CACHE_FILES`].
pub struct ShardDataset {
    files: Vec<PathBuf>,
    /// `starts[i]`: the index of file `i`'s first sample; one more entry, the total.
    starts: Vec<usize>,
    /// (feature, model input), sorted by input.
    feeds: Vec<(String, String)>,
    /// The first sample: what every sample must look like.
    first: Sample,
    batch: usize,
    seed: Option<u64>,
    cache: Mutex<Cache>,
    /// The sample orders of the last epochs asked for.
    orders: Mutex<Vec<(usize, Arc<Vec<usize>>)>>,
}

/// One decoded shard: per sample, the fed tensors in `feeds` order.
type Decoded = Arc<Vec<Vec<Tensor>>>;

/// Decoded shards: (file index, last use, samples), least recently used evicted first.
struct Cache {
    capacity: usize,
    tick: u64,
    files: Vec<(usize, u64, Decoded)>,
}

impl ShardDataset {
    /// Opens the shards of `dir` (ORT's rule: regular files ending `.pb`, not starting
    /// with `.`, sorted by name) for global batches of `global_batch` samples.
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
        let mut first: Option<(usize, Sample)> = None;
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
        Ok(ShardDataset {
            files,
            starts,
            feeds,
            first,
            batch: global_batch,
            seed: shuffle_seed,
            cache: Mutex::new(Cache {
                capacity,
                tick: 0,
                files: Vec::new(),
            }),
            orders: Mutex::new(Vec::new()),
        })
    }

    /// Keeps at most `files` shards decoded (at least one) instead of the default (all
    /// when they total at most 1 GiB, else [`CACHE_FILES`]).
    pub fn with_cache_files(self, files: usize) -> ShardDataset {
        if let Ok(mut cache) = self.cache.lock() {
            cache.capacity = files.max(1);
            cache.files.clear();
        }
        self
    }

    /// Samples in all shards together (one epoch).
    pub fn samples(&self) -> usize {
        self.starts[self.files.len()]
    }

    /// The shard files, in sample order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The model inputs fed, each with the file feature feeding it, sorted by input.
    pub fn feeds(&self) -> &[(String, String)] {
        &self.feeds
    }

    /// Samples per global batch.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Where step `step`'s batch starts: `(epoch, offset into that epoch's order)`, for
    /// checkpoint manifests.
    pub fn position(&self, step: usize) -> (usize, usize) {
        let start = step.saturating_mul(self.batch);
        (start / self.samples(), start % self.samples())
    }

    /// The sample indices (into the files' order) of epoch `epoch`'s order.
    ///
    /// # Errors
    /// `Data` only if another thread panicked while holding the order cache.
    pub fn order(&self, epoch: usize) -> Result<Arc<Vec<usize>>> {
        let total = self.samples();
        let Some(seed) = self.seed else {
            return Ok(Arc::new((0..total).collect()));
        };
        let mut orders = self
            .orders
            .lock()
            .map_err(|_| self.fail("the order cache was poisoned".into()))?;
        if let Some((_, o)) = orders.iter().find(|(e, _)| *e == epoch) {
            return Ok(o.clone());
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(epoch as u64);
        let mut order: Vec<usize> = (0..total).collect();
        order.shuffle(&mut rng);
        let order = Arc::new(order);
        // Two epochs: a batch spanning an epoch boundary needs both.
        if orders.len() >= 2 {
            orders.remove(0);
        }
        orders.push((epoch, order.clone()));
        Ok(order)
    }

    /// The global batch of `step`: each fed feature stacked as `[B, ..sample shape]`
    /// under its model input's name.
    ///
    /// # Errors
    /// `Io`/`BadShard` when a shard needed cannot be read or differs from the first
    /// sample (naming file, sample and feature).
    pub fn batch(&self, step: usize) -> Result<TensorMap> {
        let total = self.samples();
        let start = step
            .checked_mul(self.batch)
            .ok_or_else(|| self.fail(format!("step {step}'s first sample is past usize::MAX")))?;
        let mut order: Option<(usize, Arc<Vec<usize>>)> = None;
        let mut picked = Vec::with_capacity(self.batch);
        for g in start..start + self.batch {
            let (epoch, k) = (g / total, g % total);
            let index = match self.seed {
                None => k,
                Some(_) => {
                    if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                        order = Some((epoch, self.order(epoch)?));
                    }
                    order.as_ref().map_or(k, |(_, o)| o[k])
                }
            };
            let file = self.starts.partition_point(|&s| s <= index) - 1;
            picked.push((self.load(file)?, index - self.starts[file]));
        }
        let mut out = TensorMap::new();
        for (j, (_, input)) in self.feeds.iter().enumerate() {
            let rows: Vec<&Tensor> = picked.iter().map(|(s, i)| &s[*i][j]).collect();
            out.insert(input.clone(), stack(input, &rows)?);
        }
        Ok(out)
    }

    /// Shard `file`'s samples (fed features only), from the cache or read now.
    fn load(&self, file: usize) -> Result<Decoded> {
        {
            let mut cache = self
                .cache
                .lock()
                .map_err(|_| self.fail("the shard cache was poisoned".into()))?;
            cache.tick += 1;
            let tick = cache.tick;
            if let Some(entry) = cache.files.iter_mut().find(|e| e.0 == file) {
                entry.1 = tick;
                return Ok(entry.2.clone());
            }
        }
        // Read without the lock: other steps' readers need not wait for this file.
        let path = &self.files[file];
        let samples = super::read::read_shard(path)?;
        if let Some(s) = samples.first() {
            check_like(path, 0, s, &self.first)?;
        }
        let mut fed = Vec::with_capacity(samples.len());
        for (i, mut s) in samples.into_iter().enumerate() {
            // `read_shard` checked every sample against the file's first, and that one
            // was checked against the data set's: each fed feature is there.
            let row = self.feeds.iter().map(|(f, _)| {
                s.remove(f).ok_or_else(|| Error::BadShard {
                    path: path.clone(),
                    sample: i,
                    feature: f.clone(),
                    reason: "missing".into(),
                })
            });
            fed.push(row.collect::<Result<Vec<Tensor>>>()?);
        }
        let fed = Arc::new(fed);
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| self.fail("the shard cache was poisoned".into()))?;
        let tick = cache.tick;
        cache.files.push((file, tick, fed.clone()));
        if cache.files.len() > cache.capacity {
            if let Some(oldest) = (0..cache.files.len()).min_by_key(|&i| cache.files[i].1) {
                cache.files.remove(oldest);
            }
        }
        Ok(fed)
    }

    fn fail(&self, reason: String) -> Error {
        Error::Data {
            path: self.files[0].parent().unwrap_or(Path::new(".")).into(),
            what: "shard data set".into(),
            reason,
        }
    }
}

impl StepBatches for ShardDataset {
    fn batch(&self, step: usize) -> Result<TensorMap> {
        ShardDataset::batch(self, step)
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
