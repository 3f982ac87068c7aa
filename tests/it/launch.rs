//! `pipetrain launch` on one machine: four nodes on the loopback addresses
//! 127.0.0.1-4 (data-parallel 2 x pipeline 2, one rank each), each a real process with
//! its worker child, joined by authenticated TCP. The job (the built-in MLP, and the
//! peers' tiny GPT) trains exactly as one process
//! does. Failures: `tests/it/launch_faults.rs`.

#![cfg(unix)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;

use crate::common::launch::*;

/// Runs the job on the four nodes (node `i` with `configs[i]`), then `single` in one
/// process, and checks that the job's losses (`steps` of them) and trained model (node
/// 0's, at `model`) are bitwise the one process's. Returns the nodes' outputs.
fn job_equals_one_process(
    dir: &Path,
    configs: &[&Path],
    single: &Path,
    steps: usize,
    model: &Path,
) -> Vec<std::process::Output> {
    job_with_env_equals_one_process(dir, configs, (single, steps, model), &[])
}

/// [`job_equals_one_process`], the nodes started with `env` set.
fn job_with_env_equals_one_process(
    dir: &Path,
    configs: &[&Path],
    (single, steps, model): (&Path, usize, &Path),
    env: &[(&str, &str)],
) -> Vec<std::process::Output> {
    let m = manifest(dir, "0123456789abcdef0123456789abcdef", "");
    let outs = run_job(dir, &m, configs, env);
    one_process(single, &dir.join("single.jsonl"));
    // Two replicas sum their gradients as a + b whichever way the ring goes, so the
    // job's arithmetic is the one process's, bit for bit.
    let (job, one) = (
        losses(&dir.join("cluster.jsonl")),
        losses(&dir.join("single.jsonl")),
    );
    assert_eq!(job.len(), steps);
    assert!(job.iter().all(|(_, l)| l.is_finite()));
    assert_eq!(job, one);
    assert_eq!(weights(model), weights(&dir.join("single/model.onnx")));
    outs
}

/// Runs the job of manifest `m` on the four nodes (node `i` with `configs[i]`, started
/// with `env` set), node 0 writing its metrics to `dir/cluster.jsonl`; checks that every
/// node succeeded and returns their outputs.
fn run_job(
    dir: &Path,
    m: &Path,
    configs: &[&Path],
    env: &[(&str, &str)],
) -> Vec<std::process::Output> {
    let metrics = dir.join("cluster.jsonl");
    let metrics_arg = metrics.to_str().unwrap().to_owned();
    let children: Vec<Child> = NODES
        .iter()
        .zip(configs)
        .map(|(n, cfg)| launch(m, n, cfg, &["--metrics", &metrics_arg], env))
        .collect();
    let outs = wait_all(children);
    for (n, o) in NODES.iter().zip(&outs) {
        assert!(o.status.success(), "node {n} failed:\n{}", stderr(o));
    }
    outs
}

#[test]
fn four_nodes_on_loopback_train_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 12;
    let cfg = train_config(dir.path(), "cluster", steps, "");
    let single = train_config(dir.path(), "single", steps, "");
    let model = dir.path().join("cluster/model.onnx");
    let outs = job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
    assert!(
        stderr(&outs[0]).contains("done: 12 steps"),
        "{}",
        stderr(&outs[0])
    );
    // Only node 0 writes the model.
    for n in &outs[1..] {
        assert!(!stderr(n).contains("trained model:"));
    }
}

#[test]
fn four_nodes_on_the_device_path_train_exactly_as_one_process_on_the_host() {
    // Each node's stage keeps its state in a device state over host memory and leaves
    // its messages there (`debug.device_path_on_host`); they are copied out as they go
    // on the wire.
    let dir = tempfile::tempdir().unwrap();
    let steps = 4;
    let device = "[debug]\ndevice_path_on_host = true\n";
    let cfg = train_config(dir.path(), "cluster", steps, device);
    let single = train_config(dir.path(), "single", steps, "");
    let model = dir.path().join("cluster/model.onnx");
    let env = [("RUST_LOG", "warn,pipetrain::device=debug")];
    let outs = job_with_env_equals_one_process(
        dir.path(),
        &[cfg.as_path(); 4],
        (&single, steps, &model),
        &env,
    );
    for (n, o) in NODES.iter().zip(&outs) {
        let log = stderr(o);
        assert!(
            log.contains("run, bound"),
            "node {n} took another path:\n{log}"
        );
    }
    // Node 0 closes the run, with its stage's traffic.
    let log = stderr(&outs[0]);
    assert!(
        log.contains("host traffic a step, bytes (replica 0's stages on the device): stage 0 "),
        "{log}"
    );
}

