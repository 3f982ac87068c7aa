//! `pipetrain launch` when things go wrong, on four loopback nodes (dp 2 x pp 2): a
//! worker killed mid-run is restarted with the others from the newest complete
//! checkpoint and the job still ends with the uninterrupted run's weights; a worker that
//! stops answering is detected within the peer timeout and named with its ranks; peers
//! without the secret are refused while the job goes on, and a node with the wrong
//! secret cannot join.

#![cfg(unix)]

use std::fs;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::common::launch::*;

/// A job of 300 steps with a checkpoint every 25, running on the four nodes.
struct Started {
    dir: tempfile::TempDir,
    children: Vec<Child>,
    /// Node 0's metrics file.
    metrics: PathBuf,
    /// The same run's configuration for one process.
    single: PathBuf,
    /// The job's manifest and configuration.
    manifest: PathBuf,
    config: PathBuf,
}

/// Starts the job and returns once a checkpoint is complete and the job is 40 steps in.
fn start_past_a_checkpoint() -> Started {
    let dir = tempfile::tempdir().unwrap();
    let steps = 300;
    let ck = dir.path().join("ck");
    let extra = format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = 25\nmax_num_checkpoints = 2\n",
        ck.display()
    );
    let cfg = train_config(dir.path(), "cluster", steps, &extra);
    let single = train_config(dir.path(), "single", steps, "");
    let m = manifest(dir.path(), "0123456789abcdef0123456789abcdef", "");
    let metrics = dir.path().join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &["--metrics", &metrics_arg], &[]))
        .collect();
    let start = Instant::now();
    while !(fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) >= 40
        && pipetrain::checkpoint::latest_complete(&ck)
            .ok()
            .flatten()
            .is_some())
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint came"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Started {
        dir,
        children,
        metrics,
        single,
        manifest: m,
        config: cfg,
    }
}

/// The job in `dir` ended with the weights of the one-process run `single` (run now),
/// and every step's loss in `metrics` is that run's (steps trained twice included).
fn ends_as_one_process(dir: &std::path::Path, metrics: &std::path::Path, single: &std::path::Path) {
    one_process(single, &dir.join("single.jsonl"));
    assert_eq!(
        weights(&dir.join("cluster/model.onnx")),
        weights(&dir.join("single/model.onnx"))
    );
    let one: std::collections::BTreeMap<u64, f64> =
        losses(&dir.join("single.jsonl")).into_iter().collect();
    for (step, loss) in losses(metrics) {
        assert_eq!(Some(&loss), one.get(&step), "step {step}");
    }
}

#[test]
fn a_killed_worker_is_restarted_with_the_others_from_the_newest_checkpoint() {
    let Started {
        dir,
        children,
        metrics,
        single,
        ..
    } = start_past_a_checkpoint();
    // A checkpoint is complete and the job is past it: kill node c's worker.
    let worker = child_of(children[2].id()).expect("node c runs a worker");
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    let c = stderr(&outs[2]);
    assert!(
        c.contains("killed by signal 9") && c.contains("attempt 2"),
        "{c}"
    );
    assert!(
        stderr(&outs[0]).contains("resumed at step"),
        "{}",
        stderr(&outs[0])
    );
    ends_as_one_process(dir.path(), &metrics, &single);
}

/// SIGTERM to one node's supervisor (as when Kubernetes evicts one pod) stops the whole
/// job after the same step, with a checkpoint of that step: every node exits with 143.
/// `--resume` on every node then ends with the uninterrupted run's weights and losses.
#[test]
fn a_signal_to_one_node_stops_the_job_with_a_checkpoint_and_it_resumes_exactly() {
    let Started {
        dir,
        children,
        metrics,
        single,
        manifest,
        config,
    } = start_past_a_checkpoint();
    unsafe { libc::kill(children[1].id() as i32, libc::SIGTERM) };
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert_eq!(o.status.code(), Some(143), "node {n}:\n{}", stderr(o));
    }
    let a = stderr(&outs[0]);
    let stopped: u64 = a
        .split("the job stopped after step ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("node a does not say where the job stopped:\n{a}"));
    assert!(stopped < 300, "stopped after step {stopped}");
    eprintln!("the job stopped after step {stopped}");
    let (_, newest) = pipetrain::checkpoint::latest_complete(&dir.path().join("ck"))
        .unwrap()
        .unwrap();
    assert_eq!(newest.steps_done, stopped, "the stop's checkpoint");

    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let resumed: Vec<Child> = NODES
        .iter()
        .map(|n| {
            launch(
                &manifest,
                n,
                &config,
                &["--resume", "--metrics", &metrics_arg],
                &[],
            )
        })
        .collect();
    for (n, o) in NODES.iter().zip(wait_all(resumed)) {
        assert!(
            o.status.success(),
            "node {n} after the resume:\n{}",
            stderr(&o)
        );
    }
    ends_as_one_process(dir.path(), &metrics, &single);
}

