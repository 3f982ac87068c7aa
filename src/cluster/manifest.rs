//! The cluster manifest: which nodes run a job, where they listen, which ranks each runs.
//!
//! One TOML file, the same on every node, read by `pipetrain launch --manifest FILE
//! --node NAME CONFIG`. Parsing validates everything once, so a launcher never meets a
//! half-checked manifest: every error names the file, the dotted field
//! (`nodes[1].address`) and the rule.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::coords::{Layout, RankCoords};
use super::field::field_at;
use super::host::{check_port, Endpoint, Host};
use super::secret::{read_secret, SecretSource};
use super::validate::{validate, Resolved};
use crate::{Error, Result};

/// A validated cluster manifest. Build one with [`ClusterManifest::load`],
/// [`ClusterManifest::parse`] or [`super::manifest_from_slurm`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterManifest {
    file: ManifestFile,
    path: PathBuf,
    resolved: Resolved,
}

/// The manifest as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ManifestFile {
    pub job: JobSpec,
    pub layout: Layout,
    pub nodes: Vec<NodeSpec>,
}

/// The `[job]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The job's name (letters, digits, `.`, `_`, `-`).
    pub name: String,
    /// `ADDRESS:PORT` on the first node, where it listens for the other nodes to join.
    pub rendezvous: String,
    /// A file holding the shared secret (readable by its owner only); relative to the
    /// manifest's folder. Exactly one of `secret_file` and `secret_env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// The name of an environment variable holding the shared secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// Milliseconds between heartbeats to peers.
    #[serde(default = "heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A peer silent for this many seconds is taken for dead.
    #[serde(default = "peer_timeout_s")]
    pub peer_timeout_s: u64,
    /// Seconds to wait for every node to join (and for each connection) at start.
    #[serde(default = "connect_timeout_s")]
    pub connect_timeout_s: u64,
    /// Restarts of the whole job (from its newest checkpoint) before giving up.
    #[serde(default = "max_restarts")]
    pub max_restarts: u32,
    /// Go on with the nodes left when one is gone for good (its restarts spent, or not
    /// back within `connect_timeout_s`): a smaller data-parallel size, the same global
    /// batch (see [`ClusterManifest::shrink`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub elastic: bool,
    /// With `elastic`, the fewest nodes the job goes on with (default: as few as hold
    /// one replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<usize>,
}

fn heartbeat_ms() -> u64 {
    1000
}
fn peer_timeout_s() -> u64 {
    10
}
fn connect_timeout_s() -> u64 {
    60
}
fn max_restarts() -> u32 {
    3
}

/// One `[[nodes]]` entry: a machine (one `pipetrain launch` process) and its ranks.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Its name, as given to `--node` (letters, digits, `.`, `_`, `-`).
    pub name: String,
    /// The address peers connect to and its listeners bind: an IP or a host name (never
    /// the wildcard `0.0.0.0`; see `bind_all`).
    pub address: String,
    /// The first of its data ports: its ranks listen on `port`, `port + 1`, ... in rank
    /// order.
    #[serde(deserialize_with = "de_port")]
    pub port: u16,
    /// Listen on every interface (`0.0.0.0` or `::`) rather than on `address` only, for
    /// containers and hosts whose reachable address is not a local interface.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bind_all: bool,
    /// How many ranks may run here on CPUs. Exactly one of `cpu_slots` and `gpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_slots: Option<usize>,
    /// The GPU devices ranks may run on here, one rank each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<u32>>,
    /// The global ranks that run here. Given on every node or on none; when on none,
    /// ranks are assigned in node order, as many as each node has slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<usize>>,
}

fn de_port<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u16, D::Error> {
    check_port(i64::deserialize(d)?).map_err(serde::de::Error::custom)
}

impl NodeSpec {
    /// How many ranks may run here: `cpu_slots`, or the number of `gpus`.
    pub fn slots(&self) -> usize {
        match (&self.cpu_slots, &self.gpus) {
            (Some(n), _) => *n,
            (None, Some(g)) => g.len(),
            (None, None) => 0,
        }
    }

    /// Its address, parsed (validated manifests only hold valid ones).
    pub fn host(&self) -> Host {
        Host::parse(&self.address).unwrap_or_else(|_| Host::Name(self.address.clone()))
    }

