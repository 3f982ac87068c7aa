//! Where the members of a run spread over several processes run, as the watchdog's
//! who-waits-on-whom report names them.

use std::collections::HashMap;

/// How a report names the engine's replica `replica` where each data-parallel replica
/// is `shards` tensor shards: `replica 3`, or under tensor parallelism the data-parallel
/// replica and the shard it is, `dp 1 tp 1` (the engine's replica `r` is shard
/// `r % shards` of data-parallel replica `r / shards`).
pub(crate) fn replica_name(replica: usize, shards: usize) -> String {
    match shards > 1 {
        true => format!("dp {} tp {}", replica / shards, replica % shards),
        false => format!("replica {replica}"),
    }
}

/// The other processes' members, by (replica, rank), with where each runs (e.g.
/// `node c [rank 2 = dp 1, pp 0]`); members of this process are not listed.
#[derive(Debug, Default)]
pub(crate) struct Places {
    replicas: usize,
    shards: usize,
    elsewhere: HashMap<(usize, usize), String>,
}

impl Places {
    /// `replicas` engine replicas of `shards` tensor shards a data-parallel replica.
    pub(crate) fn new(
        (replicas, shards): (usize, usize),
        elsewhere: HashMap<(usize, usize), String>,
    ) -> Places {
        Places {
            replicas,
            shards,
            elsewhere,
        }
    }

    /// The run's data-parallel replicas, in all processes.
    pub(crate) fn replicas(&self) -> usize {
        self.replicas
    }

    /// ` (replica 0 rank 1 on node b ...)` when another process runs member (`replica`,
    /// `rank`); nothing when this one does.
    pub(crate) fn member(&self, replica: usize, rank: usize) -> String {
        match self.elsewhere.get(&(replica, rank)) {
            Some(p) => format!(" ({} rank {rank} on {p})", self.name(replica)),
            None => String::new(),
        }
    }

    /// How a report names `replica` ([`replica_name`]).
    pub(crate) fn name(&self, replica: usize) -> String {
        replica_name(replica, self.shards)
    }

    /// The members of `rank` in the replicas other than `replica` that other processes
    /// run, with where, as ` (replica 1 rank 0 on node c ...; ...)`; nothing when none.
    pub(crate) fn other_replicas(&self, replica: usize, rank: usize) -> String {
        let far: Vec<String> = (0..self.replicas)
            .filter(|&r| r != replica)
            .filter_map(|r| {
                let p = self.elsewhere.get(&(r, rank))?;
                Some(format!("{} rank {rank} on {p}", self.name(r)))
            })
            .collect();
        match far.is_empty() {
            true => String::new(),
            false => format!(" ({})", far.join("; ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_named_by_its_data_parallel_replica_and_shard_under_tensor_parallelism() {
        assert_eq!(replica_name(3, 1), "replica 3");
        assert_eq!(replica_name(3, 2), "dp 1 tp 1");
        assert_eq!(replica_name(4, 2), "dp 2 tp 0");
        let far = HashMap::from([
            ((1, 0), "node b".to_string()),
            ((3, 0), "node d".to_string()),
        ]);
        let places = Places::new((4, 2), far);
        assert_eq!(places.member(1, 0), " (dp 0 tp 1 rank 0 on node b)");
        assert_eq!(places.member(0, 0), "");
        assert_eq!(
            places.other_replicas(0, 0),
            " (dp 0 tp 1 rank 0 on node b; dp 1 tp 1 rank 0 on node d)"
        );
    }
}
