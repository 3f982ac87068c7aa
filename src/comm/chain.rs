//! Gradient reduction across the data-parallel replicas of a stage in replica order
//! (`runtime.all_reduce = "chain"`): the sum a launched job makes is bitwise the one a
//! single process makes, `((g0 + g1) + g2) + ...`, at any number of replicas.
//!
//! That order fixes the path: every value's running sum must go through replica 0, 1,
//! ..., n - 1 in turn, each adding its own. So the buffer streams down the chain piece
//! by piece ([`PIECE`] values), each replica adding its piece into the one it receives
//! and passing it on while the next is on the wire; the last replica holds the totals
//! and sends each piece back up the chain as soon as it has it (an all-reduce), or to
//! the part's owner (a reduce-scatter). Both directions run at once, on opposite
//! directions of the same connections. A node within the chain sends and receives the
//! buffer twice, against the ring's `2 (n - 1) / n`: `n / (n - 1)` of its bytes (at two
//! replicas the same bytes, but the ring is exact there and stays).
//!
//! A replica adds its own values into the received piece (`partial + own`, the order of a
//! single process's sum; IEEE addition is commutative), so its own buffer is written only
//! with totals: a reduce-scatter leaves the other parts as they were, as in one process.
//! As in the ring, a replica sends its first piece only once the next says it is ready.

use pipetrain_actors::ActorError;

use super::mesh::Mesh;
use super::ring::{add_into, copy_into};

/// Values per piece of the chain (256 KiB): a chain of n replicas takes about
/// `pieces + 2 (n - 1)` piece times, so its pieces are smaller than the ring's segments'
/// (`ring::PIECE`). On loopback at four processes, 2^14, 2^16, 2^17 and 2^20 values gave
/// 1.64x, 1.11x, 1.14x and 1.37x the ring's time at 1 MB, 1.26x, 1.00x, 0.98x and 1.08x
/// at 64 MB (`cargo bench --features cli --bench comm`).
const PIECE: usize = 1 << 16;

/// One replica's place in the chain of a stage's replicas, and the channels it uses.
pub(super) struct Chain<'a> {
    pub(super) mesh: &'a Mesh,
    /// Its position, and the number of replicas.
    pub(super) at: usize,
    pub(super) n: usize,
    /// The node of each position.
    pub(super) nodes: Vec<usize>,
    /// Where position `p` receives running sums (from `p - 1`), hears that `p + 1` is
    /// ready, and receives totals.
    pub(super) down: Vec<u32>,
    pub(super) ready: Vec<u32>,
    pub(super) up: Vec<u32>,
}

/// What the chain leaves where: every position gets the totals, or position `p` those
/// of `parts[p]` (and the rest of its buffer stays its own).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ends {
    Everyone,
    Owners,
}

impl Chain<'_> {
    /// The whole buffer summed in replica order, the totals on every position.
    pub(super) async fn all_reduce(&self, buf: &mut [f32]) -> Result<(), ActorError> {
        let whole = 0..buf.len();
        self.run(buf, std::slice::from_ref(&whole), Ends::Everyone)
            .await
    }

    /// `parts[p]` summed in replica order onto position `p`.
    pub(super) async fn reduce_scatter(
        &self,
        buf: &mut [f32],
        parts: &[std::ops::Range<usize>],
    ) -> Result<(), ActorError> {
        self.run(buf, parts, Ends::Owners).await
    }

    async fn run(
        &self,
        buf: &mut [f32],
        parts: &[std::ops::Range<usize>],
        ends: Ends,
    ) -> Result<(), ActorError> {
        let pieces = pieces(buf, parts);
        let (keep, kept) = tokio::sync::mpsc::unbounded_channel();
        let down = self.stream_down(pieces, ends, keep);
        let up = self.take_totals(kept, ends);
        let (down, up) = tokio::join!(down, up);
        down.and(up).map_err(|reason| ActorError::Peer { reason })
    }

    /// Passes the running sum of every piece down the chain (in order), and hands on
    /// each piece of its own buffer that is to receive totals to `keep`.
    async fn stream_down<'b>(
        &self,
        pieces: Vec<(usize, &'b mut [f32])>,
        ends: Ends,
        keep: tokio::sync::mpsc::UnboundedSender<&'b mut [f32]>,
    ) -> Result<(), String> {
        let (at, last) = (self.at, self.n - 1);
        if at > 0 {
            let prev = self.nodes[at - 1];
            self.mesh.send_slice(prev, self.ready[at - 1], &[1]).await?;
        }
        if at < last {
            let ready = self.mesh.recv(self.nodes[at + 1], self.ready[at]).await?;
            self.mesh.recycle(ready);
        }
        for (part, piece) in pieces {
            if at == 0 {
                self.mesh
                    .send_slice(self.nodes[1], self.down[1], bytemuck::cast_slice(piece))
                    .await?;
            } else {
                let mut got = self.mesh.recv(self.nodes[at - 1], self.down[at]).await?;
                match (at == last, ends) {
                    (true, Ends::Everyone) => {
                        add_into(piece, &got)?;
                        let bytes = bytemuck::cast_slice(piece);
                        self.mesh
                            .send_slice(self.nodes[at - 1], self.up[at - 1], bytes)
                            .await?;
                    }
                    (true, Ends::Owners) if part == at => add_into(piece, &got)?,
                    (true, Ends::Owners) => {
                        add_own(&mut got, piece)?;
                        self.mesh
                            .send_slice(self.nodes[part], self.up[part], &got)
                            .await?;
                    }
                    (false, _) => {
                        add_own(&mut got, piece)?;
                        self.mesh
                            .send_slice(self.nodes[at + 1], self.down[at + 1], &got)
                            .await?;
                    }
                }
                self.mesh.recycle(got);
            }
            let takes_totals = match ends {
                Ends::Everyone => at < last,
                Ends::Owners => part == at && at < last,
            };
            if takes_totals {
                // The receiver lives until `take_totals` ends, which is joined with this.
                let _ = keep.send(piece);
            }
        }
        Ok(())
    }

    /// Receives the totals of the pieces `kept` hands on, in order, copying them into
    /// the pieces and, in an all-reduce, passing them on up the chain.
    async fn take_totals(
        &self,
        mut kept: tokio::sync::mpsc::UnboundedReceiver<&mut [f32]>,
        ends: Ends,
    ) -> Result<(), String> {
        let at = self.at;
        let from = match ends {
            Ends::Everyone => at + 1,
            Ends::Owners => self.n - 1,
        };
        while let Some(piece) = kept.recv().await {
            let got = self.mesh.recv(self.nodes[from], self.up[at]).await?;
            if ends == Ends::Everyone && at > 0 {
                self.mesh
                    .send_slice(self.nodes[at - 1], self.up[at - 1], &got)
                    .await?;
            }
            copy_into(piece, &got)?;
            self.mesh.recycle(got);
        }
        Ok(())
    }
}

