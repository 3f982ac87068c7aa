//! Gradient reduction across the data-parallel replicas of a stage over the mesh, as a
//! ring: reduce-scatter (each replica ends holding one fully summed segment) then
//! all-gather (the segments go round). Each element is summed once, by one replica, and
//! copied to the others, so every replica gets the same bits; with two replicas the
//! sum is `a + b`, which is `b + a` in floating point, so it equals the in-process sum.
//! A replica sends a segment to the next and receives one from the previous at each of
//! the `2 (n - 1)` rounds: `2 (n - 1) / n` of the buffer crosses each link in all, the
//! bandwidth-optimal amount. Segments travel as pieces of [`PIECE`] values, each
//! added in as it arrives while the following ones are on the wire.
//!
//! A replica sends a segment only once the next one says it is ready to take it (a
//! frame of one byte back along the ring): otherwise a replica still busy elsewhere (its
//! backward, its part of the update) would find a whole segment queued in its memory
//! when it came to the round, half a stage's gradients or parameters at two replicas.

use std::sync::Arc;

use pipetrain_actors::{ActorError, Collective};

use super::chain::Chain;
use super::mesh::Mesh;
use super::{AllReduce, RING, RING_READY, RING_UP};

/// The ring collective of one worker.
pub struct MeshCollective {
    mesh: Arc<Mesh>,
    /// The node of each (replica, stage): `[replica][stage]`.
    placement: Vec<Vec<usize>>,
    /// Tensor shards per data-parallel replica: the same shard of every data-parallel
    /// replica forms one ring.
    shards: usize,
    /// The ring, or the chain in replica order (at three replicas or more).
    algorithm: AllReduce,
}

impl MeshCollective {
    /// The collective over `mesh`, with `placement[replica][stage]` the node that runs
    /// that member.
    pub fn new(mesh: Arc<Mesh>, placement: Vec<Vec<usize>>) -> MeshCollective {
        MeshCollective {
            mesh,
            placement,
            shards: 1,
            algorithm: AllReduce::Ring,
        }
    }

    /// Sums (all-reduces and reduce-scatters) by `algorithm`; all-gathers always go round
    /// the ring (copies, the same bits either way).
    pub fn with_algorithm(mut self, algorithm: AllReduce) -> MeshCollective {
        self.algorithm = algorithm;
        self
    }

    /// Replicas are `shards` consecutive tensor shards of each data-parallel replica;
    /// each shard reduces with the same shard of the others.
    pub fn with_shards(mut self, shards: usize) -> MeshCollective {
        self.shards = shards.max(1);
        self
    }

    /// The channel on which `replica` receives its ring segments for `stage`.
    fn channel(&self, stage: usize, replica: usize) -> u32 {
        RING + (stage * self.placement.len() + replica) as u32
    }

    /// The channel on which `replica` hears that the next replica is ready for its
    /// segment of `stage`.
    fn ready_channel(&self, stage: usize, replica: usize) -> u32 {
        RING_READY + (stage * self.placement.len() + replica) as u32
    }

    /// `replica`'s place in the chain of `stage` when sums go by the chain and it has
    /// three members or more (at two the ring's `a + b` is already exact).
    fn chain(&self, stage: usize, replica: usize) -> Option<Chain<'_>> {
        let shards = self.shards;
        let n = self.placement.len() / shards;
        if self.algorithm != AllReduce::Chain || n < 3 {
            return None;
        }
        let replica_at = |p: usize| p * shards + replica % shards;
        let at_stage =
            |base: u32, p: usize| base + (stage * self.placement.len() + replica_at(p)) as u32;
        Some(Chain {
            mesh: &self.mesh,
            at: replica / shards,
            n,
            nodes: (0..n)
                .map(|p| self.placement[replica_at(p)][stage])
                .collect(),
            down: (0..n).map(|p| at_stage(RING, p)).collect(),
            ready: (0..n).map(|p| at_stage(RING_READY, p)).collect(),
            up: (0..n).map(|p| at_stage(RING_UP, p)).collect(),
        })
    }
}

/// Values per frame: a segment goes as pieces of this many, so a replica adds one
/// piece while the next is on the wire, and no frame nears the mesh's maximum.
pub(super) const PIECE: usize = 1 << 20;

/// One replica's two ring neighbours, for one round.
struct Link<'a> {
    mesh: &'a Mesh,
    next_node: usize,
    prev_node: usize,
    to_next: u32,
    from_prev: u32,
    /// Where this replica tells the previous one it is ready, and hears the next is.
    ready_to_prev: u32,
    ready_from_next: u32,
}

