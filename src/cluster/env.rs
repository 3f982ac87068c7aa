//! Which node this process is: `--node`, else what Slurm or Kubernetes says.
//!
//! The environment comes in as a lookup function (`&dyn Fn(&str) -> Option<String>`),
//! never from `std::env` here, so the binary reads the process's environment at the
//! edge and tests pass fake ones. The order:
//! 1. an explicit `--node NAME` wins;
//! 2. under Slurm (`SLURM_JOB_ID` set): `SLURMD_NODENAME` matched against the nodes'
//!    names and addresses (a short name matching a fully qualified one), else
//!    `SLURM_NODEID` (or `SLURM_PROCID`) as an index into the nodes. pipetrain runs one
//!    process per node (`srun --ntasks-per-node=1`), so a `SLURM_NTASKS` other than the
//!    number of nodes is refused rather than have two processes claim one node;
//! 3. under a Kubernetes indexed Job: `JOB_COMPLETION_INDEX` as an index into the nodes;
//!    without it, in a pod (`KUBERNETES_SERVICE_HOST` set), the pod's `HOSTNAME` matched
//!    against the nodes' names and addresses' first labels, else the `<job>-<index>`
//!    pattern Kubernetes gives indexed Jobs' pods, `<job>` being `job.name`.

use std::fmt;

use super::host::Host;
use super::manifest::ClusterManifest;
use super::slurm::SlurmJob;
use crate::{Error, Result};

/// The node this process runs, and what said so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeChoice {
    /// Its index in [`ClusterManifest::nodes`].
    pub index: usize,
    /// Its name.
    pub name: String,
    /// What picked it.
    pub source: NodeSource,
}

/// What picked the node.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeSource {
    /// `--node NAME`.
    Explicit,
    /// Slurm's `SLURMD_NODENAME`, matched by name or address.
    SlurmNodeName(String),
    /// Slurm's `SLURM_NODEID` (or `SLURM_PROCID`), as an index.
    SlurmNodeId(usize),
    /// Kubernetes' `JOB_COMPLETION_INDEX`, as an index.
    KubernetesIndex(usize),
    /// The pod's `HOSTNAME`, matched by name or as `<job>-<index>`.
    KubernetesHostname(String),
}

impl fmt::Display for NodeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeSource::Explicit => f.write_str("--node"),
            NodeSource::SlurmNodeName(n) => write!(f, "SLURMD_NODENAME={n}"),
            NodeSource::SlurmNodeId(i) => write!(f, "SLURM_NODEID={i}"),
            NodeSource::KubernetesIndex(i) => write!(f, "JOB_COMPLETION_INDEX={i}"),
            NodeSource::KubernetesHostname(h) => write!(f, "HOSTNAME={h}"),
        }
    }
}

