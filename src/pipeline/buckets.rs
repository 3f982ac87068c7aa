//! A stage's gradient buckets (see [`crate::graph::GradChain`]): on the step's last
//! contribution to its gradients, the stage runs its gradient graph as a chain of
//! pieces instead of one session, and after each piece sends that piece's gradients,
//! now final, to the reduction the stage actor started (`reduce_buckets_into`). Other
//! micro-batches run the single session: the chain costs a hand-over of the values
//! crossing between pieces, paid only once a step.

use std::collections::HashMap;

use crate::compute::{GraphSession, Runtime, SessionOptions, ShardLink};
use crate::graph::{grad_chain, Graph, TrainingGraph};
use crate::pipeline::stage::{OrtStage, Payload};
use crate::{Error, Result};

/// The pieces of a stage's gradient graph and the parameters each completes.
pub(super) struct Chain {
    pieces: Vec<GraphSession>,
    /// Per piece: the parameter indices (in the stage's layout) of its bucket. The last
    /// bucket also holds the parameters no piece computes a gradient for (zero).
    params: Vec<Vec<usize>>,
    /// Last step's sums, refilled as this step's buckets (no fresh pages each step).
    spare: Vec<Vec<f32>>,
}

impl Chain {
    /// The chain of `g` (the graph giving the stage's parameter gradients) in buckets of
    /// about `bucket_bytes`; `None` when the gradients fit one bucket.
    ///
    /// # Errors
    /// `Ort` when a piece's session cannot be made. (A graph that cannot be cut, for
    /// want of a crossing value's type, keeps its gradients in one bucket, with a
    /// warning.)
    pub(super) fn new(
        rt: &Runtime,
        tg: &TrainingGraph,
        g: &Graph,
        (opts, link): (&SessionOptions, Option<&ShardLink>),
        slots: &HashMap<String, usize>,
        sizes: &[usize],
        bucket_bytes: usize,
    ) -> Result<Option<Chain>> {
        let bytes: HashMap<String, usize> = slots
            .iter()
            .map(|(n, &i)| (n.clone(), sizes[i] * 4))
            .collect();
        let chain = match grad_chain(tg, g, &bytes, bucket_bytes) {
            Ok(Some(chain)) => chain,
            Ok(None) => return Ok(None),
            // Training stays right with one reduction after the backward.
            Err(e) => {
                tracing::warn!("{}: gradients in one bucket: {e}", g.name);
                return Ok(None);
            }
        };
        let mut params: Vec<Vec<usize>> = chain
            .buckets
            .iter()
            .map(|grads| grads.iter().map(|n| slots[n]).collect())
            .collect();
        let covered: std::collections::HashSet<usize> = params.iter().flatten().copied().collect();
        if let Some(last) = params.last_mut() {
            last.extend((0..sizes.len()).filter(|i| !covered.contains(i)));
        }
        let pieces = chain
            .pieces
            .iter()
            .map(|p| GraphSession::for_shard(rt, p, opts, &p.name, link))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            "{}: gradients in {} buckets of {:?} parameters",
            g.name,
            pieces.len(),
            params.iter().map(Vec::len).collect::<Vec<_>>()
        );
        Ok(Some(Chain {
            pieces,
            params,
            spare: Vec::new(),
        }))
    }
}

impl OrtStage {
    /// Runs `session`, a graph giving parameter gradients, for one micro-batch: on the
    /// step's last one, while a reduction waits for buckets, as the chain.
    pub(super) fn run_grads(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Payload> {
        self.contributions += 1;
        let last = self.contributions == self.settings.micro_batches;
        match (last, self.chain.take(), self.bucket_sink.clone()) {
            (true, Some(mut chain), Some(sink)) => {
                let result = self.run_chain(&mut chain, sources, &sink);
                self.chain = Some(chain);
                result
            }
            (_, chain, _) => {
                self.chain = chain;
                self.run(session, sources)
            }
        }
    }

    fn run_chain(
        &mut self,
        chain: &mut Chain,
        sources: &[&Payload],
        sink: &flume::Sender<Vec<f32>>,
    ) -> Result<Payload> {
        let mut made = Payload::new();
        let last = chain.pieces.len() - 1;
        for (k, piece) in chain.pieces.iter_mut().enumerate() {
            let rest = {
                let mut from: Vec<&Payload> = vec![&made];
                from.extend_from_slice(sources);
                self.run(piece, &from)?
            };
            made.extend(rest);
            if k == last {
                self.complete_grads();
            }
            let mut bucket = chain.spare.pop().unwrap_or_default();
            bucket.clear();
            for &i in &chain.params[k] {
                bucket.extend_from_slice(self.layout.slice(&self.grads, i));
            }
            sink.send(bucket).map_err(|_| Error::BadTensor {
                name: format!("gradient bucket {k}"),
                reason: "its reduction is gone".into(),
            })?;
        }
        self.sent_buckets = chain.params.len();
        Ok(made)
    }

    /// Writes the reduced buckets back into the gradient accumulators.
    pub(super) fn put_bucket_sums(&mut self, sums: Vec<Vec<f32>>) -> Result<()> {
        let chain = self.chain.as_mut().filter(|c| c.params.len() == sums.len());
        let Some(chain) = chain.filter(|_| self.sent_buckets == sums.len()) else {
            return Err(Error::BadTensor {
                name: "gradient buckets".into(),
                reason: format!("{} sums for {} buckets sent", sums.len(), self.sent_buckets),
            });
        };
        for (params, sum) in chain.params.iter().zip(&sums) {
            let mut at = 0;
            for &i in params {
                let acc = self.layout.slice_mut(&mut self.grads, i);
                let next = at + acc.len();
                let part = sum.get(at..next).ok_or_else(|| Error::BadTensor {
                    name: "gradient buckets".into(),
                    reason: format!("a sum of {} values is short", sum.len()),
                })?;
                acc.copy_from_slice(part);
                at = next;
            }
        }
        // Reversed, so bucket k pops the buffer it filled last step (of its own size).
        chain.spare = sums;
        chain.spare.reverse();
        self.sent_buckets = 0;
        Ok(())
    }
}
