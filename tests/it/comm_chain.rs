//! `runtime.all_reduce = "chain"` on a mesh of workers in this process on loopback: the
//! replicas' sums in replica order, bitwise one process's, where the ring's are not;
//! ZeRO's reduce-scatter and the ring's all-gather after it; tensor shards apart.

use std::sync::Arc;
use std::time::Duration;

use crate::comm::mesh_of;
use pipetrain::comm::{AllReduce, Mesh, MeshCollective};
use pipetrain_actors::Collective;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `inputs[r]` summed in replica order, `((x0 + x1) + x2) + ...`, as one process sums.
fn sum_in_order(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = inputs[0].clone();
    for x in &inputs[1..] {
        sum.iter_mut().zip(x).for_each(|(s, v)| *s += v);
    }
    sum
}

/// Random values with full float32 mantissas, so a sum's order shows in its bits.
fn full_mantissas(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| rng.random_range(-1.0f64..1.0) as f32)
        .collect()
}

/// One all-reduce (`parts: None`), reduce-scatter or all-gather of `bufs` by
/// `algorithm`, replica `r` on node `placement[r][0]`; what each replica got back.
async fn collective_round(
    meshes: &[Arc<Mesh>],
    (placement, algorithm): (&[Vec<usize>], AllReduce),
    bufs: &[Vec<f32>],
    parts: Option<&[std::ops::Range<usize>]>,
    gather: bool,
) -> Vec<Vec<f32>> {
    let tasks: Vec<_> = (0..bufs.len())
        .map(|r| {
            let mesh = meshes[placement[r][0]].clone();
            let c = MeshCollective::new(mesh, placement.to_vec()).with_algorithm(algorithm);
            let (buf, parts) = (bufs[r].clone(), parts.map(<[_]>::to_vec));
            tokio::spawn(async move {
                match (parts, gather) {
                    (None, _) => c.all_reduce_sum(0, r, buf).await.unwrap(),
                    (Some(p), true) => c.all_gather(0, r, buf, &p).await.unwrap(),
                    (Some(p), false) => c.reduce_scatter(0, r, buf, &p).await.unwrap(),
                }
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let got = tokio::time::timeout(Duration::from_secs(60), t).await;
        out.push(got.expect("the round ends").unwrap());
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `runtime.all_reduce = "chain"`: four replicas on three workers (0 and 2 on one, so
/// replica 1's neighbours both come from worker 0) sum in replica order, bitwise as one
/// process, where the ring's bits differ; a reduce-scatter leaves each owner its part
/// of the same sums and every other value as it was, and the ring's all-gather after it
/// hands the parts round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_sums_in_replica_order_bitwise_as_one_process() {
    let meshes = mesh_of(3, Duration::from_secs(5)).await;
    let placement = vec![vec![0], vec![1], vec![0], vec![2]];
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // Several pieces (2^20 values) a part, and a last piece cut short.
    let len = 2_500_007;
    let inputs: Vec<Vec<f32>> = (0..4).map(|_| full_mantissas(&mut rng, len)).collect();
    let want = bits(&sum_in_order(&inputs));
    let chain = (placement.as_slice(), AllReduce::Chain);
    let reduced = collective_round(&meshes, chain, &inputs, None, false).await;
    for (r, got) in reduced.iter().enumerate() {
        assert!(
            bits(got) == want,
            "replica {r}'s sum is not in replica order"
        );
    }
    let ring = (placement.as_slice(), AllReduce::Ring);
    let ringed = collective_round(&meshes, ring, &inputs, None, false).await;
    let differ = bits(&ringed[0])
        .iter()
        .zip(&want)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ > len / 100,
        "only {differ} of the ring's sums differ"
    );
    // Uneven parts out of buffer order, one empty, a gap no one owns.
    let parts = [
        1_500_000..len,
        0..1_000_000,
        1_000_000..1_000_000,
        1_000_000..1_400_000,
    ];
    let scattered = collective_round(&meshes, chain, &inputs, Some(&parts), false).await;
    for (r, got) in scattered.iter().enumerate() {
        let own = parts[r].clone();
        assert!(
            bits(&got[own.clone()]) == want[own.clone()],
            "replica {r}'s part"
        );
        let (before, after) = (0..own.start, own.end..len);
        assert!(
            got[before.clone()] == inputs[r][before],
            "replica {r} before its part"
        );
        assert!(
            got[after.clone()] == inputs[r][after],
            "replica {r} after its part"
        );
    }
    let gathered = collective_round(&meshes, chain, &scattered, Some(&parts), true).await;
    for (got, input) in gathered.iter().zip(&inputs) {
        for own in &parts {
            assert!(bits(&got[own.clone()]) == want[own.clone()]);
        }
        assert!(got[1_400_000..1_500_000] == input[1_400_000..1_500_000]);
    }
    for m in &meshes {
        m.shutdown().await;
    }
}

/// Under tensor parallelism the chain runs per shard: six engine replicas, three
/// data-parallel replicas of two shards (replica `2 d + s` on worker `d`); each shard sums
/// its data-parallel replicas' buffers in their order, bitwise, apart from the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_tensor_shards_sums_each_shard_in_replica_order() {
    let meshes = mesh_of(3, Duration::from_secs(5)).await;
    let placement: Vec<Vec<usize>> = (0..6).map(|r| vec![r / 2]).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let inputs: Vec<Vec<f32>> = (0..6).map(|_| full_mantissas(&mut rng, 300_001)).collect();
    let tasks: Vec<_> = (0..6)
        .map(|r| {
            let c = MeshCollective::new(meshes[r / 2].clone(), placement.clone())
                .with_shards(2)
                .with_algorithm(AllReduce::Chain);
            let buf = inputs[r].clone();
            tokio::spawn(async move { c.all_reduce_sum(0, r, buf).await.unwrap() })
        })
        .collect();
    for (r, t) in tasks.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(60), t).await;
        let got = got.expect("the round ends").unwrap();
        let shard: Vec<Vec<f32>> = (0..3).map(|d| inputs[2 * d + r % 2].clone()).collect();
        assert!(bits(&got) == bits(&sum_in_order(&shard)), "replica {r}");
    }
    for m in &meshes {
        m.shutdown().await;
    }
}