/// While the job trains, a client with the wrong secret and one sending garbage connect
/// to node a's rendezvous: both are refused and logged, and the job ends as usual.
#[test]
fn a_peer_without_the_secret_is_refused_and_the_job_goes_on() {
    use pipetrain::comm::handshake::{handshake, Hello, Role};
    let dir = tempfile::tempdir().unwrap();
    let cfg = train_config(dir.path(), "cluster", 300, "");
    let m = manifest(dir.path(), "0123456789abcdef0123456789abcdef", "");
    let rendezvous = pipetrain::cluster::ClusterManifest::load(&m)
        .unwrap()
        .rendezvous()
        .socket_addr()
        .unwrap();
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &[], &[]))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let refused = runtime.block_on(async {
        // Node a listens once it starts; a node that never does (its worker failed to
        // start) fails the test rather than hanging it.
        let connect = || async {
            let start = Instant::now();
            loop {
                if let Ok(s) = tokio::net::TcpStream::connect(rendezvous).await {
                    return s;
                }
                let waited = start.elapsed();
                assert!(
                    waited < Duration::from_secs(60),
                    "node a never listened on {rendezvous}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let mut s = connect().await;
        let hello = Hello::new(3, "loopback").unwrap();
        let wrong = b"fedcba9876543210fedcba9876543210";
        let refused = handshake(&mut s, Role::Dialer, &hello, wrong, Duration::from_secs(5)).await;
        // Garbage: a frame header announcing an enormous frame; node a refuses it and
        // closes the connection.
        let mut g = connect().await;
        tokio::io::AsyncWriteExt::write_all(&mut g, &[0xff; 64])
            .await
            .unwrap();
        let mut sink = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut g, &mut sink).await;
        refused
    });
    // We cannot verify node a's proof either: we do not hold its secret.
    assert!(refused.unwrap_err().contains("does not hold"));
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    let a = stderr(&outs[0]);
    assert!(a.contains("done: 300 steps"), "{a}");
    assert!(
        a.contains("refused a connection") && a.contains("does not hold this job's secret"),
        "{a}"
    );
    assert!(a.contains("frame of"), "garbage is refused as such:\n{a}");
}

#[test]
fn a_node_with_the_wrong_secret_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = train_config(dir.path(), "cluster", 4, "");
    let m = manifest(
        dir.path(),
        "",
        "secret_env = \"LOOPBACK_SECRET\"\nmax_restarts = 0\nconnect_timeout_s = 3",
    );
    let good = "0123456789abcdef0123456789abcdef";
    let bad = "fedcba9876543210fedcba9876543210";
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| {
            let s = if *n == "b" { bad } else { good };
            launch(&m, n, &cfg, &[], &[("LOOPBACK_SECRET", s)])
        })
        .collect();
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(!o.status.success(), "node {n} should have failed");
    }
    let all: String = outs.iter().map(stderr).collect();
    assert!(
        all.to_lowercase().contains("secret") || all.to_lowercase().contains("authentic"),
        "{all}"
    );
    assert!(!dir.path().join("cluster/model.onnx").exists());
}

