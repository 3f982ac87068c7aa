//! A stage's gradient buckets (see [`crate::graph::GradChain`]): on the step's last
//! contribution to its gradients, the stage runs its gradient graph as a chain of
//! pieces instead of one session, and after each piece sends that piece's gradients,
//! now final, to the reduction the stage actor started (`reduce_buckets_into`). Other
//! micro-batches run the single session: the chain costs a hand-over of the values
//! crossing between pieces, paid only once a step.

use std::collections::HashMap;

use pipetrain_actors::GradBucket;

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
    /// Per piece: the values handed between pieces that no later piece reads, and that
    /// are not the graph's own outputs (dropped once the piece has run).
    spent: Vec<Vec<String>>,
}

/// A piece of a chain: its session, its bucket's parameters, what it last reads.
pub(super) type ChainPiece<'a> = (&'a mut GraphSession, &'a [usize], &'a [String]);

impl Chain {
    /// The chain of `g` (the graph giving the stage's parameter gradients) in buckets of
    /// about `bucket_bytes` (of parameters of `sizes` values); `None` when the gradients
    /// fit one bucket. Each bucket's parameters in the order the backward completes
    /// them, or `in_layout_order` (where the bucket is cut into the replicas' parts).
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
        (sizes, bucket_bytes): (&[usize], usize),
        in_layout_order: bool,
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
        if in_layout_order {
            params.iter_mut().for_each(|p| p.sort_unstable());
        }
        let spent = spent_after(g, &chain.pieces);
        let pieces = chain
            .pieces
            .iter()
            .map(|p| {
                let mut piece = GraphSession::for_shard(rt, p, opts, &p.name, link)?;
                piece.shrink_arena_after_runs()?;
                Ok(piece)
            })
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
            spent,
        }))
    }
}

/// Per piece of `g`: the values it reads that no later piece reads and `g` does not
/// output.
fn spent_after(g: &Graph, pieces: &[Graph]) -> Vec<Vec<String>> {
    let kept: std::collections::HashSet<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (k, p) in pieces.iter().enumerate() {
        for i in &p.inputs {
            last.insert(i.name.as_str(), k);
        }
    }
    let mut spent = vec![Vec::new(); pieces.len()];
    for (name, k) in last {
        if !kept.contains(name) {
            spent[k].push(name.to_string());
        }
    }
    spent
}

impl Chain {
    /// Each piece with the parameters (layout indices) of its bucket and the values
    /// it is the last to read.
    pub(super) fn pieces_mut(&mut self) -> impl Iterator<Item = ChainPiece<'_>> {
        let parts = self.params.iter().zip(&self.spent);
        (self.pieces.iter_mut())
            .zip(parts)
            .map(|(session, (params, spent))| (session, params.as_slice(), spent.as_slice()))
    }
}

impl OrtStage {
    /// Runs `session`, a graph giving parameter gradients, for one micro-batch: on the
    /// step's last one, while a reduction waits for buckets, as the chain (on every
    /// micro-batch where the gradients are sharded, `zero_grads`).
    pub(super) fn run_grads(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Payload> {
        self.contributions += 1;
        if self.zero_grads.is_some() {
            return self.run_sharded_grads(session, sources);
        }
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
        sink: &flume::Sender<GradBucket>,
    ) -> Result<Payload> {
        let mut made = Payload::new();
        let last = chain.pieces.len() - 1;
        let Chain {
            pieces,
            params,
            spare,
            spent,
        } = chain;
        for (k, piece) in pieces.iter_mut().enumerate() {
            let rest = {
                let mut from: Vec<&Payload> = vec![&made];
                from.extend_from_slice(sources);
                self.run(piece, &from)?
            };
            made.extend(rest);
            spent[k].iter().for_each(|n| drop(made.remove(n)));
            if k == last {
                self.complete_grads();
            }
            let mut bucket = spare.pop().unwrap_or_default();
            bucket.clear();
            for &i in &params[k] {
                bucket.extend_from_slice(self.layout.slice(&self.grads, i));
            }
            sink.send(GradBucket::all_reduced(bucket))
                .map_err(|_| Error::BadTensor {
                    name: format!("gradient bucket {k}"),
                    reason: "its reduction is gone".into(),
                })?;
        }
        self.sent_buckets = params.len();
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
