//! `pipetrain launch` on one machine: four nodes on the loopback addresses
//! 127.0.0.1-4 (data-parallel 2 x pipeline 2, one rank each), each a real process with
//! its worker child, joined by authenticated TCP. The job (the built-in MLP, and the
//! peers' tiny GPT where `../shared/peers` is present) trains exactly as one process
//! does. Failures: `tests/launch_faults.rs`.

#![cfg(unix)]

#[path = "common/launch.rs"]
mod launch;

use std::process::Child;

use launch::*;

#[test]
fn four_nodes_on_loopback_train_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 12;
    let cfg = train_config(dir.path(), "cluster", steps, "");
    let single = train_config(dir.path(), "single", steps, "");
    let m = manifest(dir.path(), "0123456789abcdef0123456789abcdef", "");
    let metrics = dir.path().join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &["--metrics", &metrics_arg], &[]))
        .collect();
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    assert!(
        stderr(&outs[0]).contains("done: 12 steps"),
        "{}",
        stderr(&outs[0])
    );
    one_process(&single, &dir.path().join("single.jsonl"));
    // Two replicas sum their gradients as a + b whichever way the ring goes, so the
    // job's arithmetic is the one process's, bit for bit.
    let (job, one) = (losses(&metrics), losses(&dir.path().join("single.jsonl")));
    assert_eq!(job.len(), steps);
    assert_eq!(job, one);
    assert_eq!(
        weights(&dir.path().join("cluster/model.onnx")),
        weights(&dir.path().join("single/model.onnx"))
    );
    // Only node 0 writes the model.
    for n in &outs[1..] {
        assert!(!stderr(n).contains("trained model:"));
    }
}

#[test]
fn four_nodes_train_the_peers_tiny_gpt_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 4;
    let Some(cfg) = tiny_gpt_config(dir.path(), "cluster", steps) else {
        return;
    };
    let single = tiny_gpt_config(dir.path(), "single", steps).unwrap();
    let m = manifest(dir.path(), "0123456789abcdef0123456789abcdef", "");
    let metrics = dir.path().join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &["--metrics", &metrics_arg], &[]))
        .collect();
    for (n, o) in NODES.iter().zip(wait_all(children)) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(&o));
    }
    one_process(&single, &dir.path().join("single.jsonl"));
    let job = losses(&metrics);
    assert_eq!(job.len(), steps);
    assert_eq!(job, losses(&dir.path().join("single.jsonl")));
    assert_eq!(
        weights(&dir.path().join("cluster/model.onnx")),
        weights(&dir.path().join("single/model.onnx"))
    );
}
