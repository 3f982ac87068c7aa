//! What data-parallel replicas add to a stage's step: the reduction of its gradients and,
//! sharded (ZeRO), the update on a share with the gather after it.

use super::topology::{Link, Nodes};
use super::{Candidate, Machinery};

/// A stage's data-parallel reduction of `values` gradients: in memory within one
/// process, the ring over `cluster`'s link where its replicas are on several nodes.
/// Sharded (ZeRO), each replica reduces only its part (a reduce-scatter: half the
/// ring's rounds); under stage 2 once a micro-batch as its buckets fill, each round
/// paying the measured [`Machinery::zero2_per_value`] (the replicas met, among others).
pub(super) fn reduce_seconds(
    c: &Candidate,
    m: &Machinery,
    values: f64,
    cluster: Option<(&Nodes, Link)>,
) -> f64 {
    let d = c.dp;
    if d == 1 {
        return 0.0;
    }
    let share = (d - 1) as f64 / d as f64;
    let whole = match cluster {
        None => values * m.add_per_value * (d - 1) as f64,
        // Each member adds (d - 1) / d of the values as its pieces arrive.
        Some((_, link)) => link.ring(values * 4.0, d) + values * m.add_per_value * share,
    };
    let scatter = match cluster {
        None => values * m.add_per_value * share,
        Some(_) => whole / 2.0,
    };
    match c.zero {
        0 => whole + m.replica_sync,
        1 => scatter + m.replica_sync,
        _ => {
            let more = values * m.zero2_per_value.unwrap_or(0.0);
            c.micro_batches as f64 * (scatter + more) + m.replica_sync
        }
    }
}

/// A stage's update of `values` parameters taking `whole` seconds unsharded: sharded
/// (ZeRO), each replica updates its part, then gathers the others' (copies in memory,
/// the ring's second half over `cluster`'s link).
pub(super) fn update_seconds(
    c: &Candidate,
    m: &Machinery,
    whole: f64,
    (values, cluster): (f64, Option<(&Nodes, Link)>),
) -> f64 {
    let d = c.dp;
    if c.zero == 0 || d == 1 {
        return whole;
    }
    let share = (d - 1) as f64 / d as f64;
    let gather = match cluster {
        None => values * m.add_per_value * share,
        Some((_, link)) => link.ring(values * 4.0, d) / 2.0,
    };
    whole / d as f64 + gather
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sharded_state_updates_a_share_then_gathers_and_reduces_only_its_part() {
        let m = Machinery {
            add_per_value: 1e-9,
            replica_sync: 1e-4,
            zero2_per_value: Some(2e-9),
            ..Machinery::bare(2, 1)
        };
        let c = |zero: u8| Candidate {
            zero,
            ..Candidate::one_f_one_b((4, 1, 1), (3, 1))
        };
        let values = 1e6;
        // Unsharded: the whole update; the reduction adds three other buffers.
        assert_eq!(update_seconds(&c(0), &m, 1.0, (values, None)), 1.0);
        assert!((reduce_seconds(&c(0), &m, values, None) - (3e-3 + 1e-4)).abs() < 1e-12);
        // Stage 1: a quarter of the update, then three quarters of the values copied in;
        // the reduction sums three quarters of the values once.
        let update = update_seconds(&c(1), &m, 1.0, (values, None));
        assert!((update - (0.25 + 0.75e-3)).abs() < 1e-12, "{update}");
        let reduce = reduce_seconds(&c(1), &m, values, None);
        assert!((reduce - (0.75e-3 + 1e-4)).abs() < 1e-12, "{reduce}");
        // Stage 2: that reduction every micro-batch, each paying its measured cost per
        // value; the step's meeting of the replicas once.
        let reduce = reduce_seconds(&c(2), &m, values, None);
        assert!(
            (reduce - (3.0 * (0.75e-3 + 2e-3) + 1e-4)).abs() < 1e-12,
            "{reduce}"
        );
    }
}
