//! `pipetrain launch` on one machine: four nodes on the loopback addresses
//! 127.0.0.1-4 (data-parallel 2 x pipeline 2, one rank each), each a real process with
//! its worker child, joined by authenticated TCP. The job (the built-in MLP, and the
//! peers' tiny GPT where `../shared/peers` is present) trains exactly as one process
//! does; a worker killed mid-run is restarted with the others from the newest complete
//! checkpoint and the job still ends with the uninterrupted run's weights; a node with
//! the wrong secret is refused.

#![cfg(unix)]

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const NODES: [&str; 4] = ["a", "b", "c", "d"];

/// A free TCP port on every loopback address we use (asked of the kernel, then freed).
fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        if (2..=4).all(|i| TcpListener::bind(format!("127.0.0.{i}:{port}")).is_ok())
            && TcpListener::bind(format!("127.0.0.1:{}", port + 1)).is_ok()
        {
            return port;
        }
    }
}

/// The optimizer, schedule and runtime every job here shares: AdamW, 1F1B, one thread
/// a session (four processes share the machine's cores).
const COMMON: &str = r#"[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-3
[pipeline]
schedule = "1f1b"
[runtime]
intra_op_threads = 1
"#;

/// A training configuration (built-in MLP on pipetrain's teacher data, dp 2 x pp 2)
/// with `extra` top-level keys; its path.
fn train_config(dir: &Path, name: &str, steps: usize, extra: &str) -> PathBuf {
    let text = format!(
        r#"
batch_size = 8
gradient_accumulation_steps = 4
num_train_steps = {passes}
data_parallel_size = 2
pipeline_parallel_size = 2
display_loss_steps = 10
output_path = "{name}/model.onnx"
{extra}
[model]
kind = "mlp"
hidden = [64, 64]
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
synth = {{ kind = "teacher", samples = 4096, seed = 5 }}
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
{COMMON}"#,
        passes = steps * 4
    );
    let path = dir.join(format!("{name}.toml"));
    fs::write(&path, text).unwrap();
    path
}

/// A manifest for the four loopback nodes; the secret in a private file beside it.
fn manifest(dir: &Path, secret: &str, extra_job: &str) -> PathBuf {
    let (rdzv, port) = (free_port(), free_port());
    let connect = match extra_job.contains("connect_timeout_s") {
        true => "",
        false => "connect_timeout_s = 20\n",
    };
    let mut text = format!(
        "[job]\nname = \"loopback\"\nrendezvous = \"127.0.0.1:{rdzv}\"\n\
         heartbeat_ms = 100\npeer_timeout_s = 3\n{connect}{extra_job}\n\
         [layout]\ndata_parallel = 2\npipeline_parallel = 2\n"
    );
    if extra_job.contains("secret_env") {
    } else {
        text = text.replace("[layout]", "secret_file = \"cluster.secret\"\n[layout]");
        let s = dir.join("cluster.secret");
        fs::write(&s, secret).unwrap();
        fs::set_permissions(&s, fs::Permissions::from_mode(0o600)).unwrap();
    }
    for (i, n) in NODES.iter().enumerate() {
        text += &format!(
            "[[nodes]]\nname = \"{n}\"\naddress = \"127.0.0.{}\"\nport = {port}\ncpu_slots = 1\n",
            i + 1
        );
    }
    let path = dir.join("manifest.toml");
    fs::write(&path, text).unwrap();
    path
}

fn launch(
    manifest: &Path,
    node: &str,
    config: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    c.arg("launch")
        .arg("--manifest")
        .arg(manifest)
        .args(["--node", node])
        .args(extra)
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

fn wait_all(children: Vec<Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The losses of a metrics file (JSON Lines), by step.
fn losses(path: &Path) -> Vec<(u64, f64)> {
    let text = fs::read_to_string(path).unwrap();
    let mut by_step = std::collections::BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        by_step.insert(v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap());
    }
    by_step.into_iter().collect()
}

/// The trained model's initializers, by name.
fn weights(model: &Path) -> Vec<(String, Vec<u8>)> {
    let m = pipetrain::onnx::load_model(model).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = m
        .graph
        .unwrap()
        .initializer
        .into_iter()
        .map(|t| {
            let t2 = pipetrain::tensor::Tensor::from_proto(&t).unwrap();
            let bytes = t2
                .to_f64_vec()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            (t.name, bytes)
        })
        .collect();
    out.sort();
    out
}

/// The single-process run of `config`: its metrics file.
fn one_process(config: &Path, metrics: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(config)
        .arg("--metrics")
        .arg(metrics)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

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

/// The peers' tiny GPT (its model, initial weights and data, in file order) as dp 2 x
/// pp 2 with 1F1B and AdamW; None without `../shared/peers`.
fn tiny_gpt_config(dir: &Path, name: &str, steps: usize) -> Option<PathBuf> {
    let peers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/peers/data");
    if !peers.is_dir() {
        eprintln!("skipped: {} is missing", peers.display());
        return None;
    }
    let p = |f: &str| peers.join(f).display().to_string();
    let text = format!(
        r#"
model_path = "{model}"
init_path = "{init}"
output_path = "{name}/model.onnx"
batch_size = 8
gradient_accumulation_steps = 2
num_train_steps = {passes}
data_parallel_size = 2
pipeline_parallel_size = 2
display_loss_steps = 1
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
path = "{data}"
layout = {{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }}
{COMMON}"#,
        model = p("tiny_gpt.onnx"),
        init = p("tiny_gpt_init.safetensors"),
        data = p("tiny_gpt_data.npz"),
        passes = steps * 2
    );
    let path = dir.join(format!("{name}.toml"));
    fs::write(&path, text).unwrap();
    Some(path)
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

/// The pid of `parent`'s child process (the worker of a supervisor).
fn child_of(parent: u32) -> Option<u32> {
    let text = fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[test]
fn a_killed_worker_is_restarted_with_the_others_from_the_newest_checkpoint() {
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
    // Once a checkpoint is complete and the job is past it, kill node c's worker.
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint came"
        );
        let done = fs::read_to_string(&metrics)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        let complete = pipetrain::checkpoint::latest_complete(&ck).ok().flatten();
        if complete.is_some() && done >= 40 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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
    one_process(&single, &dir.path().join("single.jsonl"));
    // The resumed job ends with the weights of the run never interrupted.
    assert_eq!(
        weights(&dir.path().join("cluster/model.onnx")),
        weights(&dir.path().join("single/model.onnx"))
    );
    // Every step's loss is the uninterrupted run's (steps trained twice included).
    let one: std::collections::BTreeMap<u64, f64> = losses(&dir.path().join("single.jsonl"))
        .into_iter()
        .collect();
    for (step, loss) in losses(&metrics) {
        assert_eq!(Some(&loss), one.get(&step), "step {step}");
    }
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
        let connect = || async {
            loop {
                if let Ok(s) = tokio::net::TcpStream::connect(rendezvous).await {
                    return s;
                }
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
