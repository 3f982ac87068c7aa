//! This process's part of a run spread over several processes (`pipetrain launch`): the
//! (replica, rank) members it runs, the transport to the others, and the parameters
//! gathered from every process at the end, for the trained model.

use pipetrain_actors::{Bus, Distribution};
use prost::Message;

use crate::onnx::proto::GraphProto;
use crate::pipeline::Payload;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// This process's part of a distributed run.
pub struct ClusterPart<K> {
    /// This process's index (0 reports the run, commits checkpoints, writes the model).
    pub node: usize,
    /// The (replica, pipeline rank) members this process runs.
    pub members: Vec<(usize, usize)>,
    /// Mailboxes of the other processes' members, the collective, and the bus.
    pub dist: Distribution<Payload, K>,
    /// The tensor shards' groups across the job's nodes (`None`: not split).
    pub shard_groups: Option<std::sync::Arc<dyn crate::compute::ShardGroups>>,
    /// The device of each (replica, pipeline rank) member here that does not compute on
    /// the configuration's `runtime.device` (a node's `gpus` in the manifest).
    pub devices: std::collections::HashMap<(usize, usize), crate::compute::Device>,
}

impl<K> ClusterPart<K> {
    /// The devices of this process's members by (replica, stage), under the schedule's
    /// `placement` (pipeline rank by stage).
    pub(super) fn stage_devices(&self, placement: &[usize]) -> super::replica_links::MemberDevices {
        let mut out = super::replica_links::MemberDevices::new();
        for (stage, rank) in placement.iter().enumerate() {
            for (&(replica, r), &device) in &self.devices {
                if r == *rank {
                    out.insert((replica, stage), device);
                }
            }
        }
        out
    }

    /// Whether this process runs `stage` of `replica`, under the schedule's `placement`
    /// (pipeline rank by stage).
    pub(super) fn owns(&self, replica: usize, stage: usize, placement: &[usize]) -> bool {
        placement
            .get(stage)
            .is_some_and(|&rank| self.members.contains(&(replica, rank)))
    }
}

/// Every process's `local` parameters (its stages of data-parallel replica 0, possibly
/// none, each with its tensor shard), merged: by shard, the same in every process.
///
/// # Errors
/// `Runtime` when the bus breaks; `Data` when a process sent bytes that do not decode.
pub(super) async fn gather_parameters(
    bus: &dyn Bus,
    local: Vec<(usize, String, Tensor)>,
) -> Result<Vec<Vec<(String, Tensor)>>> {
    // A tensor shard's part goes with its shard in the doc string.
    let graph = GraphProto {
        initializer: local
            .iter()
            .map(|(k, n, t)| {
                let mut p = t.to_proto(n);
                p.doc_string = k.to_string();
                p
            })
            .collect(),
        ..Default::default()
    };
    let all = bus
        .all_gather("parameters".into(), graph.encode_to_vec())
        .await
        .map_err(Error::runtime)?;
    let mut out: Vec<Vec<(String, Tensor)>> = Vec::new();
    for (node, bytes) in all.iter().enumerate() {
        let bad = |reason: String| Error::Data {
            path: format!("<node {node}>").into(),
            what: "trained parameters".into(),
            reason,
        };
        let graph = GraphProto::decode(bytes.as_slice()).map_err(|e| bad(e.to_string()))?;
        for p in &graph.initializer {
            let k: usize = p
                .doc_string
                .parse()
                .map_err(|_| bad("no tensor shard".into()))?;
            if out.len() <= k {
                out.resize_with(k + 1, Vec::new);
            }
            if !out[k].iter().any(|(n, _)| n == &p.name) {
                out[k].push((p.name.clone(), Tensor::from_proto(p)?));
            }
        }
    }
    Ok(out)
}
