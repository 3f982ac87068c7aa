//! An elastic `pipetrain launch` job (`[job] elastic = true`) on four loopback nodes at
//! dp 2 x pp 2 loses one node for good mid-run (its supervisor and worker killed): the
//! three left regroup at dp 1 x pp 2 on two of them (the third leaves), resume from the
//! newest complete checkpoint with twice the gradient accumulation, and end with the
//! samples of the uninterrupted run (the same steps and data position)
//! and its weights within the cross-layout tolerance of `tests/it/checkpoint.rs`. A node
//! whose supervisor spends its restarts is left behind the same way, while the others'
//! restarts (they only lost a peer) do not count.

#![cfg(unix)]

use std::fs;
use std::time::{Duration, Instant};

use crate::common::launch::*;
use pipetrain::checkpoint::{latest_complete, LoadedCheckpoint};

/// Optimizer steps of the job (a checkpoint every 25).
const STEPS: usize = 100;

/// The largest relative difference between two models' weights (as `weights` reads
/// them: f64 bytes by name).
fn max_rel_diff(a: &[(String, Vec<u8>)], b: &[(String, Vec<u8>)]) -> f64 {
    let floats = |bytes: &[u8]| -> Vec<f64> {
        bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for ((na, xa), (nb, xb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let (xa, xb) = (floats(xa), floats(xb));
        let scale = xa.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let diff = xa
            .iter()
            .zip(&xb)
            .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn a_node_lost_for_good_shrinks_the_job_which_ends_with_the_same_samples() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let extra = format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = 25\nmax_num_checkpoints = 2\n",
        ck.display()
    );
    let cfg = train_config(dir.path(), "cluster", STEPS, &extra);
    let single = train_config(dir.path(), "single", STEPS, "");
    let m = manifest(
        dir.path(),
        "0123456789abcdef0123456789abcdef",
        "elastic = true\nmin_nodes = 2\nconnect_timeout_s = 10\n",
    );
    let metrics = dir.path().join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let mut children: Vec<_> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &["--metrics", &metrics_arg], &[]))
        .collect();
    let start = Instant::now();
    while !(fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) >= 30
        && latest_complete(&ck).ok().flatten().is_some())
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint came"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Node d (rank 3: replica 1's second stage) is gone for good: no supervisor is
    // left to restart its worker.
    let d = children.pop().unwrap();
    let worker = child_of(d.id()).expect("node d runs a worker");
    unsafe {
        libc::kill(d.id() as i32, libc::SIGKILL);
        libc::kill(worker as i32, libc::SIGKILL);
    }
    let _ = wait_all(vec![d]);
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    let a = stderr(&outs[0]);
    assert!(
        a.contains("3 of 4 nodes are left (gone: d)")
            && a.contains("dp 1 x pp 2 (was dp 2 x pp 2) on a, b")
            && a.contains("accumulating 8 micro-batches (was 4)")
            && a.contains("resumed at step"),
        "{a}"
    );
    let c = stderr(&outs[2]);
    assert!(c.contains("leaves the job"), "{c}");

    // The same samples: every step once more, the last checkpoint at the data position
    // of the uninterrupted run, written at the smaller layout.
    let steps: Vec<u64> = losses(&metrics).iter().map(|l| l.0).collect();
    assert_eq!(steps, (1..=STEPS as u64).collect::<Vec<_>>());
    let text = fs::read_to_string(&metrics).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("\"event\":\"elastic: 3 of 4")),
        "no elastic event in the metrics"
    );
    let (newest, _) = latest_complete(&ck).unwrap().unwrap();
    let last = LoadedCheckpoint::open(&newest).unwrap();
    assert_eq!(last.manifest.data.sample_offset, (STEPS * 64) as u64);
    let layout = &last.manifest.layout;
    assert_eq!(
        (layout.data_parallel_size, layout.pipeline_parallel_size),
        (1, 2)
    );

    // The weights of the uninterrupted run, up to float32 rounding in another
    // reduction order; every step's loss likewise.
    one_process(&single, &dir.path().join("single.jsonl"));
    let diff = max_rel_diff(
        &weights(&dir.path().join("cluster/model.onnx")),
        &weights(&dir.path().join("single/model.onnx")),
    );
    let one: std::collections::BTreeMap<u64, f64> = losses(&dir.path().join("single.jsonl"))
        .into_iter()
        .collect();
    let loss_diff = losses(&metrics)
        .iter()
        .map(|(s, l)| (l - one[s]).abs())
        .fold(0.0, f64::max);
    eprintln!("shrunk job vs one process: weights {diff:.3e} relative, losses {loss_diff:.3e}");
    assert!(diff <= 1e-5, "weights {diff:.3e}");
    assert!(loss_diff <= 1e-5, "losses {loss_diff:.3e}");
}

/// Node d's worker dies twice with `max_restarts = 1`: the first time its supervisor
/// restarts it and the job meets again at full size (every node back, dp 2 x pp 2); the
/// second time d's supervisor has spent its restarts and gives up, while the others,
/// whose workers only lost a peer (not counted), go on at dp 1 x pp 2 to the last step.
#[test]
fn a_node_whose_restarts_are_spent_is_left_behind() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let steps = 1500;
    let extra = format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = 50\nmax_num_checkpoints = 2\n",
        ck.display()
    );
    let cfg = train_config(dir.path(), "cluster", steps, &extra);
    let m = manifest(
        dir.path(),
        "0123456789abcdef0123456789abcdef",
        "elastic = true\nmax_restarts = 1\nconnect_timeout_s = 10\n",
    );
    let metrics = dir.path().join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let children: Vec<_> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &["--metrics", &metrics_arg], &[]))
        .collect();
    let lines = || fs::read_to_string(&metrics).map_or(0, |t| t.lines().count());
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(120), "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let d = children[3].id();
    wait_for("no checkpoint came", &|| {
        lines() >= 60 && latest_complete(&ck).ok().flatten().is_some()
    });
    let first = child_of(d).expect("node d runs a worker");
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    // Its supervisor restarts it; the job goes on at full size and passes a checkpoint.
    let seen = lines();
    wait_for("node d's worker was not restarted", &|| {
        child_of(d).is_some_and(|w| w != first)
    });
    wait_for("the job did not go on", &|| lines() >= seen + 120);
    let second = child_of(d).unwrap();
    unsafe { libc::kill(second as i32, libc::SIGKILL) };
    let outs = wait_all(children);
    let d_err = stderr(&outs[3]);
    assert!(!outs[3].status.success(), "{d_err}");
    assert!(d_err.contains("job.max_restarts = 1"), "{d_err}");
    for (n, o) in NODES.iter().zip(&outs).take(3) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    let a = stderr(&outs[0]);
    assert!(
        a.contains("0 of 1 restarts used")
            && !a.contains("1 of 1 restarts used")
            && a.contains("3 of 4 nodes are left (gone: d)"),
        "{a}"
    );
    // Three starts of a's worker: at full size twice (the second with d back), then
    // shrunk once.
    assert!(a.contains("attempt 3;") && !a.contains("attempt 4;"), "{a}");
    assert_eq!(a.matches("elastic:").count(), 1, "{a}");
    let steps_seen: Vec<u64> = losses(&metrics).iter().map(|l| l.0).collect();
    assert_eq!(steps_seen, (1..=steps as u64).collect::<Vec<_>>());
    let (newest, _) = latest_complete(&ck).unwrap().unwrap();
    let last = LoadedCheckpoint::open(&newest).unwrap();
    assert_eq!(last.manifest.data.sample_offset, (steps * 64) as u64);
    assert_eq!(last.manifest.layout.data_parallel_size, 1);
}
