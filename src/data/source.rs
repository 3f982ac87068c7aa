//! Where each step's global batch comes from: a data file ([`super::Batches`]), or a
//! service that embeds pipetrain and hands batches in ([`BatchSource`], e.g. through a
//! channel with [`ChannelBatches`]) without them ever touching a file.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pipetrain_actors::BoxError;

use crate::tensor::TensorMap;
use crate::{Error, Result};

/// The batches of a run's steps, as the pipeline reads them.
pub trait StepBatches: Send + Sync {
    /// The whole global batch of `step`.
    ///
    /// # Errors
    /// When the batch cannot be had (a closed source, malformed arrays).
    fn batch(&self, step: usize) -> Result<TensorMap>;

    /// Part `part` of `parts` equal parts (by rows) of `step`'s batch: a micro-batch of
    /// one replica.
    ///
    /// # Errors
    /// As [`StepBatches::batch`], and when the rows do not split evenly.
    fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        split_rows(&self.batch(step)?, part, parts)
    }

    /// Checks every value of the data against `rules` at once, where it is all in memory
    /// (`Ok(true)`); `Ok(false)` where batches must be checked as they are read.
    ///
    /// # Errors
    /// `Data` naming the first value a rule refuses.
    fn check_all(&self, rules: &[super::check::FeedRule]) -> Result<bool> {
        let _ = rules;
        Ok(false)
    }
}

/// Rows `part * n / parts ..` of every tensor of `batch`.
///
/// # Errors
/// `BadTensor` when a tensor's rows do not split into `parts`.
pub fn split_rows(batch: &TensorMap, part: usize, parts: usize) -> Result<TensorMap> {
    let mut out = TensorMap::new();
    for (name, t) in batch {
        let rows = t.shape.first().copied().unwrap_or(0);
        if parts == 0 || rows % parts != 0 {
            return Err(Error::BadTensor {
                name: name.clone(),
                reason: format!("{rows} rows do not split into {parts} equal micro-batches"),
            });
        }
        let n = rows / parts;
        let picked: Vec<usize> = (part * n..(part + 1) * n).collect();
        let mut part_t = t.gather_rows(&picked)?;
        part_t.shape[0] = n;
        out.insert(name.clone(), part_t);
    }
    Ok(out)
}

/// Training data from the service that embeds pipetrain: the global batch of every
/// optimizer step, each model input and the label by name, with the global batch's rows
/// (`batch_size x gradient_accumulation_steps x data_parallel_size`).
pub trait BatchSource: Send + Sync + 'static {
    /// The global batch of `step`. Steps are asked for in increasing order, from the
    /// run's first (a resumed run's checkpoint step); a step may be asked for again.
    ///
    /// # Errors
    /// Whatever stops the data; the run then fails naming the step.
    fn batch(&self, step: u64) -> std::result::Result<TensorMap, BoxError>;
}

/// A [`BatchSource`] fed through a channel: the service sends each step's global batch
/// in order; pipetrain takes them as the steps come. Closing the channel before the run's
/// last step fails the run at that step.
pub struct ChannelBatches {
    rx: flume::Receiver<TensorMap>,
    /// The next step to receive, and batches already received, by step; the oldest are
    /// dropped as the run moves on.
    received: Mutex<(u64, BTreeMap<u64, Arc<TensorMap>>)>,
    /// Set when the run ends: a reader waiting for the service's next batch gives up.
    stop: Arc<AtomicBool>,
}

/// Steps kept after they were first asked for: pipeline stages and replicas ask for the
/// same step at different moments, at most a few steps apart (data is prefetched two
/// steps ahead).
const KEEP_STEPS: u64 = 8;

/// How often a reader waiting on the service's channel looks at the stop flag.
const STOP_POLL: std::time::Duration = std::time::Duration::from_millis(20);

impl ChannelBatches {
    /// Batches from `rx`; the first one received is the batch of step `first` (0, or the
    /// step a resumed run starts at). Setting `stop` ends a wait for the next batch.
    pub fn new(
        rx: flume::Receiver<TensorMap>,
        first: u64,
        stop: Arc<AtomicBool>,
    ) -> ChannelBatches {
        ChannelBatches {
            rx,
            received: Mutex::new((first, BTreeMap::new())),
            stop,
        }
    }