/// The pieces of `buf` the chain streams, in order: each part cut into [`PIECE`]s, with
/// the part's index.
fn pieces<'b>(
    mut buf: &'b mut [f32],
    parts: &[std::ops::Range<usize>],
) -> Vec<(usize, &'b mut [f32])> {
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&p| parts[p].start);
    let mut out = Vec::new();
    let mut consumed = 0;
    for p in order {
        let range = parts[p].clone();
        let rest = std::mem::take(&mut buf);
        let (_, tail) = rest.split_at_mut(range.start - consumed);
        let (part, after) = tail.split_at_mut(range.len());
        buf = after;
        consumed = range.end;
        out.extend(part.chunks_mut(PIECE).map(|piece| (p, piece)));
    }
    out
}

/// Adds `own` into the f32s of `bytes` (a running sum received: `partial + own`).
fn add_own(bytes: &mut [u8], own: &[f32]) -> Result<(), String> {
    if bytes.len() != own.len() * 4 {
        return Err(format!(
            "{} bytes arrived where {} were due",
            bytes.len(),
            own.len() * 4
        ));
    }
    match bytemuck::try_cast_slice_mut::<u8, f32>(bytes) {
        Ok(sums) if cfg!(target_endian = "little") => {
            for (s, &x) in sums.iter_mut().zip(own) {
                *s += x;
            }
        }
        _ => {
            for (c, &x) in bytes.chunks_exact_mut(4).zip(own) {
                let s = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + x;
                c.copy_from_slice(&s.to_le_bytes());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_follow_the_parts_in_buffer_order_and_cover_them_only() {
        let mut buf: Vec<f32> = (0..(2 * PIECE + 10)).map(|i| i as f32).collect();
        let len = buf.len();
        // Parts given out of order, one empty, a gap before the last.
        let parts = vec![PIECE + 5..len, 0..PIECE + 3, PIECE + 4..PIECE + 4];
        let got: Vec<(usize, f32, usize)> = pieces(&mut buf, &parts)
            .into_iter()
            .map(|(p, s)| (p, s[0], s.len()))
            .collect();
        let want = vec![
            (1, 0.0, PIECE),
            (1, PIECE as f32, 3),
            (0, (PIECE + 5) as f32, PIECE),
            (0, (2 * PIECE + 5) as f32, 5),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn a_running_sum_adds_own_values_after_the_received_ones() {
        let partial = [1.0f32, 1e8, -3.5];
        let own = [2.0f32, 1.0, 0.25];
        let mut bytes: Vec<u8> = bytemuck::cast_slice(&partial).to_vec();
        add_own(&mut bytes, &own).unwrap();
        let sums: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(sums, vec![3.0, 1e8, -3.25]);
        assert!(add_own(&mut bytes[..8], &own).is_err());
    }
}
