//! The worker: this node's part of the job. It meets the other workers (a full mesh of
//! authenticated connections), checks that every node runs the same manifest and
//! configuration, agrees on the checkpoint to resume from (node 0's choice), and trains
//! the node's (replica, rank) members with the transport in between. Node 0 reports
//! the run (progress, metrics file, TensorBoard) and writes the trained model.

use std::io::IsTerminal;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pipetrain_actors::Bus;
use sha2::{Digest, Sha256};

use super::part::cluster_part;
use super::{Ended, LaunchArgs, Placement};
use crate::cluster::{process_env, ClusterManifest, Endpoint};
use crate::comm::{Mesh, MeshBus, MeshTimeouts};
use crate::compute::Runtime;
use crate::train::{
    latest_checkpoint, run_cluster, ClusterPart, Reporter, RunEvent, RunOptions, StopOnSignal,
};
use crate::{Error, Result};
use pipetrain_actors::RunControl;

/// Runs this node's worker to the end of the job (or its failure). A SIGINT or SIGTERM
/// stops the whole job after the same step on every node, with a checkpoint (see
/// [`StopOnSignal`]): [`Ended::Stopped`] by that signal, SIGTERM when another node's
/// did. An elastic job regroups first ([`super::elastic`]), and a lost peer ends it as
/// [`Ended::LostPeer`] rather than as a failure.
///
/// # Errors
/// A bad manifest, configuration or secret; nodes that disagree; the run's failure,
/// another node's included.
pub(super) fn run_worker(args: &LaunchArgs) -> Result<Ended> {
    let placement = Placement::load(args)?;
    let secret = placement.manifest.secret(&process_env)?;
    let rt = Runtime::from_env()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Error::io(&args.config))?;
    let (control, requests) = flume::unbounded();
    let who = format!("pipetrain launch: node {}", placement.node.name);
    let signals = StopOnSignal::install(&who, move |_| {
        let _ = control.send(RunControl::Stop);
    })?;
    let ended = runtime.block_on(async {
        let placement = match placement.manifest.job().elastic {
            true => super::elastic::regroup(placement, &secret, &args.config).await?,
            false => Some(placement),
        };
        match placement {
            Some(p) => work(args, p, &secret, &rt, requests).await,
            None => Ok(Ended::Left),
        }
    })?;
    Ok(match (signals.received(), ended) {
        (Some(sig), _) => Ended::Stopped(sig),
        (None, Ended::Stopped(_)) => Ended::Stopped(signal_hook::consts::SIGTERM),
        (None, other) => other,
    })
}

/// Joins the job and trains: finished, stopped before its last step (by a stop here or
/// on another node), or (elastic) a peer lost.
async fn work(
    args: &LaunchArgs,
    p: Placement,
    secret: &[u8],
    rt: &Runtime,
    requests: flume::Receiver<RunControl>,
) -> Result<Ended> {
    let Placement {
        manifest,
        node,
        mut cfg,
        mesh_job,
        event,
    } = p;
    let me = node.index;
    let failed = |reason: String| Error::Launch {
        node: node.name.clone(),
        reason,
    };
    let job = manifest.job();
    let mesh = join(&manifest, me, &mesh_job, secret, &failed).await?;
    let bus: Arc<dyn Bus> = Arc::new(MeshBus::new(mesh.clone()));
    agree(bus.as_ref(), &manifest, args, &failed).await?;
    if args.resume && cfg.checkpoint_to_load_path.is_none() {
        cfg.checkpoint_to_load_path = resume_choice(bus.as_ref(), &cfg, args, me).await?;
    }
    let part = cluster_part(&manifest, &cfg, me, &mesh, bus).map_err(failed)?;
    // A peer gone or silent fails the mesh; the stage actors waiting on its messages
    // would only notice at the watchdog, so the job stops here at once (dropping the run
    // aborts this process's actors) and the supervisors restart it.
    let result = tokio::select! {
        r = train(rt, &cfg, args, (part, requests), &node.name, event) => r,
        why = mesh.failed() => Err(failed(format!("the job lost a node: {why}"))),
    };
    match &result {
        Ok(_) => mesh.shutdown().await,
        Err(_) => mesh.abort(),
    }
    match (result, mesh.failure()) {
        (Ok(true), _) => Ok(Ended::Stopped(signal_hook::consts::SIGTERM)),
        (Ok(false), _) => Ok(Ended::Finished),
        (Err(_), Some(why)) if job.elastic => {
            eprintln!(
                "pipetrain launch: node {}: the job lost a node: {why}",
                node.name
            );
            Ok(Ended::LostPeer)
        }
        (Err(e), _) => Err(e),
    }
}

