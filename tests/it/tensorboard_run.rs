//! `log_dir`: a run's TensorBoard files, read by the `tensorboard` package's own
//! `EventAccumulator`, hold the same values as its metrics file (scalars every step) and
//! histograms of the named parameters and their gradients.

use std::path::Path;
use std::process::Command;

const CONFIG: &str = r#"
batch_size = 16
gradient_accumulation_steps = 2
num_train_steps = 12
pipeline_parallel_size = 2
evaluation_period = 3
eval_micro_batches = 2
max_grad_norm = 1.0
log_dir = "tb"
histogram_names = ["fc1.weight", "fc2.bias"]
output_path = "model.onnx"
[model]
kind = "mlp"
inputs = 20
hidden = [32]
classes = 4
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
synth = { kind = "teacher", samples = 512, inputs = 20, classes = 4, seed = 2 }
layout = { kind = "arrays", feeds = { x = "x", y = "y" } }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "cosine"
lr = 1e-2
warmup_ratio = 0.2
"#;

const READER: &str = r#"
import glob, json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
       "histograms": {t: [[e.step, e.histogram_value.num, e.histogram_value.min, e.histogram_value.max]
                          for e in acc.Histograms(t)] for t in tags["histograms"]}}
print(json.dumps(out))
"#;

#[test]
fn tensorboard_holds_what_the_metrics_file_holds() {
    holds_what_the_metrics_file_holds("");
}

/// Under tensor parallelism a split parameter's histograms are of the whole tensor, its
/// shards' parts put together (`fc1.weight` is split by columns, `fc2.bias` is not: it
/// comes from shard 0 alone, not once per shard).
#[test]
fn a_split_parameter_s_histograms_hold_the_whole_tensor() {
    holds_what_the_metrics_file_holds("horizontal_parallel_size = 2\n");
}

/// A run of `CONFIG` with `extra` keys: its TensorBoard log holds its metrics file's
/// scalars, and every step's histograms of the whole named tensors.
fn holds_what_the_metrics_file_holds(extra: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("run.toml");
    std::fs::write(&config, format!("{extra}{CONFIG}")).unwrap();
    let metrics = tmp.path().join("metrics.jsonl");
    crate::common::launch::one_process(&config, &metrics);
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let read = Command::new(&python)
        .args(["-c", READER, tmp.path().join("tb").to_str().unwrap()])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `bash scripts/setup.sh`", python.display()));
    assert!(
        read.status.success(),
        "run `bash scripts/setup.sh`: {}",
        String::from_utf8_lossy(&read.stderr)
    );
    let tb: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 6);
    // The process's peak memory so far: there, and never falling.
    let peaks: Vec<f64> = rows
        .iter()
        .map(|r| r["peak_memory_gb"].as_f64().expect("peak_memory_gb"))
        .collect();
    assert!(
        peaks[0] > 0.0 && peaks.windows(2).all(|w| w[0] <= w[1]),
        "{peaks:?}"
    );
    for (tag, key) in [
        ("loss", "loss"),
        ("lr", "lr"),
        ("grad_norm", "grad_norm"),
        ("clip_coef", "clip_coef"),
        ("eval_loss", "eval_loss"),
        ("eval_accuracy", "eval_accuracy"),
        ("peak_memory_gb", "peak_memory_gb"),
    ] {
        let want: Vec<(u64, f32)> = rows
            .iter()
            .filter_map(|r| {
                r[key]
                    .as_f64()
                    .map(|v| (r["step"].as_u64().unwrap(), v as f32))
            })
            .collect();
        let got: Vec<(u64, f32)> = tb["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no scalar {tag}: {tb}"))
            .iter()
            .map(|e| (e[0].as_u64().unwrap(), e[1].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(got, want, "{tag}");
    }
    assert_eq!(
        tb["scalars"]["eval_loss"].as_array().unwrap().len(),
        2,
        "after steps 3 and 6"
    );
    // Histograms: every step, the whole tensor; the last one's range is the trained weights'.
    let model = pipetrain::onnx::load_model(&tmp.path().join("model.onnx")).unwrap();
    for (name, numel) in [("fc1.weight", 20 * 32), ("fc2.bias", 4)] {
        for kind in ["param", "grad"] {
            let h = tb["histograms"][format!("{kind}/{name}")]
                .as_array()
                .unwrap();
            let steps: Vec<u64> = h.iter().map(|e| e[0].as_u64().unwrap()).collect();
            assert_eq!(steps, (1..=6).collect::<Vec<_>>(), "{kind}/{name}");
            assert!(h.iter().all(|e| e[1].as_f64().unwrap() as usize == numel));
        }
        let t = model
            .graph
            .as_ref()
            .unwrap()
            .initializer
            .iter()
            .find(|t| t.name == name)
            .unwrap();
        let values = pipetrain::tensor::Tensor::from_proto(t)
            .unwrap()
            .to_f64_vec();
        let last = &tb["histograms"][format!("param/{name}")]
            .as_array()
            .unwrap()[5];
        let (min, max) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        // Compared as float32 (the values' type; JSON text round trips are not exact in f64).
        let got = (
            last[2].as_f64().unwrap() as f32,
            last[3].as_f64().unwrap() as f32,
        );
        assert_eq!(got, (min as f32, max as f32), "{name}");
    }
}

#[test]
fn unknown_names_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("run.toml");
    let bad = CONFIG.replace(
        "log_dir = \"tb\"",
        "log_dir = \"tb\"\nscalar_names = [\"loss\", \"perplexity\"]",
    );
    let e = pipetrain::config::TrainConfig::parse(&bad, &path)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("scalar_names[1]") && e.contains("perplexity"),
        "{e}"
    );
    let bad = CONFIG.replace("\"fc2.bias\"", "\"fc9.bias\"");
    let cfg = pipetrain::config::TrainConfig::parse(&bad, &path).unwrap();
    let rt = pipetrain::compute::Runtime::from_env().unwrap();
    let e = pipetrain::train::train(&rt, &cfg, &path, false, |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("histogram_names[1]") && e.contains("fc9.bias"),
        "{e}"
    );
}

/// `--chrome-trace`: one complete event per action every actor ran, on a track per
/// (replica, rank), as the Perfetto UI reads them.
#[test]
fn chrome_trace_of_a_real_run() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("run.toml");
    std::fs::write(
        &config,
        CONFIG.replace(
            "log_dir = \"tb\"\nhistogram_names = [\"fc1.weight\", \"fc2.bias\"]\n",
            "",
        ),
    )
    .unwrap();
    let (chrome, trace) = (
        tmp.path().join("run.trace.json"),
        tmp.path().join("run.json"),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args([
            "train",
            config.to_str().unwrap(),
            "--chrome-trace",
            chrome.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&chrome).unwrap()).unwrap();
    let run: pipetrain_actors::RunTrace =
        serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let recorded: usize = run
        .steps
        .iter()
        .flatten()
        .flat_map(|t| &t.ranks)
        .map(Vec::len)
        .sum();
    let events = json["traceEvents"].as_array().unwrap();
    let complete = events.iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(complete, recorded, "one event per recorded action");
    let tracks: std::collections::BTreeSet<(u64, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()))
        .collect();
    assert_eq!(tracks.len(), 2, "1 replica x 2 ranks");
}
