//! Slurm: the job's variables, and a manifest derived from its allocation.
//!
//! A derived manifest names its nodes after Slurm's node names and uses those names as
//! addresses: Slurm's nodes resolve by name on the cluster's own network, and resolving
//! them here would tie parsing to the network. The launcher resolves them when it
//! connects (and, without `bind_all`, its own name to bind). Node `i` is the allocation's
//! `i`-th node in `SLURM_JOB_NODELIST` order, which is also `SLURM_NODEID`'s order, and
//! runs ranks `i * k .. (i + 1) * k` for `k = world / nodes`; the first node holds the
//! rendezvous.

use std::path::PathBuf;

use super::coords::Layout;
use super::hostlist::expand_hostlist;
use super::manifest::{ClusterManifest, JobSpec, ManifestFile, NodeSpec};
use super::secret::SecretSource;
use crate::{Error, Result};

/// What Slurm tells a job step's process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmJob {
    /// `SLURM_JOB_ID`.
    pub job_id: String,
    /// `SLURM_JOB_NAME`.
    pub job_name: Option<String>,
    /// `SLURM_JOB_NODELIST` (or the older `SLURM_NODELIST`), compressed as Slurm writes it.
    pub node_list: Option<String>,
    /// `SLURM_NODEID`: this node's index in the allocation.
    pub node_id: Option<usize>,
    /// `SLURM_PROCID`: this task's rank in the step.
    pub proc_id: Option<usize>,
    /// `SLURMD_NODENAME`: this node's name.
    pub node_name: Option<String>,
    /// `SLURM_NTASKS`: the step's tasks.
    pub ntasks: Option<usize>,
    /// `SLURM_SUBMIT_DIR`: where the job was submitted from.
    pub submit_dir: Option<PathBuf>,
}

impl SlurmJob {
    /// The job's variables; `None` outside Slurm (`SLURM_JOB_ID` unset).
    ///
    /// # Errors
    /// `Config` (path `<environment>`) naming a numeric variable that is not a number.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<SlurmJob>> {
        let Some(job_id) = env("SLURM_JOB_ID") else {
            return Ok(None);
        };
        let number = |var: &str| -> Result<Option<usize>> {
            env(var)
                .map(|v| {
                    v.trim().parse().map_err(|_| Error::Config {
                        path: "<environment>".into(),
                        field: var.into(),
                        rule: format!("must be a number, got `{v}`"),
                    })
                })
                .transpose()
        };
        Ok(Some(SlurmJob {
            job_id,
            job_name: env("SLURM_JOB_NAME"),
            node_list: env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")),
            node_id: number("SLURM_NODEID")?,
            proc_id: number("SLURM_PROCID")?,
            node_name: env("SLURMD_NODENAME"),
            ntasks: number("SLURM_NTASKS")?,
            submit_dir: env("SLURM_SUBMIT_DIR").map(PathBuf::from),
        }))
    }

    /// The allocation's node names, expanded from [`SlurmJob::node_list`].
    ///
    /// # Errors
    /// `Config` on `SLURM_JOB_NODELIST` when it is unset or malformed.
    pub fn nodes(&self) -> Result<Vec<String>> {
        let bad = |rule: String| Error::Config {
            path: "<environment>".into(),
            field: "SLURM_JOB_NODELIST".into(),
            rule,
        };
        let list = self
            .node_list
            .as_deref()
            .ok_or_else(|| bad("not set".into()))?;
        expand_hostlist(list).map_err(bad)
    }
}

