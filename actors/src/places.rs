//! Where the members of a run spread over several processes run, as the watchdog's
//! who-waits-on-whom report names them.

use std::collections::HashMap;

/// The other processes' members, by (replica, rank), with where each runs (e.g.
/// `node c [rank 2 = dp 1, pp 0]`); members of this process are not listed.
#[derive(Debug, Default)]
pub(crate) struct Places {
    replicas: usize,
    elsewhere: HashMap<(usize, usize), String>,
}

impl Places {
    pub(crate) fn new(replicas: usize, elsewhere: HashMap<(usize, usize), String>) -> Places {
        Places {
            replicas,
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
            Some(p) => format!(" (replica {replica} rank {rank} on {p})"),
            None => String::new(),
        }
    }

    /// The members of `rank` in the replicas other than `replica` that other processes
    /// run, with where, as ` (replica 1 rank 0 on node c ...; ...)`; nothing when none.
    pub(crate) fn other_replicas(&self, replica: usize, rank: usize) -> String {
        let far: Vec<String> = (0..self.replicas)
            .filter(|&r| r != replica)
            .filter_map(|r| {
                let p = self.elsewhere.get(&(r, rank))?;
                Some(format!("replica {r} rank {rank} on {p}"))
            })
            .collect();
        match far.is_empty() {
            true => String::new(),
            false => format!(" ({})", far.join("; ")),
        }
    }
}