#[test]
fn four_nodes_train_the_peers_tiny_gpt_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 4;
    let cfg = tiny_gpt_config(dir.path(), "cluster", steps);
    let single = tiny_gpt_config(dir.path(), "single", steps);
    let model = dir.path().join("cluster/model.onnx");
    job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
}

/// The MLP's teacher data packed as 8 `.pb` shards in `dir/shards`, with `poisoned`
/// files (by index) holding NaN features instead: valid shards of the same samples that
/// make any run reading them fail.
fn teacher_shards(dir: &Path, config: &Path, poisoned: &[usize]) {
    let cfg = pipetrain::config::TrainConfig::load(config).unwrap();
    let arrays = pipetrain::data::generate(cfg.data.synth.as_ref().unwrap()).unwrap();
    let (x, y) = (&arrays["x"], &arrays["y"]);
    let nan = pipetrain::tensor::Tensor::new(
        x.shape.clone(),
        pipetrain::tensor::TensorData::F32(vec![f32::NAN; x.len()]),
    )
    .unwrap();
    for (name, x) in [("good", x), ("poison", &nan)] {
        let npz = dir.join(format!("{name}.npz"));
        pipetrain::data::write_npz(&npz, &[("x", x), ("y", y)]).unwrap();
        pipetrain::data::shards::pack(&npz, &dir.join(name), 512, "teacher").unwrap();
    }
    let out = dir.join("shards");
    fs::create_dir_all(&out).unwrap();
    for i in 0..8 {
        let file = format!("teacher_{i:05}.pb");
        let from = if poisoned.contains(&i) {
            "poison"
        } else {
            "good"
        };
        fs::copy(dir.join(from).join(&file), out.join(&file)).unwrap();
    }
}

/// `[data.shards] split = "files"` across four processes: node a and b (replica 0)
/// hold replica 1's files poisoned with NaN, nodes c and d replica 0's, so a node that
/// read another replica's file would fail the job; it trains exactly as one process
/// reading all the files.
#[test]
fn four_nodes_read_only_their_replicas_shards() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 6;
    let shards =
        "[data.shards]\ntrain_data_dir = \"shards\"\nsplit = \"files\"\nshuffle_seed = 3\n";
    let with_shards = |path: &Path| {
        let text = fs::read_to_string(path).unwrap();
        let start = text.find("[data]").unwrap();
        let end = start + text[start..].find("[optimizer]").unwrap();
        fs::write(path, format!("{}{shards}{}", &text[..start], &text[end..])).unwrap();
    };
    // Each node's folder: the same configuration bytes, its own copy of the shards.
    let mut configs = Vec::new();
    for (i, node) in NODES.iter().enumerate() {
        let folder = dir.path().join(node);
        fs::create_dir_all(&folder).unwrap();
        let cfg = train_config(&folder, "cluster", steps, "");
        let replica = i / 2;
        let theirs: Vec<usize> = (0..8).filter(|f| f % 2 != replica).collect();
        teacher_shards(&folder, &cfg, &theirs);
        with_shards(&cfg);
        configs.push(cfg);
    }
    let single = train_config(dir.path(), "single", steps, "");
    teacher_shards(dir.path(), &single, &[]);
    with_shards(&single);
    let configs: Vec<&Path> = configs.iter().map(PathBuf::as_path).collect();
    let model = dir.path().join("a/cluster/model.onnx");
    job_equals_one_process(dir.path(), &configs, &single, steps, &model);
}

