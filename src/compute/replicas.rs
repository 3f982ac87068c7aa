//! Data-parallel replicas of a stage that share one device and one process sum their
//! gradients in device memory ([`ReplicaLink::all_reduce`]): nothing goes through the
//! host, and the sum is bitwise the host's in-process all-reduce
//! (`pipetrain_actors::LocalCollective`).
//!
//! The same protocol as that all-reduce, on device spans: every replica lends its
//! gradient buffer to the round; replica `r` writes over chunk `r` of its own buffer the
//! sum of chunk `r` of every buffer, in replica order (`kernels::sum_replicas`); after a
//! barrier each replica copies every other chunk from the replica that summed it; a last
//! barrier keeps every buffer unwritten until no one reads it. Each device call returns
//! once the device has done it ([`GradBuffer`]), so a barrier orders the replicas'
//! streams as it orders their threads.
//!
//! A link may instead be an NCCL communicator (`cuda_nccl.rs`), whose all-reduce sums the
//! same buffer in place: the replicas of a stage on several GPUs, in this process or in
//! several ([`ReplicaLink::nccl`]). Only a one-rank communicator has run
//! (`debug.nccl_one_rank`): the lent machines have one GPU.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use tokio::sync::Barrier;

use super::resident::{DeviceSpan, GradBuffer};
use crate::{Error, Result};

/// One stage's data-parallel replicas reducing together in device memory.
pub struct ReplicaGroup {
    members: usize,
    /// The gradient buffers lent for the round in progress, by replica.
    lent: Mutex<Vec<Option<DeviceSpan>>>,
    /// Everyone has lent; everyone has summed its chunk; everyone has copied the rest.
    lent_all: Barrier,
    summed_all: Barrier,
    gathered_all: Barrier,
}

/// How one replica's gradients reach its replicas': its place in a [`ReplicaGroup`], or
/// an NCCL communicator.
#[derive(Clone)]
pub struct ReplicaLink(Link);

#[derive(Clone)]
enum Link {
    Group {
        group: Arc<ReplicaGroup>,
        rank: usize,
    },
    #[cfg(feature = "cuda")]
    Nccl(Arc<super::cuda_nccl::NcclReduce>),
}

impl std::fmt::Debug for ReplicaLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rank, of) = self.rank();
        write!(f, "replica {rank} of {of}")
    }
}

