//! `pipetrain launch`: one process per node of a cluster manifest.
//!
//! Every node runs the same command with the same manifest and training configuration;
//! the node finds itself by `--node`, Slurm's or Kubernetes' variables
//! ([`crate::cluster::select_node`]). What runs there is a supervisor
//! ([`supervisor`]) and its worker child ([`worker`]): the worker joins the others in a
//! full mesh of authenticated TCP connections ([`crate::comm`]), runs the stage actors of
//! the node's (replica, pipeline rank) members, and exchanges activations, gradients,
//! gradient reductions and the run's decisions with the other workers; the supervisor
//! restarts it, from the newest complete checkpoint, when the job fails.
//!
//! One process per node, not per rank as torchrun starts them: a node's ranks share one
//! ONNX Runtime library, one copy of the data and one set of connections, and hand
//! activations to each other through memory; a rank's failure is the node's anyway.

mod elastic;
mod part;
mod supervisor;
mod worker;

use std::path::PathBuf;

use crate::cluster::{process_env, select_node, ClusterManifest, NodeChoice};
use crate::config::TrainConfig;
use crate::Result;

/// The arguments of `pipetrain launch`.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// The cluster manifest (TOML: [job], [layout], [[nodes]]), the same on every node.
    #[arg(long)]
    pub manifest: PathBuf,
    /// This node's name in the manifest (default: found from Slurm's or Kubernetes'
    /// variables).
    #[arg(long)]
    pub node: Option<String>,
    /// Resume from the newest complete checkpoint in `checkpoints_dir` (restarts after
    /// a failure always resume).
    #[arg(long)]
    pub resume: bool,
    /// Start from step 0 in a `checkpoints_dir` that holds an earlier run's checkpoints,
    /// moving them aside first (without `--resume` or `--fresh`, such a folder is
    /// refused).
    #[arg(long, conflicts_with = "resume")]
    pub fresh: bool,
    /// Write one JSON object per optimizer step to this file (node 0 only).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Run as the worker (started by the supervisor).
    #[arg(long, hide = true)]
    pub worker: bool,
    /// Which start of the worker this is (0 first).
    #[arg(long, hide = true, default_value_t = 0)]
    pub attempt: u32,
    /// The training configuration, the same on every node.
    pub config: PathBuf,
}

/// How a node's part of the job ended (see [`Ended::status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The job trained to its end.
    Finished,
    /// A SIGINT or SIGTERM (the signal) stopped the job after a checkpoint.
    Stopped(i32),
    /// An elastic job's worker lost a peer mid-run: restarted without counting against
    /// `max_restarts` (the peer's own supervisor counts its failures).
    LostPeer,
    /// An elastic job went on without this node (no rank left for it).
    Left,
}

/// The exit status of an elastic job's worker that lost a peer (`EX_TEMPFAIL`).
const LOST_PEER_STATUS: u8 = 75;

impl Ended {
    /// The process's exit status: 0 finished or left, `128 + signal` stopped, 75 a
    /// worker that lost a peer.
    pub fn status(self) -> u8 {
        match self {
            Ended::Finished | Ended::Left => 0,
            Ended::Stopped(sig) => (128 + sig) as u8,
            Ended::LostPeer => LOST_PEER_STATUS,
        }
    }
}

/// Runs `pipetrain launch`: the supervisor, or with `--worker` the worker.
///
/// # Errors
/// A bad manifest, configuration or environment, naming the file, field and rule; the
/// job's failure.
pub fn launch(args: &LaunchArgs) -> Result<Ended> {
    match args.worker {
        true => worker::run_worker(args),
        false => supervisor::supervise(args),
    }
}

/// Where this process stands: the manifest, which node it is, and the configuration,
/// checked against each other.
struct Placement {
    manifest: ClusterManifest,
    node: NodeChoice,
    cfg: TrainConfig,
    /// The job name the mesh's connections prove (an elastic job's names its regroup).
    mesh_job: String,
    /// What an elastic regroup changed, for the log and the metrics.
    event: Option<String>,
}

impl Placement {
    fn load(args: &LaunchArgs) -> Result<Placement> {
        let manifest = ClusterManifest::load(&args.manifest)?;
        let node = select_node(&manifest, args.node.as_deref(), &process_env)?;
        let cfg = TrainConfig::load(&args.config)?;
        manifest.check_train_config(&cfg, &args.config)?;
        Ok(Placement {
            mesh_job: manifest.job().name.clone(),
            manifest,
            node,
            cfg,
            event: None,
        })
    }
}