/// `enable_adasum`: the two replicas' gradients combine by Adasum, over the sockets
/// bitwise as in one process (each replica's gradient travels in its own slot of the
/// all-reduced buffer, so no sum order enters), and the run is not the summed one.
#[test]
fn four_nodes_combine_gradients_by_adasum_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 12;
    let adasum = "enable_adasum = true\n";
    let cfg = train_config(dir.path(), "cluster", steps, adasum);
    let single = train_config(dir.path(), "single", steps, adasum);
    let model = dir.path().join("cluster/model.onnx");
    job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
    let summed = train_config(dir.path(), "summed", steps, "");
    one_process(&summed, &dir.path().join("summed.jsonl"));
    let (a, s) = (
        losses(&dir.path().join("single.jsonl")),
        losses(&dir.path().join("summed.jsonl")),
    );
    assert_eq!(a[0], s[0], "the first step's loss comes before any update");
    assert_ne!(a[1..], s[1..], "Adasum changes the updates");
}

/// `deepspeed_zero_stage = 1`: each replica updates its half of each stage and the
/// halves travel round the ring's all-gather; the job trains bitwise as one process
/// without sharding (AdamW).
#[test]
fn four_nodes_shard_the_optimizer_state_exactly_as_one_unsharded_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 8;
    let cfg = train_config(dir.path(), "cluster", steps, "deepspeed_zero_stage = 1\n");
    let single = train_config(dir.path(), "single", steps, "");
    let model = dir.path().join("cluster/model.onnx");
    job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
}

/// `runtime.all_reduce = "chain"` at dp 4 x pp 1 (one replica a node): the replicas'
/// gradients sum in replica order down the chain, and the job trains bitwise as one
/// process, which sums in that order; with the default ring the same job does not.
#[test]
fn four_replicas_summing_down_the_chain_train_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let one = dp4_run(dir.path(), None, "");
    let chain = dp4_run(dir.path(), Some("chain"), "");
    let ring = dp4_run(dir.path(), Some("ring"), "");
    assert!(chain == one, "the chain's job is not one process's");
    assert!(ring.1 != one.1, "the ring's sums came out in replica order");
}

/// The same under `deepspeed_zero_stage = 2` with 16 KiB buckets: each bucket of every
/// micro-batch is reduce-scattered down the chain, each replica's part summed in replica
/// order, bitwise as one process sharded the same way.
#[test]
fn four_replicas_reduce_scatter_down_the_chain_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let zero = "deepspeed_zero_stage = 2\ngradient_bucket_mb = 0.015625\n";
    let one = dp4_run(dir.path(), None, zero);
    let chain = dp4_run(dir.path(), Some("chain"), zero);
    assert!(chain == one, "the chain's job is not one process's");
}

/// The MLP job at dp 4 x pp 1 for 6 steps with `extra` keys: on the four nodes with
/// `runtime.all_reduce = algorithm`, or in one process (`None`); its losses and
/// trained weights.
type Ends = (Vec<(u64, f64)>, Vec<(String, Vec<u8>)>);
fn dp4_run(dir: &Path, algorithm: Option<&str>, extra: &str) -> Ends {
    let steps = 6;
    let four = |path: &Path, runtime: &str| {
        let text = fs::read_to_string(path).unwrap();
        let text = text
            .replace("data_parallel_size = 2", "data_parallel_size = 4")
            .replace("pipeline_parallel_size = 2", "pipeline_parallel_size = 1")
            .replace("data_parallel = 2\n", "data_parallel = 4\n")
            .replace("pipeline_parallel = 2\n", "pipeline_parallel = 1\n")
            .replace("[runtime]\n", &format!("[runtime]\n{runtime}"));
        fs::write(path, text).unwrap();
    };
    let name = algorithm.unwrap_or("single");
    let cfg = train_config(dir, name, steps, extra);
    let metrics = match algorithm {
        None => {
            four(&cfg, "");
            let metrics = dir.join("single.jsonl");
            one_process(&cfg, &metrics);
            metrics
        }
        Some(a) => {
            four(&cfg, &format!("all_reduce = \"{a}\"\n"));
            let m = manifest(dir, "0123456789abcdef0123456789abcdef", "");
            four(&m, "");
            run_job(dir, &m, &[cfg.as_path(); 4], &[]);
            dir.join("cluster.jsonl")
        }
    };
    let job = losses(&metrics);
    assert_eq!(job.len(), steps);
    (job, weights(&dir.join(name).join("model.onnx")))
}

