//! Helpers of the `pipetrain launch` tests (`tests/it/launch.rs`, `tests/it/launch_faults.rs`):
//! four nodes on the loopback addresses 127.0.0.1-4 (data-parallel 2 x pipeline 2, one
//! rank each), their manifest and configurations, and reading what the jobs left.
#![allow(dead_code)]

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub const NODES: [&str; 4] = ["a", "b", "c", "d"];

/// A free TCP port on every loopback address we use (asked of the kernel, then freed).
pub fn free_port() -> u16 {
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
pub const COMMON: &str = r#"[optimizer]
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
pub fn train_config(dir: &Path, name: &str, steps: usize, extra: &str) -> PathBuf {
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
pub fn manifest(dir: &Path, secret: &str, extra_job: &str) -> PathBuf {
    // Two asks may get the same port back (it was freed in between): the manifest would
    // then put node a's data port on the rendezvous, which it refuses.
    let rdzv = free_port();
    let port = std::iter::repeat_with(free_port)
        .find(|&p| p.abs_diff(rdzv) > 1)
        .unwrap();
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

pub fn launch(
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

pub fn wait_all(children: Vec<Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The losses of a metrics file (JSON Lines), by step.
pub fn losses(path: &Path) -> Vec<(u64, f64)> {
    let text = fs::read_to_string(path).unwrap();
    let mut by_step = std::collections::BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        by_step.insert(v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap());
    }
    by_step.into_iter().collect()
}

/// The trained model's initializers, by name.
pub fn weights(model: &Path) -> Vec<(String, Vec<u8>)> {
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
pub fn one_process(config: &Path, metrics: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(config)
        .arg("--metrics")
        .arg(metrics)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// The peers' tiny GPT (its model, initial weights and data, in file order) as dp 2 x
/// pp 2 with 1F1B and AdamW, each stage's gradients reduced in buckets of 256 KiB (3 to
/// 5 per stage).
pub fn tiny_gpt_config(dir: &Path, name: &str, steps: usize) -> PathBuf {
    let peers = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers/data");
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
gradient_bucket_mb = 0.25
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
    path
}

/// The pid of `parent`'s child process (the worker of a supervisor).
pub fn child_of(parent: u32) -> Option<u32> {
    let text = fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}
