//! An elastic job's worker regroups before it trains: the nodes that came back meet in
//! the first node's lobby ([`crate::comm::host_lobby`]), waiting up to
//! `job.connect_timeout_s` for the rest, and go on as the job those nodes can hold
//! ([`ClusterManifest::shrink`]): fewer replicas, each accumulating more micro-batches,
//! so the global batch, the samples of each step and the number of steps stay; the
//! restart resumes from the newest complete checkpoint, which loads at any layout. A
//! node left without a rank leaves the job. Every start regroups from the full
//! manifest, so a job whose nodes are all back runs at its full size again.

use super::worker::{listen_address, mesh_addresses};
use super::Placement;
use crate::cluster::ClusterManifest;
use crate::comm::{host_lobby, join_lobby, Gathered};
use crate::{Error, Result};

/// This node's place in the job that goes on, or `None` when it goes on without it.
///
/// # Errors
/// The lobby failed (the first node gone, a refused proof); the nodes left are fewer
/// than `job.min_nodes` or hold no replica; the smaller run breaks a rule of the
/// configuration.
pub(super) async fn regroup(
    p: Placement,
    secret: &[u8],
    config: &std::path::Path,
) -> Result<Option<Placement>> {
    let m = &p.manifest;
    let me = p.node.index;
    let failed = |reason: String| Error::Launch {
        node: p.node.name.clone(),
        reason,
    };
    let gathered = gather(m, me, secret)
        .await
        .map_err(|e| failed(format!("could not regroup the elastic job: {e}")))?;
    let mesh_job = gathered.mesh_job(&m.job().name);
    if gathered.present.len() == m.nodes().len() {
        return Ok(Some(Placement { mesh_job, ..p }));
    }
    let micro_batches = p.cfg.data_parallel_size * p.cfg.gradient_accumulation_steps;
    let shrunk = m.shrink(&gathered.present, micro_batches)?;
    let (from, to) = (m.layout(), shrunk.manifest.layout());
    let cfg = p.cfg.at_data_parallel(to.data_parallel, config)?;
    let names = |nodes: &mut dyn Iterator<Item = usize>| {
        nodes
            .map(|i| m.nodes()[i].name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let event = format!(
        "elastic: {} of {} nodes are left (gone: {}); the job goes on at dp {} x pp {} (was dp {} x pp {}) on {}, each replica accumulating {} micro-batches (was {}): the same global batch",
        gathered.present.len(),
        m.nodes().len(),
        names(&mut (0..m.nodes().len()).filter(|i| !gathered.present.contains(i))),
        to.data_parallel,
        to.pipeline_parallel,
        from.data_parallel,
        from.pipeline_parallel,
        names(&mut shrunk.kept.iter().copied()),
        cfg.gradient_accumulation_steps,
        p.cfg.gradient_accumulation_steps,
    );
    eprintln!("pipetrain launch: node {}: {event}", p.node.name);
    let Some(index) = shrunk.kept.iter().position(|&i| i == me) else {
        eprintln!(
            "pipetrain launch: node {}: no rank is left for it; it leaves the job",
            p.node.name
        );
        return Ok(None);
    };
    let mut node = p.node;
    node.index = index;
    Ok(Some(Placement {
        manifest: shrunk.manifest,
        node,
        cfg,
        mesh_job,
        event: Some(event),
    }))
}

/// Meets the other nodes in the first node's lobby.
async fn gather(m: &ClusterManifest, me: usize, secret: &[u8]) -> Result<Gathered, String> {
    let job = m.job();
    let addresses = mesh_addresses(m).await.map_err(|e| e.to_string())?;
    let wait = job.connect_timeout();
    match me {
        0 => {
            let listen = listen_address(m, 0, addresses[0]);
            host_lobby(listen, m.nodes().len(), &job.name, secret, wait).await
        }
        _ => {
            let first = &m.nodes()[0].name;
            join_lobby(me, addresses[0], first, &job.name, secret, wait).await
        }
    }
}