/// Node c's worker is stopped (SIGSTOP: its sockets stay open, nothing more comes from
/// it). Within the peer timeout (3 s here) the others see the silence, name c with its
/// rank and coordinates, and restart; once c's frozen worker is killed its supervisor
/// restarts it too, and the job ends with the uninterrupted run's weights.
#[test]
fn a_worker_that_stops_answering_is_detected_and_named_within_the_peer_timeout() {
    let Started {
        dir,
        children,
        single,
        ..
    } = start_past_a_checkpoint();
    let frozen = child_of(children[2].id()).expect("node c runs a worker");
    let first_a = child_of(children[0].id()).expect("node a runs a worker");
    unsafe { libc::kill(frozen as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    // Node a's worker fails and its supervisor starts another: the silence was seen.
    while child_of(children[0].id()).is_none_or(|pid| pid == first_a) {
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "node a still runs its first worker 10 s after node c stopped answering"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let detected = stopped.elapsed();
    unsafe { libc::kill(frozen as i32, libc::SIGKILL) };
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    // Whichever of a, b and d saw it first names c, its rank and coordinates.
    let said = [0, 1, 3].iter().any(|&i| {
        let e = stderr(&outs[i]);
        e.contains("node c [rank 2 = dp 1, pp 0]") && e.contains("sent nothing for 3s")
    });
    assert!(said, "{}", stderr(&outs[0]));
    eprintln!("node c's silence seen and node a restarting after {detected:?}");
    one_process(&single, &dir.path().join("single.jsonl"));
    assert_eq!(
        weights(&dir.path().join("cluster/model.onnx")),
        weights(&dir.path().join("single/model.onnx"))
    );
}

/// A member that stays connected but sends nothing: node a's stage 0 of replica 0 is
/// held for 20 s at step 3 while its process heartbeats on, so no peer timeout fires.
/// The watchdogs (2 s) fire instead, with their who-waits-on-whom reports: a node
/// waiting on node a names its member by replica, rank and node, or, when node a's own
/// watchdog is first, node a reports its member stuck in a forward and the others name
/// node a's ranks as the node the job lost. Node d's watchdog can also be first (seen
/// once in a full test run on 2 cores): it waits in stage 1's all-reduce for node b's
/// copy, and names node b, which itself waits on node a. Which one fires first is a race
/// of a few milliseconds; `actors/tests/distributed.rs` checks the waiting side's report
/// alone.
#[test]
fn a_live_but_silent_member_trips_the_watchdog_which_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let held = "watchdog_seconds = 2\n[debug]\nstall = { step = 3, stage = 0, seconds = 20 }\n";
    let cfg = train_config(dir.path(), "held", 8, held);
    let m = manifest(
        dir.path(),
        "0123456789abcdef0123456789abcdef",
        "max_restarts = 0",
    );
    let children: Vec<Child> = NODES
        .iter()
        .map(|n| launch(&m, n, &cfg, &[], &[]))
        .collect();
    let outs = wait_all(children);
    let all: String = outs.iter().map(stderr).collect::<Vec<_>>().join("\n");
    assert!(outs.iter().all(|o| !o.status.success()), "{all}");
    assert!(
        all.contains("no progress for 2.0s; who waits on whom:"),
        "{all}"
    );
    let a = "node a [rank 0 = dp 0, pp 0]";
    // Node b (stage 1 of replica 0) waits for node a's activations; node c (stage 0 of
    // replica 1) waits in the all-reduce of stage 0 for node a's copy.
    let b_names_a = format!("from stage 0 (replica 0 rank 0 on {a})");
    let c_names_a = format!("from the other replicas of stage 0 (replica 0 rank 0 on {a})");
    // Node d (stage 1 of replica 1) waits in stage 1's all-reduce for node b.
    let d_names_b =
        "from the other replicas of stage 1 (replica 0 rank 1 on node b [rank 1 = dp 0, pp 1])";
    let waiting_side =
        all.contains(&b_names_a) || all.contains(&c_names_a) || all.contains(d_names_b);
    let held_side = stderr(&outs[0]).contains("replica 0 stage 0 is running F mb 0")
        && all.contains(&format!("the job lost a node: {a}"));
    assert!(
        waiting_side || held_side,
        "no report names node a's member:\n{all}"
    );
    // Node a's heartbeats went on: nobody reports it silent.
    assert!(!all.contains(&format!("{a} sent nothing")), "{all}");
}
