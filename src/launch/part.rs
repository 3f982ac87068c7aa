//! This node's part of the job: the (replica, rank) members it runs, where every other
//! member runs, and the transfers, collectives and tensor-parallel groups between them
//! over the mesh.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::{Bus, Distribution};

use super::worker::node_label;
use crate::cluster::ClusterManifest;
use crate::comm::{link_transfers, Mesh, MeshCollective, MeshShardGroups};
use crate::compute::Device;
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
    let members: Vec<(usize, usize)> = manifest
        .ranks_of(me)
        .iter()
        .map(|c| (c.dp * hp + c.tp, c.pp))
        .collect();
    let devices = member_devices(manifest, me, &members)?;
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
        devices,
    })
}

/// The device of each of this node's `members`, in rank order, where the manifest lists
/// the node's `gpus`: the node's i-th rank on its i-th GPU (the configuration then
/// trains on a GPU: `ClusterManifest::check_train_config`).
///
/// # Errors
/// A listed GPU the driver does not have, naming the field.
fn member_devices(
    manifest: &ClusterManifest,
    me: usize,
    members: &[(usize, usize)],
) -> Result<HashMap<(usize, usize), Device>, String> {
    let Some(gpus) = manifest.nodes().get(me).and_then(|n| n.gpus.as_ref()) else {
        return Ok(HashMap::new());
    };
    let field = format!("nodes[{me}].gpus");
    let mut devices = HashMap::new();
    for (&member, &gpu) in members.iter().zip(gpus) {
        let device = Device::Cuda(gpu as usize);
        crate::compute::check_device(device).map_err(|e| format!("{field} lists {gpu}: {e}"))?;
        devices.insert(member, device);
    }
    Ok(devices)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Node `a` lists two GPUs for its two ranks; node `b` runs its two on CPUs.
    const MANIFEST: &str = "[job]\nname = \"t\"\nrendezvous = \"127.0.0.1:29400\"\n\
        secret_file = \"s\"\n[layout]\ndata_parallel = 2\npipeline_parallel = 2\n\
        [[nodes]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = 29500\ngpus = [3, 1]\n\
        [[nodes]]\nname = \"b\"\naddress = \"127.0.0.2\"\nport = 29500\ncpu_slots = 2\n";

    /// A node's `gpus` place its ranks, in order, on those devices; a node of
    /// `cpu_slots` keeps the configuration's device.
    #[test]
    fn a_nodes_gpus_place_its_ranks_in_order() {
        let m = ClusterManifest::parse(MANIFEST, std::path::Path::new("c.toml")).unwrap();
        let members = [(0, 0), (0, 1)];
        assert!(member_devices(&m, 1, &members).unwrap().is_empty());
        let gpu = member_devices(&m, 0, &members);
        match crate::compute::check_device(Device::Cuda(3)) {
            Ok(()) => {
                let want = [((0, 0), Device::Cuda(3)), ((0, 1), Device::Cuda(1))];
                assert_eq!(gpu.unwrap(), want.into());
            }
            // This machine has no cuda:3: the error names the field and the device.
            Err(_) => {
                let e = gpu.unwrap_err();
                assert!(e.contains("nodes[0].gpus lists 3"), "{e}");
            }
        }
    }
}
