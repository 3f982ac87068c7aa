//! Elastic shrink: the smaller job an elastic manifest (`[job] elastic = true`) goes on
//! as when some of its nodes are gone for good.
//!
//! The pipeline keeps its stages and tensor shards; only the data-parallel size falls,
//! to the largest that the nodes left can hold and that shares a step's micro-batches
//! evenly (so each replica's gradient accumulation grows and the global batch stays).
//! The nodes left take the ranks in manifest order, as many as each has slots; those
//! without a rank leave the job. Pure: the launcher finds who is left.

use super::manifest::{ClusterManifest, ManifestFile};
use super::Layout;
use crate::{Error, Result};

/// The job that goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shrunk {
    /// The manifest of the nodes that keep ranks, in the full manifest's order, with
    /// the smaller layout.
    pub manifest: ClusterManifest,
    /// Each of those nodes' index in the full manifest.
    pub kept: Vec<usize>,
}

impl ClusterManifest {
    /// The job on the nodes `present` (indices into [`ClusterManifest::nodes`],
    /// ascending) when a step has `micro_batches` micro-batches over all replicas
    /// (`data_parallel_size x gradient_accumulation_steps`). With every node present
    /// it is this job.
    ///
    /// # Errors
    /// `Config` on `job.min_nodes` when fewer nodes are left, on `job.rendezvous` when
    /// the first node (which hosts the rendezvous) is not among them, on `nodes` when
    /// their slots hold no replica.
    pub fn shrink(&self, present: &[usize], micro_batches: usize) -> Result<Shrunk> {
        let bad = |field: &str, rule: String| Error::Config {
            path: self.path().to_path_buf(),
            field: field.into(),
            rule,
        };
        let names = || {
            let n: Vec<&str> = present
                .iter()
                .filter_map(|&i| self.nodes().get(i).map(|n| n.name.as_str()))
                .collect();
            n.join(", ")
        };
        let min = self.job().min_nodes.unwrap_or(1);
        if present.len() < min {
            return Err(bad(
                "job.min_nodes",
                format!(
                    "{} of the job's {} nodes are left ({}), fewer than min_nodes = {min}",
                    present.len(),
                    self.nodes().len(),
                    names()
                ),
            ));
        }
        if present.first() != Some(&0) {
            return Err(bad(
                "job.rendezvous",
                format!(
                    "the first node `{}` hosts the rendezvous, and the job cannot go on without it (left: {})",
                    self.nodes()[0].name,
                    names()
                ),
            ));
        }
        let full = self.layout();
        let per_replica = full.pipeline_parallel * full.tensor_parallel;
        let slots: usize = present.iter().map(|&i| self.nodes()[i].slots()).sum();
        let data_parallel = (1..=full.data_parallel)
            .rev()
            .find(|&d| micro_batches % d == 0 && d * per_replica <= slots)
            .ok_or_else(|| {
                bad(
                    "nodes",
                    format!(
                        "the nodes left ({}) have {slots} slots, fewer than the {per_replica} ranks of one replica",
                        names()
                    ),
                )
            })?;
        let layout = Layout {
            data_parallel,
            ..full
        };
        let (mut nodes, mut kept, mut next) = (Vec::new(), Vec::new(), 0);
        let world = data_parallel * per_replica;
        for &i in present {
            let node = &self.nodes()[i];
            let take = node.slots().min(world - next);
            if take == 0 {
                break;
            }
            let mut n = node.clone();
            n.ranks = Some((next..next + take).collect());
            nodes.push(n);
            kept.push(i);
            next += take;
        }
        let file = ManifestFile {
            job: self.job().clone(),
            layout,
            nodes,
        };
        Ok(Shrunk {
            manifest: ClusterManifest::from_parts(file, self.path())?,
            kept,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn manifest(slots: &[usize], dp: usize, pp: usize, min: Option<usize>) -> ClusterManifest {
        let mut text = format!(
            "[job]\nname = \"j\"\nrendezvous = \"10.0.0.1:29400\"\nsecret_env = \"S\"\nelastic = true\n{}\
             [layout]\ndata_parallel = {dp}\npipeline_parallel = {pp}\n",
            min.map(|m| format!("min_nodes = {m}\n")).unwrap_or_default()
        );
        for (i, s) in slots.iter().enumerate() {
            text += &format!(
                "[[nodes]]\nname = \"n{i}\"\naddress = \"10.0.0.{}\"\nport = 29500\ncpu_slots = {s}\n",
                i + 1
            );
        }
        ClusterManifest::parse(&text, Path::new("m.toml")).unwrap()
    }

    fn shape(s: &Shrunk) -> (usize, Vec<usize>, Vec<Vec<usize>>) {
        let ranks = (0..s.kept.len())
            .map(|i| s.manifest.ranks_of(i).iter().map(|c| c.rank).collect())
            .collect();
        (s.manifest.layout().data_parallel, s.kept.clone(), ranks)
    }

    #[test]
    fn every_node_present_is_the_same_job() {
        let m = manifest(&[1, 1, 1, 1], 2, 2, None);
        let s = m.shrink(&[0, 1, 2, 3], 8).unwrap();
        assert_eq!(
            shape(&s),
            (
                2,
                vec![0, 1, 2, 3],
                vec![vec![0], vec![1], vec![2], vec![3]]
            )
        );
    }

    #[test]
    fn a_lost_node_drops_a_replica_and_the_spare_node_leaves() {
        let m = manifest(&[1, 1, 1, 1], 2, 2, None);
        let s = m.shrink(&[0, 1, 2], 8).unwrap();
        assert_eq!(shape(&s), (1, vec![0, 1], vec![vec![0], vec![1]]));
        let s = m.shrink(&[0, 2, 3], 8).unwrap();
        assert_eq!(shape(&s), (1, vec![0, 2], vec![vec![0], vec![1]]));
    }

    #[test]
    fn the_replicas_left_share_the_steps_micro_batches_evenly() {
        // Three nodes left hold three replicas of one rank when 3 divides a step's
        // micro-batches (12), two when it does not (8).
        let m = manifest(&[1, 1, 1, 1], 4, 1, None);
        assert_eq!(
            m.shrink(&[0, 1, 2], 12)
                .unwrap()
                .manifest
                .layout()
                .data_parallel,
            3
        );
        assert_eq!(
            m.shrink(&[0, 1, 2], 8)
                .unwrap()
                .manifest
                .layout()
                .data_parallel,
            2
        );
    }

    #[test]
    fn nodes_with_several_slots_fill_in_order() {
        let m = manifest(&[2, 2, 2], 3, 2, None);
        let s = m.shrink(&[0, 2], 6).unwrap();
        assert_eq!(shape(&s), (2, vec![0, 2], vec![vec![0, 1], vec![2, 3]]));
    }

    #[test]
    fn refusals_name_the_rule() {
        let m = manifest(&[1, 1, 1, 1], 2, 2, Some(3));
        let e = m.shrink(&[0, 1], 8).unwrap_err().to_string();
        assert!(e.contains("job.min_nodes") && e.contains("n0, n1"), "{e}");
        let m = manifest(&[1, 1, 1, 1], 2, 2, None);
        let e = m.shrink(&[1, 2, 3], 8).unwrap_err().to_string();
        assert!(e.contains("job.rendezvous") && e.contains("n0"), "{e}");
        let e = m.shrink(&[0], 8).unwrap_err().to_string();
        assert!(e.contains("1 slots") && e.contains("2 ranks"), "{e}");
    }
}
