//! The in-process collectives: sums in replica order, parts gathered in place.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn every_replica_gets_the_sum_in_replica_order() {
    let c = LocalCollective::spawn(1, 3, &mut JoinSet::new());
    let n = 1001;
    let bufs: Vec<Vec<f32>> = (0..3)
        .map(|r| {
            (0..n)
                .map(|i| (i as f32 * 0.1 + r as f32) * 1.37e-3)
                .collect()
        })
        .collect();
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let mut s = bufs[0][i];
            s += bufs[1][i];
            s += bufs[2][i];
            s
        })
        .collect();
    for _round in 0..3 {
        let handles: Vec<_> = bufs
            .iter()
            .cloned()
            .enumerate()
            .map(|(r, b)| {
                let c = c.clone();
                let lent = b.as_ptr() as usize;
                tokio::spawn(async move { (lent, c.all_reduce_sum(0, r, b).await.unwrap()) })
            })
            .collect();
        for h in handles {
            let (lent, got) = h.await.unwrap();
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            // The `Collective` contract: the sum comes back in the buffer lent.
            assert_eq!(got.as_ptr() as usize, lent);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn every_replica_gets_each_owners_part_in_place() {
    let c = LocalCollective::spawn(1, 3, &mut JoinSet::new());
    let n = 1000;
    let parts = vec![0..300, 300..300, 300..1000];
    // Replica r's own part holds its values; the rest is stale.
    let bufs: Vec<Vec<f32>> = (0..3)
        .map(|r| (0..n).map(|i| (r * n + i) as f32 * 0.5 - 7.0).collect())
        .collect();
    let owner = |i: usize| parts.iter().position(|p| p.contains(&i)).unwrap();
    let want: Vec<f32> = (0..n).map(|i| bufs[owner(i)][i]).collect();
    for _round in 0..2 {
        let handles: Vec<_> = (bufs.iter().cloned().enumerate())
            .map(|(r, b)| {
                let (c, parts) = (c.clone(), parts.clone());
                let lent = b.as_ptr() as usize;
                tokio::spawn(async move { (lent, c.all_gather(0, r, b, &parts).await) })
            })
            .collect();
        for h in handles {
            let (lent, got) = h.await.unwrap();
            let got = got.unwrap();
            assert_eq!(got, want);
            assert_eq!(got.as_ptr() as usize, lent, "gathered into the buffer lent");
        }
    }
    let bad = c
        .all_gather(0, 0, vec![0.0; 10], &[0..6, 5..10, 10..10])
        .await;
    assert!(bad.is_err(), "overlapping parts are refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn each_replica_gets_its_parts_sum_with_the_all_reduces_bits() {
    let c = LocalCollective::spawn(1, 3, &mut JoinSet::new());
    let n = 1000;
    let parts = vec![0..450, 450..450, 450..1000];
    let bufs: Vec<Vec<f32>> = (0..3)
        .map(|r| {
            (0..n)
                .map(|i| (i as f32 * 0.3 + r as f32) * 1.37e-3)
                .collect()
        })
        .collect();
    let handles: Vec<_> = (bufs.iter().cloned().enumerate())
        .map(|(r, b)| {
            let c = c.clone();
            tokio::spawn(async move { c.all_reduce_sum(0, r, b).await.unwrap() })
        })
        .collect();
    let mut summed = Vec::new();
    for h in handles {
        summed.push(h.await.unwrap());
    }
    let handles: Vec<_> = (bufs.iter().cloned().enumerate())
        .map(|(r, b)| {
            let (c, parts) = (c.clone(), parts.clone());
            tokio::spawn(async move { c.reduce_scatter(0, r, b, &parts).await.unwrap() })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let got = h.await.unwrap();
        let own = parts[r].clone();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got[own.clone()]),
            bits(&summed[r][own]),
            "replica {r}"
        );
    }
}
