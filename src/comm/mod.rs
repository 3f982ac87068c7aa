//! The transport between the workers of a `pipetrain launch` job: one process per node,
//! joined by a full mesh of TCP connections.
//!
//! - `frame`: length-prefixed frames with a maximum size.
//! - `handshake`: mutual HMAC-SHA256 challenge-response on the job's shared secret.
//! - `mesh`: [`Mesh`], one authenticated connection per pair of nodes (the higher dials
//!   the lower), channels multiplexed over it, heartbeats, and failure detection: a peer
//!   that closes without a goodbye or falls silent for the peer timeout fails every
//!   receive with its name. Bulk data goes out straight from the caller's memory
//!   ([`Mesh::send_slice`]) and is read into recycled buffers ([`Mesh::recycle`]).
//! - `conn`: one connection's tasks (dial, accept, write, read) and what they share
//!   with the mesh.
//! - `lobby`: an elastic job's rendezvous before its mesh: the first node learns who
//!   came back ([`Gathered`]) and tells them.
//! - `bus`: [`MeshBus`], the actors' control [`pipetrain_actors::Bus`] (keyed
//!   all-gathers).
//! - `ring`: [`MeshCollective`], ring all-reduce (reduce-scatter + all-gather) for the
//!   actors' [`pipetrain_actors::Collective`].
//! - `chain`: its sums in replica order instead (`runtime.all_reduce = "chain"`), bitwise
//!   one process's.
//! - `shards`: [`MeshShardGroups`], the tensor shards' all-reduce between nodes.
//! - `wire`: activations and gradients as bytes, and [`link_transfers`], the mailboxes of
//!   other nodes' stage actors.
//!
//! Why a full mesh of single connections: a job's nodes all talk to each other (bus),
//! pipeline neighbours exchange activations and replicas form rings; one connection
//! per pair carries all of it in order, so a node's failure shows on exactly one socket
//! per peer, and a job of N nodes holds N - 1 connections per node (fine for the tens of
//! nodes pipeline jobs span).

mod bus;
mod chain;
mod conn;
pub mod frame;
pub mod handshake;
mod lobby;
mod mesh;
mod ring;
mod shards;
pub mod wire;

pub use crate::config::AllReduce;
pub use bus::MeshBus;
pub use lobby::{host_lobby, join_lobby, Gathered};
pub use mesh::{Mesh, MeshTimeouts};
pub use ring::MeshCollective;
pub use shards::MeshShardGroups;
pub use wire::link_transfers;

/// Channels over a connection (the handshake's are 0 and 1).
pub(crate) const HEARTBEAT: u32 = 2;
pub(crate) const GOODBYE: u32 = 3;
pub(crate) const BUS: u32 = 4;
pub(crate) const DATA: u32 = 5;
/// Ring segments: `RING + stage * replicas + receiving replica` (also the chain's
/// running sums, from the previous replica).
pub(crate) const RING: u32 = 16;
/// The chain's totals (see `chain`): `RING_UP + stage * replicas + receiving replica`
/// (below `RING_UP`, ring channels for up to a quarter million stage members).
pub(crate) const RING_UP: u32 = 1 << 18;
/// Ring readiness: `RING_READY + stage * replicas + replica`, the channel on which a
/// replica hears that the next one is ready for its segment (see `ring`).
pub(crate) const RING_READY: u32 = 1 << 19;
/// Tensor shards' tensors: `TENSOR_SHARDS + ((stage * groups + group) * shards +
/// receiver) * shards + sender` (above every ring channel of a job of up to a million
/// stage members).
pub(crate) const TENSOR_SHARDS: u32 = 1 << 20;
