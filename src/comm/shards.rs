//! The tensor shards' all-reduce over the mesh, for shards of one group that run on
//! several nodes (see [`crate::compute::ShardComm`]).
//!
//! Every shard sends its tensor to every other shard of its group and sums the group's
//! tensors in shard order, so every shard gets the same bits, the same ones the
//! in-process group gives. Tensor-parallel groups are small (2 to 8 shards) and their
//! tensors are activations, so the all-to-all costs `hp - 1` sends per shard, like the
//! ring's `2 (hp - 1) / hp` of the bytes in fewer, larger messages. A shard on the same
//! node as another goes through memory.
//!
//! The kernel that calls it runs on a stage actor's thread, outside the runtime's
//! workers: the exchange runs as a task on the runtime, and the kernel waits for it.

use std::sync::Arc;
use std::time::Duration;

use super::mesh::Mesh;
use super::ring::{add_into, copy_into};
use super::TENSOR_SHARDS;
use crate::compute::{ShardComm, ShardLink, ShardTraffic, TrafficMeter};

/// Where every tensor shard group of a job runs, to hand each local shard its link.
#[derive(Clone)]
pub struct MeshShardGroups {
    mesh: Arc<Mesh>,
    /// The node of each (engine replica, stage): `[replica][stage]`.
    placement: Vec<Vec<usize>>,
    shards: usize,
    runtime: tokio::runtime::Handle,
    patience: Duration,
}

impl MeshShardGroups {
    /// The groups of `shards` consecutive engine replicas over `mesh`, with
    /// `placement[replica][stage]` the node that runs that member; a shard waits at
    /// most `patience` for the others. Call from within the runtime that runs the mesh.
    pub fn new(
        mesh: Arc<Mesh>,
        placement: Vec<Vec<usize>>,
        shards: usize,
        patience: Duration,
    ) -> MeshShardGroups {
        MeshShardGroups {
            mesh,
            placement,
            shards,
            runtime: tokio::runtime::Handle::current(),
            patience,
        }
    }

    /// The link of `stage` of engine replica `replica` (tensor shard `replica % shards`
    /// of data-parallel replica `replica / shards`).
    pub fn link(&self, replica: usize, stage: usize) -> ShardLink {
        let (dp, rank) = (replica / self.shards, replica % self.shards);
        let groups = self.placement.len() / self.shards.max(1);
        let nodes = (0..self.shards)
            .map(|k| self.placement[dp * self.shards + k][stage])
            .collect();
        ShardLink(Arc::new(MeshShard {
            mesh: self.mesh.clone(),
            nodes,
            rank,
            base: TENSOR_SHARDS + ((stage * groups + dp) * self.shards * self.shards) as u32,
            runtime: self.runtime.clone(),
            patience: self.patience,
            meter: TrafficMeter::default(),
        }))
    }
}

impl crate::compute::ShardGroups for MeshShardGroups {
    fn link(&self, replica: usize, stage: usize) -> ShardLink {
        MeshShardGroups::link(self, replica, stage)
    }
}

struct MeshShard {
    mesh: Arc<Mesh>,
    /// The node of each shard of the group.
    nodes: Vec<usize>,
    rank: usize,
    /// Channel `base + receiver * shards + sender` carries one pair's tensors.
    base: u32,
    runtime: tokio::runtime::Handle,
    patience: Duration,
    meter: TrafficMeter,
}

impl MeshShard {
    fn channel(&self, to: usize, from: usize) -> u32 {
        self.base + (to * self.nodes.len() + from) as u32
    }
}

impl ShardComm for MeshShard {
    fn shards(&self) -> usize {
        self.nodes.len()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn traffic(&self) -> ShardTraffic {
        self.meter.read()
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), String> {
        let start = std::time::Instant::now();
        self.exchange(buf)?;
        self.meter.count(buf.len(), start);
        Ok(())
    }
}

impl MeshShard {
    /// Sends this shard's tensor to the others, and sums theirs in in shard order.
    fn exchange(&self, buf: &mut [f32]) -> Result<(), String> {
        let n = self.nodes.len();
        let (me, mesh) = (self.rank, self.mesh.clone());
        let bytes = bytemuck::cast_slice::<f32, u8>(buf).to_vec();
        let sends: Vec<(usize, u32)> = (0..n)
            .filter(|&k| k != me)
            .map(|k| (self.nodes[k], self.channel(k, me)))
            .collect();
        let recvs: Vec<(usize, u32)> = (0..n)
            .filter(|&k| k != me)
            .map(|k| (self.nodes[k], self.channel(me, k)))
            .collect();
        let (tx, rx) = flume::bounded(1);
        self.runtime.spawn(async move {
            let exchange = async {
                for (node, ch) in sends {
                    mesh.send(node, ch, bytes.clone()).await?;
                }
                let mut got = Vec::with_capacity(recvs.len());
                for (node, ch) in recvs {
                    got.push(mesh.recv(node, ch).await?);
                }
                Ok::<_, String>(got)
            };
            let _ = tx.send(exchange.await);
        });
        let mut others = rx
            .recv_timeout(self.patience)
            .map_err(|_| {
                format!(
                    "tensor shard {me} waited {:.0} s for the other shards of its group",
                    self.patience.as_secs_f64()
                )
            })??
            .into_iter();
        // Shard order: shard 0's values, then each next shard's added in (this shard's
        // own values are already in `buf` when it is shard 0, kept aside otherwise).
        let own = (me != 0).then(|| buf.to_vec());
        for k in 0..n {
            match (k == me, &own) {
                (true, None) => {}
                (true, Some(own)) => buf.iter_mut().zip(own).for_each(|(s, v)| *s += v),
                (false, _) => {
                    let bytes = others.next().ok_or("a shard's tensor is missing")?;
                    let fold = if k == 0 { copy_into } else { add_into };
                    fold(buf, &bytes).map_err(|e| format!("tensor shard {k}: {e}"))?;
                    self.mesh.recycle(bytes);
                }
            }
        }
        Ok(())
    }
}
