//! Sample orders: the data set's one order over all files (`split = "samples"`), or
//! each replica's stream through its own files (`split = "files"`), and where a step's
//! part lies in them: its samples, their files, and the files to read ahead.

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{ShardDataset, Stream, READ_AHEAD_STEPS};
use crate::{Error, Result};

impl ShardDataset {
    /// Where step `step`'s batch starts: `(epoch, offset into that epoch's order)`, for
    /// checkpoint manifests (with `split = "files"`, in replica 0's stream).
    pub fn position(&self, step: usize) -> (usize, usize) {
        let (stream, start) = match &self.owned {
            None => (None, step.saturating_mul(self.batch)),
            Some(o) => (Some(0), step.saturating_mul(self.batch / o.len())),
        };
        let total = self.stream_len(stream);
        (start / total, start % total)
    }

    /// The sample indices (into the files' order) of epoch `epoch`'s order over all files
    /// (`split = "samples"`).
    ///
    /// # Errors
    /// None today: an order can always be made (a reader that panicked leaves the order
    /// cache usable).
    pub fn order(&self, epoch: usize) -> Result<Arc<Vec<usize>>> {
        self.order_of((None, epoch))
    }

    /// The sample indices of replica `replica`'s stream in epoch `epoch` (`split =
    /// "files"`).
    ///
    /// # Errors
    /// `Data` when the data set is not split by files or has no such replica.
    pub fn replica_order(&self, replica: usize, epoch: usize) -> Result<Arc<Vec<usize>>> {
        if self.files_of(replica).is_none() {
            return Err(self.fail(format!("no replica {replica} reading files of its own")));
        }
        self.order_of((Some(replica), epoch))
    }

    /// Samples in one epoch of `stream`.
    fn stream_len(&self, stream: Option<usize>) -> usize {
        match (stream, &self.owned) {
            (Some(r), Some(o)) => o[r]
                .iter()
                .map(|&f| self.starts[f + 1] - self.starts[f])
                .sum(),
            _ => self.samples(),
        }
    }

    fn order_of(&self, key: Stream) -> Result<Arc<Vec<usize>>> {
        let (stream, epoch) = key;
        if self.seed.is_none() && stream.is_none() {
            return Ok(Arc::new((0..self.samples()).collect()));
        }
        let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, o)) = orders.iter().find(|(k, _)| *k == key) {
            return Ok(o.clone());
        }
        let order = Arc::new(match stream {
            None => {
                let mut rng = ChaCha8Rng::seed_from_u64(self.seed.unwrap_or(0));
                rng.set_stream(epoch as u64);
                let mut order: Vec<usize> = (0..self.samples()).collect();
                order.shuffle(&mut rng);
                order
            }
            Some(r) => self.replica_stream(r, epoch),
        });
        // Two epochs of each stream: a batch spanning an epoch boundary needs both.
        let streams = self.owned.as_ref().map_or(1, Vec::len);
        if orders.len() >= 2 * streams {
            orders.remove(0);
        }
        orders.push((key, order.clone()));
        Ok(order)
    }

    /// Replica `r`'s samples in epoch `epoch`: its files, then each file's samples, in a
    /// seeded order (the files' own order without a seed).
    fn replica_stream(&self, r: usize, epoch: usize) -> Vec<usize> {
        let mut files = self.owned.as_ref().map_or_else(Vec::new, |o| o[r].clone());
        let mut out = Vec::with_capacity(self.stream_len(Some(r)));
        let Some(seed) = self.seed else {
            for f in files {
                out.extend(self.starts[f]..self.starts[f + 1]);
            }
            return out;
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(((r as u64) << 32) | epoch as u64);
        files.shuffle(&mut rng);
        for f in files {
            let mut within: Vec<usize> = (self.starts[f]..self.starts[f + 1]).collect();
            within.shuffle(&mut rng);
            out.extend(within);
        }
        out
    }

    /// The samples of part `part` of `parts` of step `step`: which stream, and where.
    pub(super) fn part_range(
        &self,
        step: usize,
        part: usize,
        parts: usize,
    ) -> Result<(Option<usize>, usize, usize)> {
        let uneven = |rows: usize, into: usize| Error::BadTensor {
            name: "(shard batch)".into(),
            reason: format!("{rows} rows do not split into {into} equal micro-batches"),
        };
        let (stream, rows, part) = match &self.owned {
            None => (None, self.batch, part),
            Some(o) => {
                let d = o.len();
                if parts % d != 0 {
                    return Err(uneven(self.batch, parts));
                }
                let per = parts / d;
                (Some(part / per), self.batch / d, part % per)
            }
        };
        let per = match &self.owned {
            None => parts,
            Some(o) => parts / o.len(),
        };
        if per == 0 || rows % per != 0 {
            return Err(uneven(rows, per));
        }
        let n = rows / per;
        let start = step
            .checked_mul(rows)
            .and_then(|s| s.checked_add(part * n))
            .ok_or_else(|| self.fail(format!("step {step}'s first sample is past usize::MAX")))?;
        Ok((stream, start, n))
    }

    /// The sample indices of `n` samples of `stream` from position `start`.
    pub(super) fn samples_at(
        &self,
        stream: Option<usize>,
        start: usize,
        n: usize,
    ) -> Result<Vec<usize>> {
        let total = self.stream_len(stream);
        let mut order: Option<(usize, Arc<Vec<usize>>)> = None;
        let mut out = Vec::with_capacity(n);
        for g in start..start + n {
            let (epoch, k) = (g / total, g % total);
            if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                order = Some((epoch, self.order_of((stream, epoch))?));
            }
            out.push(order.as_ref().map_or(k, |(_, o)| o[k]));
        }
        Ok(out)
    }

    /// The samples of part `part` of `parts` of step `step`, and the files the same part
    /// of the next [`READ_AHEAD_STEPS`] steps reads that this one does not.
    pub(super) fn part_samples(
        &self,
        step: usize,
        part: usize,
        parts: usize,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        let (stream, start, n) = self.part_range(step, part, parts)?;
        let now = self.samples_at(stream, start, n)?;
        // Once every file is decoded and kept (data sets up to 1 GiB, after the first
        // epoch), there is nothing to read ahead.
        if self.cache.holds_all() {
            return Ok((now, Vec::new()));
        }
        let files_now = self.files_of_samples(&now);
        let mut ahead = Vec::new();
        for later in step + 1..=step + READ_AHEAD_STEPS {
            if let Ok((s, start, n)) = self.part_range(later, part, parts) {
                for f in self.files_of_samples(&self.samples_at(s, start, n)?) {
                    if !files_now.contains(&f) && !ahead.contains(&f) {
                        ahead.push(f);
                    }
                }
            }
        }
        Ok((now, ahead))
    }

    /// The distinct files holding `samples`, in first-use order.
    pub(super) fn files_of_samples(&self, samples: &[usize]) -> Vec<usize> {
        let mut files = Vec::new();
        for &i in samples {
            let f = self.file_of(i);
            if !files.contains(&f) {
                files.push(f);
            }
        }
        files
    }

    pub(super) fn file_of(&self, sample: usize) -> usize {
        self.starts.partition_point(|&s| s <= sample) - 1
    }
}
