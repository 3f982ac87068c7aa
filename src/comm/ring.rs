//! Gradient reduction across the data-parallel replicas of a stage over the mesh, as a
//! ring: reduce-scatter (each replica ends holding one fully summed segment) then
//! all-gather (the segments go round). Each element is summed once, by one replica, and
//! copied to the others, so every replica gets the same bits; with two replicas the
//! sum is `a + b`, which is `b + a` in floating point, so it equals the in-process sum.
//! A replica sends a segment to the next and receives one from the previous at each of
//! the `2 (n - 1)` rounds: `2 (n - 1) / n` of the buffer crosses each link in all, the
//! bandwidth-optimal amount.

use std::sync::Arc;

use pipetrain_actors::{ActorError, Collective};

use super::mesh::Mesh;
use super::RING;

/// The ring collective of one worker.
pub struct MeshCollective {
    mesh: Arc<Mesh>,
    /// The node of each (replica, stage): `[replica][stage]`.
    placement: Vec<Vec<usize>>,
}

impl MeshCollective {
    /// The collective over `mesh`, with `placement[replica][stage]` the node that runs
    /// that member.
    pub fn new(mesh: Arc<Mesh>, placement: Vec<Vec<usize>>) -> MeshCollective {
        MeshCollective { mesh, placement }
    }

    /// The channel on which `replica` receives its ring segments for `stage`.
    fn channel(&self, stage: usize, replica: usize) -> u32 {
        RING + (stage * self.placement.len() + replica) as u32
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
        let n = self.placement.len();
        if n <= 1 {
            return Ok(buf);
        }
        let gone = |reason: String| ActorError::Peer { reason };
        let (next, prev) = ((replica + 1) % n, (replica + n - 1) % n);
        let next_node = self.placement[next][stage];
        let prev_node = self.placement[prev][stage];
        let (to_next, from_prev) = (self.channel(stage, next), self.channel(stage, replica));
        let len = buf.len();
        let bytes = |s: &[f32]| bytemuck::cast_slice::<f32, u8>(s).to_vec();
        // Reduce-scatter: at round k, pass on segment (replica - k) and add the previous
        // replica's running sum of segment (replica - k - 1) into ours.
        for k in 0..n - 1 {
            let send = segment(len, n, (replica + n - k) % n);
            self.mesh
                .send(next_node, to_next, bytes(&buf[send]))
                .await
                .map_err(gone)?;
            let recv = segment(len, n, (replica + 2 * n - k - 1) % n);
            let got = self.mesh.recv(prev_node, from_prev).await.map_err(gone)?;
            add_into(&mut buf[recv], &got).map_err(gone)?;
        }
        // All-gather: replica r holds the full sum of segment r + 1; pass the full
        // segments round.
        for k in 0..n - 1 {
            let send = segment(len, n, (replica + 1 + n - k) % n);
            self.mesh
                .send(next_node, to_next, bytes(&buf[send]))
                .await
                .map_err(gone)?;
            let recv = segment(len, n, (replica + n - k) % n);
            let got = self.mesh.recv(prev_node, from_prev).await.map_err(gone)?;
            copy_into(&mut buf[recv], &got).map_err(gone)?;
        }
        Ok(buf)
    }
}

/// The f32s of `bytes`, which must be `want` of them.
fn floats(bytes: &[u8], want: usize) -> Result<impl Iterator<Item = f32> + '_, String> {
    if bytes.len() != want * 4 {
        return Err(format!(
            "a ring segment of {} bytes arrived where {} were due",
            bytes.len(),
            want * 4
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

fn add_into(dst: &mut [f32], bytes: &[u8]) -> Result<(), String> {
    let xs = floats(bytes, dst.len())?;
    for (d, x) in dst.iter_mut().zip(xs) {
        // The running sum arrives from the previous replica (a + b == b + a in IEEE
        // arithmetic, so the order of the two operands does not matter).
        *d += x;
    }
    Ok(())
}

fn copy_into(dst: &mut [f32], bytes: &[u8]) -> Result<(), String> {
    let xs = floats(bytes, dst.len())?;
    for (d, x) in dst.iter_mut().zip(xs) {
        *d = x;
    }
    Ok(())
}
