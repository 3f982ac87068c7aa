//! `pipetrain launch` with tensor parallelism across processes: four nodes on the
//! loopback addresses at (dp, hp, pp) = (1, 2, 2), one rank each, so every stage's two
//! tensor shards run in two processes and sum their partial products over the sockets.
//! The job trains bitwise as one process with the same layout (the shards' sum is taken
//! in shard order either way).

#![cfg(unix)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;

use crate::common::launch::*;

/// The built-in GPT-2 (2 layers, d 32, 4 heads) at hp 2 x pp 2 under 1F1B, AdamW.
fn gpt2_config(dir: &Path, name: &str, steps: usize) -> PathBuf {
    let text = format!(
        r#"
batch_size = 4
gradient_accumulation_steps = 2
num_train_steps = {passes}
data_parallel_size = 1
horizontal_parallel_size = 2
pipeline_parallel_size = 2
output_path = "{name}/model.onnx"
[model]
kind = "gpt2"
layers = 2
d_model = 32
heads = 4
vocab = 64
seq = 16
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = {{ kind = "language", samples = 256, seq = 16, vocab = 64, seed = 7 }}
layout = {{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }}
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 3e-3
[pipeline]
schedule = "1f1b"
"#,
        passes = steps * 2
    );
    let path = dir.join(format!("{name}.toml"));
    fs::write(&path, text).unwrap();
    path
}

#[test]
fn four_nodes_split_each_stage_across_two_processes_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 8;
    let cfg = gpt2_config(dir.path(), "cluster", steps);
    let single = gpt2_config(dir.path(), "single", steps);
    let m = manifest(dir.path(), "0123456789abcdef0123456789abcdef", "");
    let text = fs::read_to_string(&m).unwrap().replace(
        "data_parallel = 2\n",
        "data_parallel = 1\ntensor_parallel = 2\n",
    );
    fs::write(&m, text).unwrap();
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
    one_process(&single, &dir.path().join("single.jsonl"));
    let (job, one) = (losses(&metrics), losses(&dir.path().join("single.jsonl")));
    assert_eq!(job.len(), steps);
    assert!(job.iter().all(|(_, l)| l.is_finite()));
    assert_eq!(job, one);
    // Node 0 put the shards' parts (two of them on other nodes) back together.
    let (a, b) = (
        weights(&dir.path().join("cluster/model.onnx")),
        weights(&dir.path().join("single/model.onnx")),
    );
    assert_eq!(a, b);
    let qkv = a
        .iter()
        .find(|(n, _)| n == "h.0.attn.c_attn.weight")
        .unwrap();
    assert_eq!(qkv.1.len(), 32 * 96 * 8, "the whole [32, 96] weight");
}
