//! This node's part of the job: the (replica, rank) members it runs, where every other
//! member runs, and the transfers, collectives and tensor-parallel groups between them
//! over the mesh.

use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::{Bus, Distribution};

use super::worker::node_label;
use crate::cluster::ClusterManifest;
use crate::comm::{link_transfers, Mesh, MeshCollective, MeshShardGroups};
use crate::config::TrainConfig;
use crate::train::ClusterPart;

/// This node's (`me`) part of the job that `manifest` lays out and `cfg` trains, its
/// members talking to the others over `mesh` and `bus`.
///
/// # Errors
/// The schedule of `cfg` cannot be generated (its reason).
pub(super) fn cluster_part(
    manifest: &ClusterManifest,
    cfg: &TrainConfig,
    me: usize,
    mesh: &Arc<Mesh>,
    bus: Arc<dyn Bus>,
) -> Result<ClusterPart<MeshCollective>, String> {
    let hp = manifest.layout().tensor_parallel;
    let owner = owners(manifest);
    // Node by [replica][stage] under the schedule's placement of stages on ranks.
    let schedule = cfg.schedule().generate().map_err(|e| e.to_string())?;
    let stage_rank = schedule.placement();
    let by_stage: Vec<Vec<usize>> = owner
        .iter()
        .map(|ranks| stage_rank.iter().map(|&r| ranks[r]).collect())
        .collect();
    let members = manifest
        .ranks_of(me)
        .iter()
        .map(|c| (c.dp * hp + c.tp, c.pp))
        .collect();
    let patience = Duration::from_secs_f64(cfg.watchdog_seconds);
    let shard_groups = (hp > 1).then(|| {
        let groups = MeshShardGroups::new(mesh.clone(), by_stage.clone(), hp, patience);
        Arc::new(groups) as Arc<dyn crate::compute::ShardGroups>
    });
    let collective = MeshCollective::new(mesh.clone(), by_stage)
        .with_shards(hp)
        .with_algorithm(cfg.runtime.all_reduce);
    let collective = Arc::new(collective);
    let places = places(manifest, &owner, me);
    let (peers, deliver) = link_transfers(mesh.clone(), owner);
    Ok(ClusterPart {
        node: me,
        members,
        dist: Distribution {
            peers,
            deliver,
            collective,
            bus,
            places,
        },
        shard_groups,
    })
}

/// Node by [replica][rank]. The engine's replica `r` is tensor shard `r % hp` of
/// data-parallel replica `r / hp`.
fn owners(manifest: &ClusterManifest) -> Vec<Vec<usize>> {
    let layout = manifest.layout();
    let hp = layout.tensor_parallel;
    (0..layout.data_parallel * hp)
        .map(|r| {
            (0..layout.pipeline_parallel)
                .map(|pp| {
                    let rank = layout.rank(r / hp, pp, r % hp).unwrap_or(usize::MAX);
                    manifest.node_of_rank(rank).unwrap_or(usize::MAX)
                })
                .collect()
        })
        .collect()
}

/// Where the other nodes' members run, as the watchdog's report names them.
fn places(
    manifest: &ClusterManifest,
    owner: &[Vec<usize>],
    me: usize,
) -> std::collections::HashMap<(usize, usize), String> {
    owner
        .iter()
        .enumerate()
        .flat_map(|(dp, ranks)| ranks.iter().enumerate().map(move |(pp, &n)| ((dp, pp), n)))
        .filter(|&(_, n)| n != me && n < manifest.nodes().len())
        .map(|(key, n)| (key, format!("node {}", node_label(manifest, n))))
        .collect()
}