/// Connects this node (`me`) to every other node of the job: the authenticated mesh.
async fn join(
    manifest: &ClusterManifest,
    me: usize,
    mesh_job: &str,
    secret: &[u8],
    failed: &dyn Fn(String) -> Error,
) -> Result<Arc<Mesh>> {
    let job = manifest.job();
    let addresses = mesh_addresses(manifest).await?;
    let listen = listen_address(manifest, me, addresses[me]);
    let timeouts = MeshTimeouts {
        connect: job.connect_timeout(),
        heartbeat: job.heartbeat(),
        peer_timeout: job.peer_timeout(),
    };
    let names = (0..manifest.nodes().len())
        .map(|i| node_label(manifest, i))
        .collect();
    Mesh::connect(me, mesh_job, listen, addresses, names, secret, timeouts)
        .await
        .map_err(|e| failed(format!("could not join the job: {e}")))
}

/// Trains this node's part, reporting on node 0 (with `event`, an elastic regroup, in
/// its first step's metrics); whether it stopped before its last step (a stop request,
/// here or on another node).
async fn train<K: pipetrain_actors::Collective>(
    rt: &Runtime,
    cfg: &crate::config::TrainConfig,
    args: &LaunchArgs,
    (part, requests): (ClusterPart<K>, flume::Receiver<RunControl>),
    name: &str,
    event: Option<String>,
) -> Result<bool> {
    let me = part.node;
    let resuming = cfg.checkpoint_to_load_path.is_some();
    let stderr = std::io::stderr();
    let is_terminal = stderr.is_terminal();
    let mut reporter = match me {
        0 => Some(
            Reporter::new(cfg, stderr, is_terminal, args.metrics.as_deref(), resuming)?
                .with_event(event),
        ),
        _ => None,
    };
    if let (0, Some(path)) = (me, &cfg.checkpoint_to_load_path) {
        eprintln!("pipetrain launch: resuming from {}", path.display());
    }
    let mut on_event = |e: RunEvent| match e {
        RunEvent::Step(r) => {
            if let Some(rep) = reporter.as_mut() {
                rep.step(&r);
            }
        }
        RunEvent::Warning(w) => eprintln!("pipetrain launch: node {name}: {w}"),
        _ => {}
    };
    let opts = RunOptions {
        cancel: None,
        record_trace: false,
        data: None,
        eval_data: None,
        control: Some(requests),
        on_event: &mut on_event,
    };
    let summary = run_cluster(rt, cfg, &args.config, opts, part).await?;
    let last = cfg.optimizer_steps() as u64;
    let stopped_at = summary.first_step + summary.steps as u64;
    if let Some(rep) = reporter {
        rep.finish(&summary)?;
        if stopped_at < last {
            eprintln!(
                "pipetrain launch: the job stopped after step {stopped_at}; `pipetrain launch ... --resume` goes on"
            );
        } else if let Some(out) = &cfg.output_path {
            eprintln!("trained model: {}", out.display());
        }
    }
    Ok(stopped_at < last)
}

/// Where each node's worker listens for the others: node 0 at the job's rendezvous
/// address, the others at their `address:port`. Host names are resolved here.
pub(super) async fn mesh_addresses(manifest: &ClusterManifest) -> Result<Vec<SocketAddr>> {
    let mut out = Vec::with_capacity(manifest.nodes().len());
    for (i, n) in manifest.nodes().iter().enumerate() {
        let ep = match i {
            0 => manifest.rendezvous().clone(),
            _ => Endpoint {
                host: n.host(),
                port: n.port,
            },
        };
        out.push(resolve(&ep, manifest, i).await?);
    }
    Ok(out)
}