/// The node this process runs: `explicit` (from `--node`) when given, else the one the
/// scheduler's environment names (see the module docs for the order).
///
/// # Errors
/// `Config` on the manifest's file, the field being `--node` or the variable at fault:
/// an unknown node name (listing the manifest's nodes), an index past the last node, a
/// task count that is not one per node, or no way to tell.
pub fn select_node(
    manifest: &ClusterManifest,
    explicit: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<NodeChoice> {
    let bad = |field: &str, rule: String| Error::Config {
        path: manifest.path().to_path_buf(),
        field: field.into(),
        rule,
    };
    let choice = |index: usize, source| NodeChoice {
        index,
        name: manifest.nodes()[index].name.clone(),
        source,
    };
    let by_index = |var: &str, i: usize, hint: &str| {
        if i < manifest.nodes().len() {
            Ok(i)
        } else {
            Err(bad(
                var,
                format!(
                    "is {i}, but the manifest has {} nodes ({}){hint}",
                    manifest.nodes().len(),
                    node_list(manifest)
                ),
            ))
        }
    };
    if let Some(name) = explicit {
        return manifest
            .node_index(name)
            .map(|i| choice(i, NodeSource::Explicit))
            .ok_or_else(|| {
                bad(
                    "--node",
                    format!(
                        "no node is named `{name}`; the manifest's nodes are {}",
                        node_list(manifest)
                    ),
                )
            });
    }
    if let Some(job) = SlurmJob::from_env(env)? {
        let nodes = manifest.nodes().len();
        if let Some(n) = job.ntasks.filter(|&n| n != nodes) {
            return Err(bad(
                "SLURM_NTASKS",
                format!("is {n}, but the manifest has {nodes} nodes: pipetrain runs one process per node, which runs that node's ranks (srun --ntasks-per-node=1, --nodes={nodes})"),
            ));
        }
        if let Some(name) = &job.node_name {
            if let Some(i) = match_host(manifest, name).map_err(|r| bad("SLURMD_NODENAME", r))? {
                return Ok(choice(i, NodeSource::SlurmNodeName(name.clone())));
            }
        }
        let hint = "; run as many nodes as the manifest lists";
        return match (job.node_id, job.proc_id) {
            (Some(i), _) => Ok(choice(by_index("SLURM_NODEID", i, hint)?, NodeSource::SlurmNodeId(i))),
            (None, Some(i)) => Ok(choice(by_index("SLURM_PROCID", i, hint)?, NodeSource::SlurmNodeId(i))),
            (None, None) => Err(bad(
                "SLURM_NODEID",
                format!("not set, and SLURMD_NODENAME ({}) names none of the manifest's nodes {}; run under srun, or give --node", job.node_name.as_deref().unwrap_or("not set"), node_list(manifest)),
            )),
        };
    }
    if let Some(v) = env("JOB_COMPLETION_INDEX") {
        let i: usize = v.trim().parse().map_err(|_| {
            bad(
                "JOB_COMPLETION_INDEX",
                format!("must be a number, got `{v}`"),
            )
        })?;
        let hint = "; the Job's `completions` and `parallelism` must equal the number of nodes";
        return Ok(choice(
            by_index("JOB_COMPLETION_INDEX", i, hint)?,
            NodeSource::KubernetesIndex(i),
        ));
    }
    if let (Some(_), Some(host)) = (env("KUBERNETES_SERVICE_HOST"), env("HOSTNAME")) {
        if let Some(i) = match_host(manifest, &host).map_err(|r| bad("HOSTNAME", r))? {
            return Ok(choice(i, NodeSource::KubernetesHostname(host)));
        }
        let prefix = format!("{}-", manifest.job().name);
        if let Some(i) = host
            .strip_prefix(&prefix)
            .and_then(|s| s.parse::<usize>().ok())
        {
            let i = by_index("HOSTNAME", i, " (as <job>-<index>)")?;
            return Ok(choice(i, NodeSource::KubernetesHostname(host)));
        }
    }
    Err(bad(
        "--node",
        format!("not given, and no scheduler names this process's node (neither Slurm's SLURM_JOB_ID nor a Kubernetes indexed Job's JOB_COMPLETION_INDEX is set); give --node with one of {}", node_list(manifest)),
    ))
}

/// The name of the node this process runs, from the scheduler's environment alone (no
/// `--node`): [`select_node`] with no explicit name.
///
/// # Errors
/// As [`select_node`].
pub fn node_from_env(
    manifest: &ClusterManifest,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<String> {
    select_node(manifest, None, env).map(|c| c.name)
}

/// `a (127.0.0.1), b (127.0.0.2)`.
fn node_list(manifest: &ClusterManifest) -> String {
    let names: Vec<String> = manifest
        .nodes()
        .iter()
        .map(|n| format!("{} ({})", n.name, n.address))
        .collect();
    names.join(", ")
}

/// The node a host name refers to: its name or address equal to `host` (ignoring case),
/// else, for host names only, equal up to the first dot (`n01` and `n01.cluster`).
/// `Ok(None)` when none matches; an error when several do.
fn match_host(
    manifest: &ClusterManifest,
    host: &str,
) -> std::result::Result<Option<usize>, String> {
    let short = |s: &str| -> String {
        match Host::parse(s) {
            Ok(Host::Name(n)) => n.split('.').next().unwrap_or_default().to_string(),
            _ => s.to_ascii_lowercase(),
        }
    };
    let tiers: [&dyn Fn(&str) -> bool; 2] =
        [&|s: &str| s.eq_ignore_ascii_case(host), &|s: &str| {
            short(s) == short(host)
        }];
    for matches in tiers {
        let found: Vec<usize> = (0..manifest.nodes().len())
            .filter(|&i| {
                let n = &manifest.nodes()[i];
                matches(&n.name) || matches(&n.address)
            })
            .collect();
        match found[..] {
            [] => continue,
            [i] => return Ok(Some(i)),
            _ => {
                let names: Vec<&str> = found
                    .iter()
                    .map(|&i| manifest.nodes()[i].name.as_str())
                    .collect();
                return Err(format!(
                    "`{host}` matches several nodes ({}); give --node",
                    names.join(", ")
                ));
            }
        }
    }
    Ok(None)
}