    /// The IP its listeners bind: the wildcard with `bind_all`, else the address when it
    /// is an IP, else `None` (a host name, which the launcher resolves).
    pub fn bind_ip(&self) -> Option<std::net::IpAddr> {
        match self.host() {
            h if self.bind_all => Some(h.unspecified()),
            Host::Ip(ip) => Some(ip),
            Host::Name(_) => None,
        }
    }
}

impl JobSpec {
    /// Where the secret comes from (validated manifests have exactly one source).
    pub fn secret_source(&self) -> SecretSource {
        match (&self.secret_file, &self.secret_env) {
            (Some(f), _) => SecretSource::File(f.clone()),
            (None, Some(v)) => SecretSource::Env(v.clone()),
            (None, None) => SecretSource::Env(String::new()),
        }
    }

    /// `heartbeat_ms` as a duration.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    /// `peer_timeout_s` as a duration.
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_secs(self.peer_timeout_s)
    }

    /// `connect_timeout_s` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout_s)
    }
}

impl ClusterManifest {
    /// Reads and validates a manifest file.
    ///
    /// # Errors
    /// `Io` when unreadable; `Config` naming the field and the rule otherwise.
    pub fn load(path: &Path) -> Result<ClusterManifest> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
        ClusterManifest::parse(&text, path)
    }

    /// Parses and validates TOML text; `path` names the file in errors and anchors a
    /// relative `secret_file`.
    ///
    /// # Errors
    /// `Config` naming the field and the rule.
    pub fn parse(text: &str, path: &Path) -> Result<ClusterManifest> {
        let mut file: ManifestFile = toml::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            field: field_at(text, &e),
            rule: e.message().to_string(),
        })?;
        if let Some(f) = file.job.secret_file.as_mut() {
            if f.is_relative() && !f.as_os_str().is_empty() {
                *f = path.parent().unwrap_or(Path::new(".")).join(&*f);
            }
        }
        ClusterManifest::from_parts(file, path)
    }

    /// Validates a manifest built in code; `path` names it in errors.
    pub(super) fn from_parts(file: ManifestFile, path: &Path) -> Result<ClusterManifest> {
        let resolved = validate(&file, path)?;
        Ok(ClusterManifest {
            file,
            path: path.to_path_buf(),
            resolved,
        })
    }

    /// The manifest as TOML that [`ClusterManifest::parse`] reads back to an equal
    /// manifest (a relative `secret_file` is written resolved): to show or keep the
    /// manifest a launcher derived from a scheduler.
    ///
    /// # Errors
    /// `Config` on `job.secret_file` when that path is not UTF-8, which TOML cannot hold.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(&self.file).map_err(|e| Error::Config {
            path: self.path.clone(),
            field: "job.secret_file".into(),
            rule: format!("cannot be written as TOML: {e}"),
        })
    }

    /// This manifest with `layout`, its ranks filling the nodes in order (any `ranks`
    /// lists dropped), as a file at `path` (a relative `secret_file` made absolute, so it
    /// holds from there): what `pipetrain plan --manifest` writes.
    ///
    /// # Errors
    /// `Config` when the nodes' slots do not add up to `layout`'s world size.
    pub fn with_layout(&self, layout: Layout, path: &Path) -> Result<ClusterManifest> {
        let mut file = self.file.clone();
        file.layout = layout;
        for n in &mut file.nodes {
            n.ranks = None;
        }
        if let Some(f) = file.job.secret_file.as_mut() {
            *f = std::path::absolute(&*f).map_err(Error::io(&*f))?;
        }
        ClusterManifest::from_parts(file, path)
    }

    /// The file it was read from (or a `<...>` description when derived).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `[job]` table.
    pub fn job(&self) -> &JobSpec {
        &self.file.job
    }

    /// The `[layout]` table.
    pub fn layout(&self) -> Layout {
        self.file.layout
    }

    /// The nodes, in manifest order.
    pub fn nodes(&self) -> &[NodeSpec] {
        &self.file.nodes
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&NodeSpec> {
        self.node_index(name).map(|i| &self.file.nodes[i])
    }

    /// The position of the node named `name`.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.file.nodes.iter().position(|n| n.name == name)
    }

    /// The first node's rendezvous point.
    pub fn rendezvous(&self) -> &Endpoint {
        &self.resolved.rendezvous
    }

    /// data x pipeline x tensor parallel sizes: every rank of the job.
    pub fn world_size(&self) -> usize {
        self.resolved.rank_node.len()
    }

    /// The coordinates of `rank`, or `None` when it is not below the world size.
    pub fn coords(&self, rank: usize) -> Option<RankCoords> {
        self.file.layout.coords(rank)
    }

    /// The ranks that run on node `node` (an index into [`ClusterManifest::nodes`]), in
    /// rank order; empty when there is no such node.
    pub fn ranks_of(&self, node: usize) -> Vec<RankCoords> {
        let ranks = self.resolved.node_ranks.get(node).map_or(&[][..], |r| r);
        ranks.iter().filter_map(|&r| self.coords(r)).collect()
    }

    /// The index of the node that runs `rank`, or `None` when it is not below the world
    /// size.
    pub fn node_of_rank(&self, rank: usize) -> Option<usize> {
        self.resolved.rank_node.get(rank).copied()
    }

    /// Where `rank` listens for its peers: its node's host and `port + i`, the rank being
    /// the node's `i`-th in rank order.
    pub fn data_endpoint(&self, rank: usize) -> Option<Endpoint> {
        let node = self.node_of_rank(rank)?;
        let local = self.resolved.node_ranks[node]
            .iter()
            .position(|&r| r == rank)?;
        let spec = &self.file.nodes[node];
        Some(Endpoint {
            host: spec.host(),
            port: spec.port + u16::try_from(local).ok()?,
        })
    }

    /// The shared secret, from the file or the environment variable the manifest names
    /// (`env` looks variables up: pass `&|k| std::env::var(k).ok()` at the edge). One
    /// trailing newline (`\n` or `\r\n`) is dropped, so `echo` and editors agree.
    ///
    /// # Errors
    /// `Config` on `job.secret_file` / `job.secret_env` saying where it looked: a missing
    /// or unreadable file, an unset variable, an empty secret, or (on Unix) a file that
    /// its group or others may read or write.
    pub fn secret(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<u8>> {
        read_secret(&self.file.job.secret_source(), &self.path, env)
    }
}

