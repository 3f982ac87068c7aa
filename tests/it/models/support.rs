//! Helpers of `tests/it/models.rs`: temporary folders, the venv's Python (the independent
//! reader of the files), writing models and data, forward passes and training runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use pipetrain::compute::{GraphSession, SessionOptions};
use pipetrain::config::TrainConfig;
use pipetrain::data::{generate, write_npz, SynthSpec};
use pipetrain::models::{build, ModelSpec};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::onnx::save_model;
use pipetrain::tensor::Tensor;
use pipetrain::train::{train, TrainSummary};

use crate::common;

/// A fresh folder for one test.
pub fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("models")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The project's venv Python (the independent reader of the files).
pub fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `bash scripts/setup.sh` first (it installs the `onnx` checker)",
        py.display()
    );
    py
}

/// Runs a Python snippet with `args`; its stdout, or a failure with its stderr.
pub fn run_python(code: &str, args: &[&Path]) -> String {
    let out = Command::new(python())
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .expect("cannot run the venv's python: run `bash scripts/setup.sh`");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed (run `bash scripts/setup.sh` if `onnx` or numpy is missing):\n{stderr}"
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `onnx.checker.check_model(full_check=True)` accepts the file, whose IR version is <= 13.
pub fn onnx_check(path: &Path) {
    let ir = run_python(
        "import sys, onnx\n\
         onnx.checker.check_model(sys.argv[1], full_check=True)\n\
         print(onnx.load(sys.argv[1]).ir_version)",
        &[path],
    );
    let ir: i64 = ir.parse().unwrap();
    assert!(
        ir <= 13,
        "IR version {ir}: ONNX Runtime 1.31 reads up to 13"
    );
}

/// Builds the model and writes it to `dir/model.onnx`.
pub fn write_model(spec: &ModelSpec, dir: &Path) -> (ModelProto, PathBuf) {
    let model = build(spec).unwrap();
    let path = dir.join("model.onnx");
    save_model(&model, &path).unwrap();
    (model, path)
}

/// Generates the data set and writes it to `dir/data.npz`.
pub fn write_data(spec: &SynthSpec, dir: &Path) -> PathBuf {
    let arrays = generate(spec).unwrap();
    let refs: Vec<(&str, &Tensor)> = arrays.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let path = dir.join("data.npz");
    write_npz(&path, &refs).unwrap();
    path
}

/// One forward pass of a model on ONNX Runtime.
pub fn forward(model: &ModelProto, feeds: &[(&str, &Tensor)]) -> Tensor {
    let rt = common::runtime();
    let mut s =
        GraphSession::from_model(&rt, model, &SessionOptions::default(), "forward").unwrap();
    s.run(feeds).unwrap().remove(0)
}

/// Trains with the TOML configuration `text` (in `dir`); the summary and each step's loss.
pub fn train_toml(dir: &Path, text: &str) -> (TrainSummary, Vec<f64>) {
    let path = dir.join("train.toml");
    std::fs::write(&path, text).unwrap();
    let cfg = TrainConfig::parse(text, &path).unwrap();
    let rt = common::runtime();
    let mut losses = Vec::new();
    let summary = train(&rt, &cfg, &path, false, |r| losses.push(r.loss)).unwrap();
    (summary, losses)
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

pub fn tokens(batch: usize, seq: usize, vocab: usize) -> Tensor {
    let v: Vec<i64> = (0..batch * seq).map(|i| (i * 7 % vocab) as i64).collect();
    Tensor::i64(vec![batch, seq], v).unwrap()
}

/// A training configuration: the model and data in the folder, softmax cross-entropy
/// of `logits` against `label`, and the given data layout, batch and optimizer sections.
pub fn config(label: &str, layout: &str, batches: &str, optimizer: &str) -> String {
    format!(
        "model_path = \"model.onnx\"\n{batches}\ndisplay_loss_steps = 1000\n\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"{label}\"\n\n\
         [data]\npath = \"data.npz\"\nlayout = {layout}\n\n{optimizer}\n"
    )
}

pub const NEXT_TOKEN: &str =
    r#"{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }"#;
pub const ARRAYS: &str = r#"{ kind = "arrays", feeds = { x = "x", y = "y" } }"#;
pub const GPT2_ADAMW: &str =
    "[optimizer]\nkind = \"adamw\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 3e-3";

/// The share of rows whose largest logit is the label.
pub fn accuracy(logits: &Tensor, y: &Tensor) -> f64 {
    let c = logits.shape[1];
    let l = logits.as_f32().unwrap();
    let y = y.as_i64().unwrap();
    let hits = y
        .iter()
        .zip(l.chunks(c))
        .filter(|&(&label, row)| {
            let best = (0..c).fold(0, |b, k| if row[k] > row[b] { k } else { b });
            best as i64 == label
        })
        .count();
    hits as f64 / y.len() as f64
}
