//! ZeRO stage 2 on a stage (`deepspeed_zero_stage = 2`, see `zero`): every micro-batch's
//! gradient graph runs as the chain of buckets, each piece writing its gradients into a
//! bucket of its own; the bucket goes to the stage actor's reduction to be
//! reduce-scattered while the next pieces run, and its sum comes straight back, where
//! this replica adds its own part into its gradients. Only that part of the gradient
//! buffer is ever written.
//!
//! At most [`IN_FLIGHT`] buckets are out at once: the backward waits for the oldest sum
//! before it sends another, so a reduction slower than the backward costs time, never
//! a stage's worth of buckets.

use std::collections::VecDeque;
use std::time::Duration;

use pipetrain_actors::GradBucket;

use super::buckets::ChainPiece;
use super::stage::{OrtStage, Payload};
use crate::compute::GraphSession;
use crate::{Error, Result};

/// Buckets sent and not yet summed, at most: one reducing, one on its way back, while a
/// third fills (and one spare buffer kept for the next).
pub(super) const IN_FLIGHT: usize = 2;

/// How often a wait for a sum checks that the reduction is still there.
const POLL: Duration = Duration::from_millis(200);

/// A stage's buckets on their way: where their sums come back, and whose they are.
pub(super) struct ZeroGrads {
    back: flume::Sender<Vec<f32>>,
    sums: flume::Receiver<Vec<f32>>,
    /// Per bucket out, oldest first: its parameters (layout indices, in layout order).
    in_flight: VecDeque<Vec<usize>>,
    /// A sum already added, refilled as the next bucket.
    spare: Option<Vec<f32>>,
}

impl ZeroGrads {
    pub(super) fn new() -> ZeroGrads {
        let (back, sums) = flume::unbounded();
        ZeroGrads {
            back,
            sums,
            in_flight: VecDeque::new(),
            spare: None,
        }
    }

    /// A buffer for a bucket of `len` values: the spare one, unless it is more than
    /// twice that (its pages would stay taken for nothing: a large tensor's bucket is
    /// freed once summed).
    fn spare_for(&mut self, len: usize) -> Vec<f32> {
        match self.spare.take() {
            Some(b) if b.capacity() <= 2 * len.max(1) => b,
            _ => Vec::with_capacity(len),
        }
    }

    /// Forgets what a failed step left out: a new step's buckets start afresh.
    pub(super) fn restart(&mut self) {
        self.in_flight.clear();
        self.sums.drain();
    }
}

/// The error of a bucket that cannot go out or whose sum does not come back.
fn lost(reason: String) -> Error {
    Error::BadTensor {
        name: "gradient buckets (deepspeed_zero_stage = 2)".into(),
        reason,
    }
}

impl OrtStage {
    /// One micro-batch's gradient graph (`session`, or the chain of its pieces), each
    /// piece's gradients sent as a bucket to be reduce-scattered.
    pub(super) fn run_sharded_grads(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Payload> {
        let sink = self.bucket_sink.clone().ok_or_else(|| {
            lost("a backward ran with no reduction to send its gradients to".into())
        })?;
        let mut chain = self.chain.take();
        let all: Vec<usize>;
        let pieces: Vec<ChainPiece<'_>> = match chain.as_mut() {
            Some(c) => c.pieces_mut().collect(),
            None => {
                all = (0..self.layout.count()).collect();
                vec![(session, &all, &[])]
            }
        };
        let result = self.send_pieces(pieces, sources, &sink);
        self.chain = chain;
        result
    }

    fn send_pieces(
        &mut self,
        pieces: Vec<ChainPiece<'_>>,
        sources: &[&Payload],
        sink: &flume::Sender<GradBucket>,
    ) -> Result<Payload> {
        let mut made = Payload::new();
        for (piece, params, spent) in pieces {
            let shapes = self.layout.shapes();
            let len: usize = params
                .iter()
                .map(|&i| shapes[i].iter().product::<usize>())
                .sum();
            let mut bucket = self.zero_grads_mut()?.spare_for(len);
            let rest = {
                let mut from: Vec<&Payload> = vec![&made];
                from.extend_from_slice(sources);
                self.run_into_bucket(piece, &from, &mut bucket, params)?
            };
            made.extend(rest);
            spent.iter().for_each(|n| drop(made.remove(n)));
            tracing::trace!(
                "handed on between pieces: {} values, {} MB: {:?}",
                made.len(),
                made.values().map(|t| t.bytes()).sum::<usize>() >> 20,
                made.iter()
                    .filter(|(_, t)| t.bytes() > 4 << 20)
                    .map(|(n, t)| (n, t.shape()))
                    .take(6)
                    .collect::<Vec<_>>()
            );
            self.wait_for_sums(IN_FLIGHT - 1, sink)?;
            let parts = (self.zero.as_ref()).map(|z| z.bucket_parts(&self.layout, params));
            let zg = self.zero_grads_mut()?;
            let out = GradBucket {
                values: bucket,
                parts,
                back: Some(zg.back.clone()),
            };
            zg.in_flight.push_back(params.to_vec());
            sink.send(out)
                .map_err(|_| lost("the reduction is gone".into()))?;
        }
        Ok(made)
    }

