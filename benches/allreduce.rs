//! In-process AllReduce against `memcpy` (issue: speed): 100 MB of float32 gradients
//! reduced across 2 replicas, each on a thread of its own as stage actors are, against
//! one copy of the same 100 MB, alternating 10 pairs. Reported as the all-reduce's
//! bandwidth (bytes / time) relative to memcpy's (goal >= 60%).
//!
//! `cargo bench --bench allreduce`

use std::sync::Arc;
use std::time::Instant;

use pipetrain_actors::{Collective, LocalCollective};

const VALUES: usize = 25_000_000; // 100 MB of f32
const PAIRS: usize = 10;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    for replicas in [2usize] {
        let collective = Arc::new(LocalCollective::spawn(
            1,
            replicas,
            &mut tokio::task::JoinSet::new(),
        ));
        let mut bufs: Vec<Vec<f32>> = (0..replicas)
            .map(|r| {
                (0..VALUES)
                    .map(|i| (i % 1000) as f32 * 1e-3 + r as f32)
                    .collect()
            })
            .collect();
        let src: Vec<f32> = bufs[0].clone();
        let mut dst = vec![0.0f32; VALUES];
        let (mut ratios, mut ar_ms, mut cp_ms) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..=PAIRS {
            let t = Instant::now();
            let threads: Vec<_> = bufs
                .drain(..)
                .enumerate()
                .map(|(r, b)| {
                    let (c, h) = (collective.clone(), rt.handle().clone());
                    std::thread::spawn(move || h.block_on(c.all_reduce_sum(0, r, b)).unwrap())
                })
                .collect();
            bufs = threads.into_iter().map(|t| t.join().unwrap()).collect();
            let ar = t.elapsed().as_secs_f64();
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            let cp = t.elapsed().as_secs_f64();
            ar_ms.push(ar * 1e3);
            cp_ms.push(cp * 1e3);
            ratios.push(cp / ar);
        }
        // The first pair warms the pages up.
        for v in [&mut ratios, &mut ar_ms, &mut cp_ms] {
            v.remove(0);
            v.sort_by(f64::total_cmp);
        }
        println!(
            "| {replicas} replicas | 100 MB | all-reduce {:.1} ms | memcpy {:.1} ms | all-reduce bandwidth {:.0}% of memcpy's [{:.0}-{:.0}] |",
            ar_ms[PAIRS / 2],
            cp_ms[PAIRS / 2],
            100.0 * ratios[PAIRS / 2],
            100.0 * ratios[0],
            100.0 * ratios[PAIRS - 1]
        );
    }
}