/// A launched pipeline's memory does not grow with its steps: the activations and
/// gradients decoded from the wire are not kept for reuse beside the stages' own buffers
/// (`compute::HostPool`), which they filled towards its 256 MB bound at tens of KB a step.
#[test]
fn a_launched_pipeline_s_memory_does_not_grow_with_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 400;
    let cfg = train_config(dir.path(), "cluster", steps, "");
    let single = train_config(dir.path(), "single", steps, "");
    let model = dir.path().join("cluster/model.onnx");
    job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
    let peak = |step: usize| -> f64 {
        let text = fs::read_to_string(dir.path().join("cluster.jsonl")).unwrap();
        let row: serde_json::Value =
            serde_json::from_str(text.lines().nth(step - 1).unwrap()).unwrap();
        row["peak_memory_gb"].as_f64().expect("peak_memory_gb")
    };
    let grown = peak(steps) - peak(50);
    assert!(
        grown < 0.005,
        "node 0 grew {:.1} MB from step 50 to {steps}",
        grown * 1e3
    );
}

/// `deepspeed_zero_stage = 2`: every micro-batch's gradient buckets are reduce-scattered
/// round the ring (16 KiB buckets: several per stage), each replica adding its own part;
/// the job trains bitwise as one process of the same layout, sharded the same way.
#[test]
fn four_nodes_shard_the_gradients_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 6;
    let zero = "deepspeed_zero_stage = 2\ngradient_bucket_mb = 0.015625\n";
    let cfg = train_config(dir.path(), "cluster", steps, zero);
    let single = train_config(dir.path(), "single", steps, zero);
    let model = dir.path().join("cluster/model.onnx");
    job_equals_one_process(dir.path(), &[cfg.as_path(); 4], &single, steps, &model);
}

/// GPT-2 (the exported fixture) at dp 2 x pp 2: its tied token embedding crosses from
/// the first stage to the second with each step's first forward only
/// (`pipeline::tied`), over the sockets as in one process, and the job trains bitwise
/// as one process (which hands the same value to every micro-batch).
#[test]
fn four_nodes_hand_a_tied_embedding_on_once_a_step_exactly_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt2");
    let outs = gpt2_job_equals_one_process(dir.path(), &fixture.join("model.onnx"));
    assert!(
        stderr(&outs[0]).contains("is read by stages {0, 1}"),
        "the embedding is tied across the stages:\n{}",
        stderr(&outs[0])
    );
}

/// GPT-2 with dropout 0.1 at dp 2 x pp 2: each node draws the masks of its replicas'
/// micro-batches from the step's key, as one process draws them, so the job trains
/// bitwise as one process.
#[test]
fn four_nodes_draw_the_dropout_masks_of_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = crate::dropout::gpt2_with_dropout(dir.path(), 0.1);
    gpt2_job_equals_one_process(dir.path(), &model);
}

/// GPT-2 `model` (the fixture's data) at dp 2 x pp 2 for 4 steps on the four nodes,
/// bitwise as in one process; the nodes' outputs.
fn gpt2_job_equals_one_process(dir: &Path, model: &Path) -> Vec<std::process::Output> {
    let steps = 4;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt2");
    let config = |name: &str| {
        let text = format!(
            r#"
model_path = "{model}"
output_path = "{name}/model.onnx"
batch_size = 1
gradient_accumulation_steps = 2
num_train_steps = {passes}
data_parallel_size = 2
pipeline_parallel_size = 2
display_loss_steps = 1
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "labels"
[data]
path = "{data}"
layout = {{ kind = "arrays", feeds = {{ input_ids = "input_ids", labels = "labels" }} }}
{COMMON}"#,
            model = model.display(),
            data = fixture.join("data.npz").display(),
            passes = steps * 2
        );
        let path = dir.join(format!("{name}.toml"));
        fs::write(&path, text).unwrap();
        path
    };
    let (cfg, single) = (config("cluster"), config("single"));
    let trained = dir.join("cluster/model.onnx");
    let env = [("RUST_LOG", "info,onnxruntime=error")];
    let run = (single.as_path(), steps, trained.as_path());
    job_with_env_equals_one_process(dir, &[cfg.as_path(); 4], run, &env)
}