impl ReplicaLink {
    /// Whether NCCL loads here: its library is found (no device is touched).
    ///
    /// # Errors
    /// Why not, saying how to provide it; in a build without CUDA, that.
    pub fn nccl_ready() -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        return super::cuda_nccl::loads();
        #[cfg(not(feature = "cuda"))]
        Err(no_cuda(0).to_string())
    }

    /// A new id for an NCCL communicator, made by one of its ranks and handed to the
    /// others ([`ReplicaLink::nccl`]).
    ///
    /// # Errors
    /// `Device` where NCCL does not load, or in a build without CUDA.
    pub fn nccl_id() -> Result<[u8; 128]> {
        #[cfg(feature = "cuda")]
        return super::cuda_nccl::new_id().map_err(|reason| Error::Device {
            device: "cuda".into(),
            reason: format!("ncclGetUniqueId: {reason}"),
        });
        #[cfg(not(feature = "cuda"))]
        Err(no_cuda(0))
    }

    /// This process's links of an NCCL communicator of `world` replicas made from `id`:
    /// one for each (device, replica) of `local`, in that order.
    ///
    /// # Errors
    /// `Device` where a device is not CUDA's, NCCL does not load or refuses, or in a
    /// build without CUDA.
    pub fn nccl(
        local: &[(super::Device, usize)],
        world: usize,
        id: [u8; 128],
    ) -> Result<Vec<ReplicaLink>> {
        let mut ranks = Vec::with_capacity(local.len());
        for &(device, rank) in local {
            let super::Device::Cuda(index) = device else {
                return Err(Error::Device {
                    device: device.to_string(),
                    reason: "NCCL needs a CUDA device".into(),
                });
            };
            ranks.push((index, rank));
        }
        #[cfg(feature = "cuda")]
        {
            let made = super::cuda_nccl::NcclReduce::ranks(&ranks, world, id)?;
            Ok(made
                .into_iter()
                .map(|n| ReplicaLink(Link::Nccl(Arc::new(n))))
                .collect())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (world, id);
            Err(no_cuda(ranks.first().map_or(0, |r| r.0)))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda(index: usize) -> Error {
    Error::Device {
        device: format!("cuda:{index}"),
        reason: "this build has no CUDA path; build pipetrain with `--features cuda`".into(),
    }
}

/// The half-open range of chunk `r` of `d` chunks over `n` values (the host
/// all-reduce's chunks).
fn chunk(n: usize, d: usize, r: usize) -> Range<usize> {
    (n * r / d)..(n * (r + 1) / d)
}

impl ReplicaGroup {
    /// A group of `members` replicas.
    pub fn new(members: usize) -> Arc<ReplicaGroup> {
        Arc::new(ReplicaGroup {
            members,
            lent: Mutex::new(vec![None; members]),
            lent_all: Barrier::new(members),
            summed_all: Barrier::new(members),
            gathered_all: Barrier::new(members),
        })
    }

    /// Replica `rank`'s link to the group.
    pub fn link(self: &Arc<Self>, rank: usize) -> ReplicaLink {
        ReplicaLink(Link::Group {
            group: self.clone(),
            rank,
        })
    }

    fn failed(&self, rank: usize, reason: String) -> Error {
        Error::Device {
            device: format!("data-parallel replica {rank} of {}", self.members),
            reason,
        }
    }

    fn lent(&self) -> std::sync::MutexGuard<'_, Vec<Option<DeviceSpan>>> {
        // A replica that panicked holding the lock left nothing half-written in it.
        self.lent.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ReplicaLink {
    /// This replica's place and the group's size.
    pub fn rank(&self) -> (usize, usize) {
        match &self.0 {
            Link::Group { group, rank } => (*rank, group.members),
            #[cfg(feature = "cuda")]
            Link::Nccl(nccl) => nccl.rank(),
        }
    }

    /// Sums `grads` with the other replicas' in place: every replica then holds the
    /// sum, added in replica order. Every member must call it once a round.
    ///
    /// # Errors
    /// `Device` when a replica's gradients differ in length or device from these, when
    /// this replica lent twice, or on a failed device call (the round still completes,
    /// so that no replica waits for ever).
    pub async fn all_reduce<G: GradBuffer + Send + ?Sized>(&self, grads: &mut G) -> Result<()> {
        match &self.0 {
            Link::Group { group, rank } => group.all_reduce(*rank, grads).await,
            #[cfg(feature = "cuda")]
            Link::Nccl(nccl) => nccl.all_reduce(grads.grads()),
        }
    }
}

impl ReplicaGroup {
    /// [`ReplicaLink::all_reduce`] in this group, from replica `rank`.
    async fn all_reduce<G: GradBuffer + Send + ?Sized>(
        &self,
        rank: usize,
        grads: &mut G,
    ) -> Result<()> {
        let own = grads.grads();
        {
            let mut lent = self.lent();
            if rank >= self.members || lent[rank].is_some() {
                return Err(self.failed(rank, "lent its gradients twice to one round".into()));
            }
            lent[rank] = Some(own);
        }
        self.lent_all.wait().await;
        let all: Vec<DeviceSpan> = self.lent().iter().flatten().copied().collect();
        let uneven = all
            .iter()
            .position(|s| s.len != own.len || s.device != own.device);
        let n = own.len;
        let mut result = match uneven {
            Some(r) => Err(self.failed(
                rank,
                format!(
                    "replica {r}'s gradients are {} values on {}, these {n} on {}",
                    all[r].len, all[r].device, own.device
                ),
            )),
            None => grads.sum_grads(&all, chunk(n, self.members, rank)),
        };
        self.summed_all.wait().await;
        if result.is_ok() {
            result = (0..self.members)
                .filter(|&s| s != rank)
                .try_for_each(|s| grads.copy_grads(all[s], chunk(n, self.members, s)));
        }
        self.gathered_all.wait().await;
        self.lent()[rank] = None;
        result
    }
}