    /// The next batch the service sends.
    fn receive(&self, step: u64) -> std::result::Result<TensorMap, BoxError> {
        loop {
            match self.rx.recv_timeout(STOP_POLL) {
                Ok(b) => return Ok(b),
                Err(flume::RecvTimeoutError::Timeout) if !self.stop.load(Ordering::Relaxed) => {}
                Err(flume::RecvTimeoutError::Timeout) => {
                    return Err(format!("the run ended before step {step}'s batch arrived").into())
                }
                Err(flume::RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "the batch channel closed before step {step}'s batch arrived"
                    )
                    .into())
                }
            }
        }
    }
}

impl BatchSource for ChannelBatches {
    fn batch(&self, step: u64) -> std::result::Result<TensorMap, BoxError> {
        let mut guard = self.received.lock().map_err(|_| "a data reader panicked")?;
        let (next, kept) = &mut *guard;
        if let Some(b) = kept.get(&step) {
            return Ok((**b).clone());
        }
        if step < *next {
            return Err(format!("step {step}'s batch was already dropped").into());
        }
        while *next <= step {
            let b = self.receive(*next)?;
            kept.insert(*next, Arc::new(b));
            *next += 1;
        }
        while kept.len() as u64 > KEEP_STEPS {
            kept.pop_first();
        }
        let b = kept.get(&step).ok_or("step dropped")?;
        Ok((**b).clone())
    }
}

/// An embedder's [`BatchSource`] as the pipeline reads it: each step's batch is asked for
/// once, however many micro-batches, replicas and stages read it (the last few steps are
/// kept), and a source that panics fails the run with its message instead of taking a
/// thread down (and is not asked for that step again).
pub struct FedBatches {
    source: Arc<dyn BatchSource>,
    /// Recent steps' batches, or the error each gave.
    kept: Mutex<BTreeMap<u64, std::result::Result<Arc<TensorMap>, String>>>,
}

impl FedBatches {
    /// Reads `source`.
    pub fn new(source: Arc<dyn BatchSource>) -> FedBatches {
        FedBatches {
            source,
            kept: Mutex::new(BTreeMap::new()),
        }
    }

    fn shared(&self, step: usize) -> Result<Arc<TensorMap>> {
        let failed = |reason: String| Error::Data {
            path: "<embedder's data>".into(),
            what: format!("step {step}"),
            reason,
        };
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let got = kept.entry(step as u64).or_insert_with(|| {
            let read = || self.source.batch(step as u64);
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
                Ok(Ok(b)) => Ok(Arc::new(b)),
                Ok(Err(e)) => Err(e.to_string()),
                Err(p) => Err(format!(
                    "the batch source panicked: {}",
                    pipetrain_actors::panic_text(&*p)
                )),
            }
        });
        let got = got.clone().map_err(failed);
        while kept.len() as u64 > KEEP_STEPS {
            kept.pop_first();
        }
        got
    }
}

impl StepBatches for FedBatches {
    fn batch(&self, step: usize) -> Result<TensorMap> {
        Ok((*self.shared(step)?).clone())
    }

    fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        let batch = self.shared(step)?;
        split_rows(&batch, part, parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    fn batch(v: i64) -> TensorMap {
        TensorMap::from([(
            "x".to_string(),
            Tensor::i64(vec![4, 1], vec![v, v + 1, v + 2, v + 3]).unwrap(),
        )])
    }

    #[test]
    fn channel_batches_come_in_step_order_and_can_be_asked_again() {
        let (tx, rx) = flume::unbounded();
        for s in 0..3 {
            tx.send(batch(10 * s)).unwrap();
        }
        let src = ChannelBatches::new(rx, 5, Arc::default());
        assert_eq!(src.batch(6).unwrap()["x"].as_i64().unwrap()[0], 10);
        assert_eq!(src.batch(5).unwrap()["x"].as_i64().unwrap()[0], 0);
        assert_eq!(src.batch(6).unwrap()["x"].as_i64().unwrap()[0], 10);
        assert_eq!(src.batch(7).unwrap()["x"].as_i64().unwrap()[0], 20);
        drop(tx);
        let e = src.batch(8).unwrap_err().to_string();
        assert!(e.contains("closed before step 8"), "{e}");
    }

    #[test]
    fn parts_split_rows() {
        let p = split_rows(&batch(0), 1, 2).unwrap();
        assert_eq!(p["x"].as_i64().unwrap(), &[2, 3]);
        assert!(split_rows(&batch(0), 0, 3).is_err());
    }
}