impl Link<'_> {
    /// Sends `buf[send]` to the next replica while receiving the previous one's
    /// `buf[recv]` piece by piece, folding each piece in with `fold` as it arrives. The
    /// two ranges are disjoint segments.
    async fn exchange(
        &self,
        buf: &mut [f32],
        send: std::ops::Range<usize>,
        recv: std::ops::Range<usize>,
        fold: fn(&mut [f32], &[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        let (outgoing, incoming): (&[f32], &mut [f32]) = if send.end <= recv.start {
            let (a, b) = buf.split_at_mut(recv.start);
            (&a[send], &mut b[..recv.len()])
        } else {
            let (a, b) = buf.split_at_mut(send.start);
            (&b[..send.len()], &mut a[recv])
        };
        let sending = async {
            let ready = self.mesh.recv(self.next_node, self.ready_from_next).await?;
            self.mesh.recycle(ready);
            for piece in outgoing.chunks(PIECE) {
                let bytes = bytemuck::cast_slice::<f32, u8>(piece);
                self.mesh
                    .send_slice(self.next_node, self.to_next, bytes)
                    .await?;
            }
            Ok::<(), String>(())
        };
        let receiving = async {
            (self.mesh)
                .send_slice(self.prev_node, self.ready_to_prev, &[1])
                .await?;
            for piece in incoming.chunks_mut(PIECE) {
                let got = self.mesh.recv(self.prev_node, self.from_prev).await?;
                fold(piece, &got)?;
                self.mesh.recycle(got);
            }
            Ok::<(), String>(())
        };
        let (sent, received) = tokio::join!(sending, receiving);
        sent.and(received)
    }
}

/// The element range of segment `k` of `n` of a buffer of `len`.
fn segment(len: usize, n: usize, k: usize) -> std::ops::Range<usize> {
    (len * k / n)..(len * (k + 1) / n)
}

impl Collective for MeshCollective {
    async fn all_reduce_sum(
        &self,
        stage: usize,
        replica: usize,
        mut buf: Vec<f32>,
    ) -> Result<Vec<f32>, ActorError> {
        if let Some(chain) = self.chain(stage, replica) {
            chain.all_reduce(&mut buf).await?;
            return Ok(buf);
        }
        let n = self.placement.len() / self.shards;
        let len = buf.len();
        // Position p ends the reduce-scatter holding the full sum of segment p + 1.
        let parts: Vec<_> = (0..n).map(|p| segment(len, n, (p + 1) % n)).collect();
        let Some((link, at)) = self.ring_link(stage, replica, &parts, len)? else {
            return Ok(buf);
        };
        let gone = |reason: String| ActorError::Peer { reason };
        scatter_round(&link, &mut buf, &parts, at)
            .await
            .map_err(gone)?;
        // All-gather: pass the full segments round.
        gather_round(&link, &mut buf, &parts, at)
            .await
            .map_err(gone)?;
        Ok(buf)
    }

    async fn reduce_scatter(
        &self,
        stage: usize,
        replica: usize,
        mut buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        if let Some(chain) = self.chain(stage, replica) {
            self.check_parts(stage, replica, parts, buf.len())?;
            chain.reduce_scatter(&mut buf, parts).await?;
            return Ok(buf);
        }
        self.over_parts(stage, replica, buf, parts, Round::Scatter)
            .await
    }

    async fn all_gather(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        self.over_parts(stage, replica, buf, parts, Round::Gather)
            .await
    }
}

/// Which half of a ring all-reduce runs alone over given parts.
#[derive(Clone, Copy)]
enum Round {
    Scatter,
    Gather,
}

impl MeshCollective {
    /// `round` of the ring from `replica` over `parts` of `buf`.
    async fn over_parts(
        &self,
        stage: usize,
        replica: usize,
        mut buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
        round: Round,
    ) -> Result<Vec<f32>, ActorError> {
        let Some((link, at)) = self.ring_link(stage, replica, parts, buf.len())? else {
            return Ok(buf);
        };
        let done = match round {
            Round::Scatter => scatter_round(&link, &mut buf, parts, at).await,
            Round::Gather => gather_round(&link, &mut buf, parts, at).await,
        };
        done.map_err(|reason| ActorError::Peer { reason })?;
        Ok(buf)
    }

    /// The ring neighbours of `replica` for `stage` and its ring position, for a round
    /// over `parts` of a buffer of `len` values (`None`: a ring of one, nothing to do).
    fn ring_link(
        &self,
        stage: usize,
        replica: usize,
        parts: &[std::ops::Range<usize>],
        len: usize,
    ) -> Result<Option<(Link<'_>, usize)>, ActorError> {
        let shards = self.shards;
        let n = self.placement.len() / shards;
        if n <= 1 {
            return Ok(None);
        }
        self.check_parts(stage, replica, parts, len)?;
        let (shard, at) = (replica % shards, replica / shards);
        let next = ((at + 1) % n) * shards + shard;
        let prev = ((at + n - 1) % n) * shards + shard;
        let link = Link {
            mesh: &self.mesh,
            next_node: self.placement[next][stage],
            prev_node: self.placement[prev][stage],
            to_next: self.channel(stage, next),
            from_prev: self.channel(stage, replica),
            ready_to_prev: self.ready_channel(stage, prev),
            ready_from_next: self.ready_channel(stage, replica),
        };
        Ok(Some((link, at)))
    }
}

impl MeshCollective {
    /// Refuses `parts` that are not one disjoint range per member within `len` values.
    fn check_parts(
        &self,
        stage: usize,
        replica: usize,
        parts: &[std::ops::Range<usize>],
        len: usize,
    ) -> Result<(), ActorError> {
        let n = self.placement.len() / self.shards;
        let mut sorted = parts.to_vec();
        sorted.sort_by_key(|p| p.start);
        let disjoint = sorted.windows(2).all(|w| w[0].end <= w[1].start);
        if parts.len() != n || !disjoint || parts.iter().any(|p| p.start > p.end || p.end > len) {
            return Err(ActorError::Protocol {
                replica,
                rank: stage,
                reason: format!("parts {parts:?} are not {n} disjoint ranges within {len} values"),
            });
        }
        Ok(())
    }
}

/// The ring's reduce-scatter from position `at`, which ends holding the full sum of
/// `parts[at]`: at round k it passes on its running sum of part (at - k - 1) and adds
/// the previous position's running sum of part (at - k - 2) into its own.
async fn scatter_round(
    link: &Link<'_>,
    buf: &mut [f32],
    parts: &[std::ops::Range<usize>],
    at: usize,
) -> Result<(), String> {
    let n = parts.len();
    for k in 0..n - 1 {
        let send = parts[(at + 2 * n - k - 1) % n].clone();
        let recv = parts[(at + 2 * n - k - 2) % n].clone();
        link.exchange(buf, send, recv, add_into).await?;
    }
    Ok(())
}

/// The ring's all-gather from position `at`, which holds `parts[at]`: at round k it
/// passes on part (at - k) and takes part (at - k - 1) from the previous position, so
/// after `n - 1` rounds every position holds every part, copied from its owner.
async fn gather_round(
    link: &Link<'_>,
    buf: &mut [f32],
    parts: &[std::ops::Range<usize>],
    at: usize,
) -> Result<(), String> {
    let n = parts.len();
    for k in 0..n - 1 {
        let send = parts[(at + n - k) % n].clone();
        let recv = parts[(at + 2 * n - k - 1) % n].clone();
        link.exchange(buf, send, recv, copy_into).await?;
    }
    Ok(())
}

/// Checks that `bytes` holds `want` f32s.
fn check(bytes: &[u8], want: usize) -> Result<(), String> {
    if bytes.len() != want * 4 {
        return Err(format!(
            "{} bytes arrived where {} were due",
            bytes.len(),
            want * 4
        ));
    }
    Ok(())
}

/// `f(dst[i], x[i])` for the f32s `x` of `bytes` (little-endian): straight over the
/// bytes as f32s when they are aligned for it (large buffers from the allocator are),
/// so the loop vectorizes; decoded four bytes at a time otherwise.
fn fold_floats(dst: &mut [f32], bytes: &[u8], f: impl Fn(&mut f32, f32)) -> Result<(), String> {
    check(bytes, dst.len())?;
    match bytemuck::try_cast_slice::<u8, f32>(bytes) {
        Ok(xs) if cfg!(target_endian = "little") => {
            for (d, &x) in dst.iter_mut().zip(xs) {
                f(d, x);
            }
        }
        _ => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                f(d, f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
    }
    Ok(())
}

/// Adds the f32s of `bytes` into `dst` (of their length).
pub(super) fn add_into(dst: &mut [f32], bytes: &[u8]) -> Result<(), String> {
    // The running sum arrives from the previous replica (a + b == b + a in IEEE
    // arithmetic, so the order of the two operands does not matter).
    fold_floats(dst, bytes, |d, x| *d += x)
}

/// Copies the f32s of `bytes` into `dst` (of their length).
pub(super) fn copy_into(dst: &mut [f32], bytes: &[u8]) -> Result<(), String> {
    fold_floats(dst, bytes, |d, x| *d = x)
}