async fn resolve(ep: &Endpoint, manifest: &ClusterManifest, node: usize) -> Result<SocketAddr> {
    if let Some(addr) = ep.socket_addr() {
        return Ok(addr);
    }
    let text = ep.to_string();
    let bad = |rule: String| Error::Config {
        path: manifest.path().to_path_buf(),
        field: format!("nodes[{node}].address"),
        rule,
    };
    let mut found = tokio::net::lookup_host(text.as_str())
        .await
        .map_err(|e| bad(format!("cannot resolve `{text}`: {e}")))?;
    found
        .next()
        .ok_or_else(|| bad(format!("`{text}` resolves to no address")))
}

/// The address this node's listener binds: the wildcard with `bind_all`, else the
/// address peers dial.
pub(super) fn listen_address(
    manifest: &ClusterManifest,
    me: usize,
    dialed: SocketAddr,
) -> SocketAddr {
    let bind: Option<IpAddr> = manifest.nodes()[me].bind_ip();
    bind.map_or(dialed, |ip| SocketAddr::new(ip, dialed.port()))
}

/// Checks that every node runs the same manifest and configuration (by their bytes'
/// SHA-256) and the same start of the job.
async fn agree(
    bus: &dyn Bus,
    manifest: &ClusterManifest,
    args: &LaunchArgs,
    failed: &dyn Fn(String) -> Error,
) -> Result<()> {
    let digest = |path: &Path| -> Result<String> {
        let bytes = std::fs::read(path).map_err(Error::io(path))?;
        Ok(format!("{:x}", Sha256::digest(&bytes)))
    };
    let mine = serde_json::json!({
        "manifest": digest(manifest.path())?,
        "config": digest(&args.config)?,
        "attempt": args.attempt,
    });
    let all = bus
        .all_gather("hello".into(), mine.to_string().into_bytes())
        .await
        .map_err(|e| failed(e.to_string()))?;
    for (node, bytes) in all.iter().enumerate() {
        let theirs: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
        for (what, file) in [
            ("manifest", manifest.path()),
            ("config", args.config.as_path()),
        ] {
            if theirs[what] != mine[what] {
                return Err(failed(format!(
                    "node {} runs a different {what} than {} (SHA-256 {} here, {} there); every node needs the same files",
                    manifest.nodes()[node].name,
                    file.display(),
                    mine[what],
                    theirs[what]
                )));
            }
        }
    }
    Ok(())
}

/// The checkpoint every node resumes from: node 0's newest complete one.
async fn resume_choice(
    bus: &dyn Bus,
    cfg: &crate::config::TrainConfig,
    args: &LaunchArgs,
    me: usize,
) -> Result<Option<PathBuf>> {
    let mine = match me {
        0 => latest_checkpoint(cfg, &args.config)?,
        _ => None,
    };
    let all = bus
        .all_gather(
            "resume".into(),
            serde_json::to_vec(&mine).unwrap_or_default(),
        )
        .await
        .map_err(Error::runtime)?;
    let chosen: Option<PathBuf> = all
        .first()
        .and_then(|b| serde_json::from_slice(b).ok())
        .flatten();
    if me == 0 && chosen.is_none() {
        eprintln!("pipetrain launch: no complete checkpoint yet; starting from step 0");
    }
    Ok(chosen)
}

/// How messages name node `i`: its name and its ranks with their (dp, pp) coordinates,
/// as `c [rank 2 = dp 1, pp 0]`.
pub(super) fn node_label(manifest: &ClusterManifest, i: usize) -> String {
    let ranks: Vec<String> = manifest
        .ranks_of(i)
        .iter()
        .map(|c| format!("rank {} = dp {}, pp {}", c.rank, c.dp, c.pp))
        .collect();
    format!("{} [{}]", manifest.nodes()[i].name, ranks.join("; "))
}