/// What a manifest derived from a Slurm allocation takes beyond the node list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmDefaults {
    /// The job's name; default `SLURM_JOB_NAME` (characters other than letters, digits,
    /// `.`, `_`, `-` replaced by `-`), else `slurm-<job id>`.
    pub name: Option<String>,
    /// Replicas, stages, tensor shards.
    pub layout: Layout,
    /// Every node's first data port.
    pub port: u16,
    /// The rendezvous port on the first node.
    pub rendezvous_port: u16,
    /// Where the secret is; a relative file is taken from `SLURM_SUBMIT_DIR`.
    pub secret: SecretSource,
    /// The GPU devices of each node (all alike), or `None` to run ranks on CPUs.
    pub gpus: Option<Vec<u32>>,
    /// Listen on every interface rather than the node name's address.
    pub bind_all: bool,
    /// As [`JobSpec::heartbeat_ms`].
    pub heartbeat_ms: u64,
    /// As [`JobSpec::peer_timeout_s`].
    pub peer_timeout_s: u64,
    /// As [`JobSpec::connect_timeout_s`].
    pub connect_timeout_s: u64,
    /// As [`JobSpec::max_restarts`].
    pub max_restarts: u32,
    /// As [`JobSpec::elastic`].
    pub elastic: bool,
    /// As [`JobSpec::min_nodes`].
    pub min_nodes: Option<usize>,
}

impl Default for SlurmDefaults {
    /// One rank, ports 29500 (data) and 29400 (rendezvous), the secret in
    /// `cluster.secret` in the submit folder, CPUs, the manifest's default timeouts.
    fn default() -> Self {
        SlurmDefaults {
            name: None,
            layout: Layout::default(),
            port: 29500,
            rendezvous_port: 29400,
            secret: SecretSource::File("cluster.secret".into()),
            gpus: None,
            bind_all: false,
            heartbeat_ms: 1000,
            peer_timeout_s: 10,
            connect_timeout_s: 60,
            max_restarts: 3,
            elastic: false,
            min_nodes: None,
        }
    }
}

/// A manifest for the Slurm job in `env`: a node per allocated node, ranks spread evenly.
///
/// # Errors
/// `Config` when not under Slurm, when the node list is missing or malformed, when the
/// world size does not divide evenly over the nodes, or when the result breaks a
/// manifest rule (the path then reads `<slurm job ID>`).
pub fn manifest_from_slurm(
    env: &dyn Fn(&str) -> Option<String>,
    base: &SlurmDefaults,
) -> Result<ClusterManifest> {
    let job = SlurmJob::from_env(env)?.ok_or_else(|| Error::Config {
        path: "<environment>".into(),
        field: "SLURM_JOB_ID".into(),
        rule: "not set: not running under Slurm".into(),
    })?;
    let path = PathBuf::from(format!("<slurm job {}>", job.job_id));
    let hosts = job.nodes()?;
    let world = base.layout.world_size();
    if world == 0 || world % hosts.len() != 0 {
        return Err(Error::Config {
            path,
            field: "layout".into(),
            rule: format!(
                "the world size {world} does not divide evenly over the job's {} nodes ({})",
                hosts.len(),
                job.node_list.unwrap_or_default()
            ),
        });
    }
    let per = world / hosts.len();
    let name = base.name.clone().unwrap_or_else(|| match &job.job_name {
        Some(n) => n
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect(),
        None => format!("slurm-{}", job.job_id),
    });
    let (secret_file, secret_env) = match &base.secret {
        SecretSource::File(f) => {
            let dir = job.submit_dir.clone().unwrap_or_default();
            (
                Some(if f.is_relative() {
                    dir.join(f)
                } else {
                    f.clone()
                }),
                None,
            )
        }
        SecretSource::Env(v) => (None, Some(v.clone())),
    };
    let nodes = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| NodeSpec {
            name: h.clone(),
            address: h.clone(),
            port: base.port,
            bind_all: base.bind_all,
            cpu_slots: base.gpus.is_none().then_some(per),
            gpus: base.gpus.clone(),
            ranks: Some((i * per..(i + 1) * per).collect()),
        })
        .collect();
    let file = ManifestFile {
        job: JobSpec {
            name,
            rendezvous: format!("{}:{}", hosts[0], base.rendezvous_port),
            secret_file,
            secret_env,
            heartbeat_ms: base.heartbeat_ms,
            peer_timeout_s: base.peer_timeout_s,
            connect_timeout_s: base.connect_timeout_s,
            max_restarts: base.max_restarts,
            elastic: base.elastic,
            min_nodes: base.min_nodes,
        },
        layout: base.layout,
        nodes,
    };
    ClusterManifest::from_parts(file, &path)
}
