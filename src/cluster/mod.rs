//! The cluster manifest that `pipetrain launch --manifest FILE --node NAME CONFIG` reads:
//! which nodes run a job, where each listens, which global ranks it runs, and how this
//! process finds its own node under Slurm or Kubernetes.
//!
//! Everything here is pure: parsing and validation read only the manifest (and the secret
//! file when asked), the scheduler's environment comes in as a lookup function, and
//! nothing is resolved on the network; the launcher does the effects.
//!
//! # Layout
//! - `manifest`: [`ClusterManifest`] (TOML: `[job]`, `[layout]`, `[[nodes]]`), parsed
//!   and validated once; rank lookups both ways.
//! - `validate`: the manifest's rules and the rank assignment they yield.
//! - `elastic`: [`Shrunk`], the smaller job an elastic manifest goes on as.
//! - `coords`: [`Layout`] and [`RankCoords`]: `rank = dp * pipeline_parallel + pp`.
//! - `host`: [`Host`] and [`Endpoint`], IP literals or host names left unresolved.
//! - `secret`: [`SecretSource`], reading the shared secret, refusing an exposed file.
//! - `env`: [`select_node`], [`node_from_env`]: `--node`, Slurm, Kubernetes.
//! - `slurm`: [`SlurmJob`], [`manifest_from_slurm`] from an allocation's node list.
//! - `hostlist`: [`expand_hostlist`], Slurm's `node[01-04,07]` syntax.
//! - `field`: naming the field (`nodes[1].port`) of a TOML parse error.

mod coords;
mod elastic;
mod env;
mod field;
mod host;
mod hostlist;
mod manifest;
mod secret;
mod slurm;
mod validate;

pub use coords::{Layout, RankCoords};
pub use elastic::Shrunk;
pub use env::{node_from_env, select_node, NodeChoice, NodeSource};
pub use host::{Endpoint, Host};
pub use hostlist::{expand_hostlist, MAX_HOSTS};
pub use manifest::{ClusterManifest, JobSpec, NodeSpec};
pub use secret::{SecretSource, MIN_SECRET_BYTES};
pub use slurm::{manifest_from_slurm, SlurmDefaults, SlurmJob};

/// The process's environment as the lookup this module takes, for the binary (the edge)
/// to pass in: `select_node(&m, None, &cluster::process_env)`. Nothing in the library
/// calls it.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