    /// Adds the sums that came back; then, while more than `most` buckets are out,
    /// waits for the oldest.
    fn wait_for_sums(&mut self, most: usize, sink: &flume::Sender<GradBucket>) -> Result<()> {
        loop {
            let zg = self.zero_grads_mut()?;
            let sum = match zg.sums.try_recv() {
                Ok(sum) => sum,
                Err(_) if zg.in_flight.len() <= most => return Ok(()),
                Err(_) => match zg.sums.recv_timeout(POLL) {
                    Ok(sum) => sum,
                    Err(_) if sink.is_disconnected() => {
                        return Err(lost("the reduction ended with buckets out".into()))
                    }
                    Err(_) => continue,
                },
            };
            self.add_own_sum(sum)?;
        }
    }

    /// Adds this replica's part of the oldest bucket's `sum` into its gradients.
    fn add_own_sum(&mut self, sum: Vec<f32>) -> Result<()> {
        let own = self.zero.as_ref().map_or(0..0, |z| z.own_tensors());
        let zg = self.zero_grads.as_mut().ok_or_else(not_sharded)?;
        let params = (zg.in_flight.pop_front())
            .ok_or_else(|| lost("a sum came back for no bucket sent".into()))?;
        let mut at = 0;
        for i in params {
            let n = self.layout.shapes()[i].iter().product::<usize>();
            let part = sum.get(at..at + n).ok_or_else(|| {
                lost(format!(
                    "a sum of {} values is short of its bucket",
                    sum.len()
                ))
            })?;
            at += n;
            if !own.contains(&i) {
                continue;
            }
            let acc = self.layout.slice_mut(&mut self.grads, i);
            if self.written[i] {
                acc.iter_mut().zip(part).for_each(|(a, x)| *a += x);
            } else {
                acc.copy_from_slice(part);
                self.written[i] = true;
            }
        }
        zg.spare.get_or_insert(sum);
        Ok(())
    }

    /// At the step's all-reduce, once the reduction has ended: every sum still to add.
    pub(super) fn put_sharded_sums(&mut self, kept: Vec<Vec<f32>>) -> Result<()> {
        if !kept.is_empty() {
            return Err(lost(format!(
                "{} sums handed back together; each should have come back alone",
                kept.len()
            )));
        }
        loop {
            let zg = self.zero_grads_mut()?;
            if zg.in_flight.is_empty() {
                // The update comes next and takes the most memory of the step: the
                // spare bucket, and what the backward freed, go back to the system.
                zg.spare = None;
                give_back_freed_memory();
                return Ok(());
            }
            let Ok(sum) = zg.sums.try_recv() else {
                return Err(lost(format!(
                    "{} buckets' sums never came back",
                    zg.in_flight.len()
                )));
            };
            self.add_own_sum(sum)?;
        }
    }

    fn zero_grads_mut(&mut self) -> Result<&mut ZeroGrads> {
        self.zero_grads.as_mut().ok_or_else(not_sharded)
    }
}

/// Hands the C allocator's free memory back to the system (glibc keeps what the
/// backward's threads freed in their arenas otherwise).
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn not_sharded() -> Error {
    lost("this stage does not shard its gradients".into())
}

/// How many bytes of `values` the kernel backs with memory now (`mincore` over the
/// pages they span): what ZeRO stage 2's gradient buffer really takes.
pub fn resident_bytes(values: &[f32]) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let start = values.as_ptr() as usize / page * page;
    let end = values.as_ptr() as usize + std::mem::size_of_val(values);
    if end <= start {
        return 0;
    }
    let pages = (end - start).div_ceil(page);
    let mut map = vec![0u8; pages];
    // SAFETY: the range covers `values`' pages, mapped by this process; `map` has one
    // byte per page.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, pages * page, map.as_mut_ptr()) };
    if rc != 0 {
        return std::mem::size_of_val(values);
    }
    map.iter().filter(|&&b| b & 1 == 1).count() * page
}
