//! Where a layout's ranks run when they are spread over the nodes of a cluster manifest
//! (one `pipetrain launch` process a node), and what crossing between nodes costs.
//!
//! Ranks fill the nodes in order, as many as each node has slots (the manifest's rule,
//! Megatron-LM's order: rank `r = (dp x pp + p) x tp + t`). Stage actors of one node hand
//! values over in memory (the machine's measured hop); a value going to another node
//! crosses the [`Link`]: it waits the link's latency and its bytes' time on the wire, and
//! its encoding and copies are work on the sender's cores, measured through pipetrain's
//! own transport (`plan::link`). A stage's data-parallel reduction
//! whose replicas sit on more than one node is the mesh's ring: `2 (n - 1)` rounds, each
//! moving `1 / n` of the stage's gradients over the link.

use serde::{Deserialize, Serialize};

use super::Candidate;

/// A connection's cost for one kind of message: a fixed part and a part per byte.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rate {
    /// Seconds a message takes beside its bytes.
    pub latency: f64,
    /// Seconds per byte.
    pub per_byte: f64,
}

impl Rate {
    /// Seconds for a message of `bytes`.
    pub fn message(&self, bytes: f64) -> f64 {
        self.latency + bytes * self.per_byte
    }
}

/// The connection between two nodes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// A stage's activations or gradients going to another node's stage: what the value
    /// waits beside the work of sending it (the hand-over to the transport and back, the
    /// bytes on the wire; none on loopback, where moving bytes is all copying).
    pub message: Rate,
    /// The work of a stage's message, seconds per byte on a core: encoded, copied into
    /// the socket and out, decoded. Charged to the action that sends it, so it takes its
    /// share of the cores.
    pub message_work: f64,
    /// What a stage's message waits more when it finds its receiver idle: the other
    /// process's sleeping threads woken (the transport's, then the actor's).
    #[serde(default)]
    pub wake: f64,
    /// A segment of the data-parallel ring: floats sent straight from the gradient
    /// buffer and added in as they arrive.
    pub segment: Rate,
}

impl Link {
    /// Seconds for a ring all-reduce of `bytes` among `n` members: `2 (n - 1)` rounds,
    /// each a segment of `bytes / n`.
    pub fn ring(&self, bytes: f64, n: usize) -> f64 {
        match n {
            0 | 1 => 0.0,
            n => 2.0 * (n - 1) as f64 * self.segment.message(bytes / n as f64),
        }
    }
}

/// The nodes of a cluster: how many ranks each runs, and on how many machines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nodes {
    /// Ranks each node runs, in node order.
    pub slots: Vec<usize>,
    /// The machines the nodes are on (1: every node on this one, sharing its cores).
    pub hosts: usize,
}

impl Nodes {
    /// The node that runs global rank `rank` (ranks fill the nodes in order); the last
    /// node for a rank past every slot.
    pub fn node_of(&self, rank: usize) -> usize {
        let mut first = 0;
        for (node, &n) in self.slots.iter().enumerate() {
            first += n;
            if rank < first {
                return node;
            }
        }
        self.slots.len().saturating_sub(1)
    }

    /// Every slot.
    pub fn total(&self) -> usize {
        self.slots.iter().sum()
    }

    /// The node of `c`'s member (data-parallel replica `dp`, pipeline rank `pp`, tensor
    /// shard `tp`).
    pub fn member(&self, c: &Candidate, (dp, pp, tp): (usize, usize, usize)) -> usize {
        self.node_of((dp * c.pp + pp) * c.tp + tp)
    }

    /// Whether some stage's tensor shards run on more than one node (their all-reduces
    /// would cross the link, which the shards' profiles did not measure).
    pub fn splits_shards(&self, c: &Candidate) -> bool {
        (0..c.dp).any(|d| {
            (0..c.pp).any(|p| {
                let first = self.member(c, (d, p, 0));
                (1..c.tp).any(|t| self.member(c, (d, p, t)) != first)
            })
        })
    }

    /// Whether a value from pipeline rank `from` to rank `to` leaves its node in some
    /// data-parallel replica.
    pub fn hop_crosses(&self, c: &Candidate, from: usize, to: usize) -> bool {
        (0..c.dp).any(|d| self.member(c, (d, from, 0)) != self.member(c, (d, to, 0)))
    }

    /// Whether the data-parallel replicas of pipeline rank `pp` run on more than one node.
    pub fn ring_crosses(&self, c: &Candidate, pp: usize) -> bool {
        let first = self.member(c, (0, pp, 0));
        (1..c.dp).any(|d| self.member(c, (d, pp, 0)) != first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dp: usize, tp: usize, pp: usize) -> Candidate {
        Candidate::one_f_one_b((dp, tp, pp), (4, 1))
    }

    #[test]
    fn ranks_fill_the_nodes_in_order() {
        let nodes = Nodes {
            slots: vec![2, 1, 1],
            hosts: 1,
        };
        let at: Vec<usize> = (0..4).map(|r| nodes.node_of(r)).collect();
        assert_eq!(at, vec![0, 0, 1, 2]);
        assert_eq!(nodes.total(), 4);
    }

    #[test]
    fn what_crosses_follows_the_placement() {
        // dp 2 x pp 2 on four nodes of one slot: every hop and every ring crosses.
        let four = Nodes {
            slots: vec![1; 4],
            hosts: 1,
        };
        let c = layout(2, 1, 2);
        assert!(four.hop_crosses(&c, 0, 1));
        assert!(four.ring_crosses(&c, 0) && four.ring_crosses(&c, 1));
        // On two nodes of two slots, each replica is one node: its hops stay in memory,
        // its rings cross.
        let two = Nodes {
            slots: vec![2, 2],
            hosts: 1,
        };
        assert!(!two.hop_crosses(&c, 0, 1));
        assert!(two.ring_crosses(&c, 1));
        // pp 4 on the same nodes: the hop from rank 1 to 2 crosses, 0 to 1 does not.
        let p = layout(1, 1, 4);
        assert!(!two.hop_crosses(&p, 0, 1) && two.hop_crosses(&p, 1, 2));
        assert!(!two.ring_crosses(&p, 0));
    }

    #[test]
    fn tensor_shards_split_over_nodes_are_seen() {
        let c = layout(1, 2, 2);
        let nodes = |slots: Vec<usize>| Nodes { slots, hosts: 1 };
        assert!(!nodes(vec![2, 2]).splits_shards(&c));
        assert!(nodes(vec![1, 2, 1]).splits_shards(&c));
    }

    #[test]
    fn a_ring_moves_each_byte_twice_less_a_share() {
        let rate = Rate {
            latency: 1e-4,
            per_byte: 1e-9,
        };
        let link = Link {
            message: Rate {
                latency: 1.0,
                per_byte: 1.0,
            },
            message_work: 1.0,
            wake: 0.0,
            segment: rate,
        };
        assert_eq!(link.ring(1e6, 1), 0.0);
        // Two members: two rounds of half the bytes.
        let two = link.ring(1e6, 2);
        assert!((two - 2.0 * (1e-4 + 0.5e-3)).abs() < 1e-12, "{two}");
        // Four: six rounds of a quarter.
        let four = link.ring(1e6, 4);
        assert!((four - 6.0 * (1e-4 + 0.25e-3)).abs() < 1e-12, "{four}");
    }
}