impl ClusterManifest {
    /// Checks that a training configuration asks for this manifest's layout: its
    /// data, pipeline and horizontal parallel sizes (and `world_size`, when given) equal
    /// the manifest's, so every rank the manifest places has a stage to run.
    ///
    /// # Errors
    /// `Config` on the manifest's `layout.*` field, naming the configuration's value.
    pub fn check_train_config(
        &self,
        config: &crate::config::TrainConfig,
        config_path: &Path,
    ) -> Result<()> {
        let l = self.layout();
        let pairs = [
            (
                "layout.data_parallel",
                l.data_parallel,
                "data_parallel_size",
                config.data_parallel_size,
            ),
            (
                "layout.pipeline_parallel",
                l.pipeline_parallel,
                "pipeline_parallel_size",
                config.pipeline_parallel_size,
            ),
            (
                "layout.tensor_parallel",
                l.tensor_parallel,
                "horizontal_parallel_size",
                config.horizontal_parallel_size,
            ),
            (
                "layout",
                l.world_size(),
                "world_size",
                config.world_size.unwrap_or(l.world_size()),
            ),
        ];
        for (field, ours, theirs, value) in pairs {
            if ours != value {
                return Err(Error::Config {
                    path: self.path().to_path_buf(),
                    field: field.into(),
                    rule: format!(
                        "is {ours}, but the training configuration {} has {theirs} = {value}; they must agree",
                        config_path.display()
                    ),
                });
            }
        }
        self.check_devices(config, config_path)
    }

    /// A node's `gpus` need a configuration on a GPU; a launched job's ranks are placed
    /// by the nodes, not by `runtime.devices`.
    fn check_devices(&self, config: &crate::config::TrainConfig, config_path: &Path) -> Result<()> {
        if !config.runtime.devices.is_empty() {
            return Err(Error::Config {
                path: config_path.to_path_buf(),
                field: "runtime.devices".into(),
                rule: format!(
                    "places the ranks of one process; in a job launched from {}, each \
                     node's `gpus` place its ranks",
                    self.path().display()
                ),
            });
        }
        let on_gpus = self.nodes().iter().position(|n| n.gpus.is_some());
        match (on_gpus, config.runtime.device) {
            (Some(i), crate::compute::Device::Cpu) => Err(Error::Config {
                path: self.path().to_path_buf(),
                field: format!("nodes[{i}].gpus"),
                rule: format!(
                    "runs the node's ranks on GPUs, but the training configuration {} has \
                     runtime.device = \"cpu\"; set it to \"cuda\", or give the node \
                     `cpu_slots` instead",
                    config_path.display()
                ),
            }),
            _ => Ok(()),
        }
    }
}
