//! The built-in models (`pipetrain::models`) on the synthetic data sets
//! (`pipetrain::data::synth`): ONNX Runtime runs each and the `onnx` checker accepts it,
//! and `pipetrain::train::train` trains each, as a 2-stage pipeline too.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use pipetrain::compute::{GraphSession, SessionOptions};
use pipetrain::config::TrainConfig;
use pipetrain::data::synth::{ImagesConfig, LanguageConfig, TeacherConfig};
use pipetrain::data::{generate, write_npz, SynthSpec};
use pipetrain::graph::export_inference_model;
use pipetrain::models::{build, Gpt2Config, MlpConfig, ModelSpec, SqueezeNetConfig};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::onnx::save_model;
use pipetrain::tensor::Tensor;
use pipetrain::train::{train, TrainSummary};
use pipetrain::Error;

/// A fresh folder for one test.
fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("models")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The project's venv Python (the independent reader of the files).
fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `bash scripts/setup.sh` first (it installs the `onnx` checker)",
        py.display()
    );
    py
}

/// Runs a Python snippet with `args`; its stdout, or a failure with its stderr.
fn run_python(code: &str, args: &[&Path]) -> String {
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
fn onnx_check(path: &Path) {
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
fn write_model(spec: &ModelSpec, dir: &Path) -> (ModelProto, PathBuf) {
    let model = build(spec).unwrap();
    let path = dir.join("model.onnx");
    save_model(&model, &path).unwrap();
    (model, path)
}

/// Generates the data set and writes it to `dir/data.npz`.
fn write_data(spec: &SynthSpec, dir: &Path) -> PathBuf {
    let arrays = generate(spec).unwrap();
    let refs: Vec<(&str, &Tensor)> = arrays.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let path = dir.join("data.npz");
    write_npz(&path, &refs).unwrap();
    path
}

/// One forward pass of a model on ONNX Runtime.
fn forward(model: &ModelProto, feeds: &[(&str, &Tensor)]) -> Tensor {
    let rt = common::runtime();
    let mut s =
        GraphSession::from_model(&rt, model, &SessionOptions::default(), "forward").unwrap();
    s.run(feeds).unwrap().remove(0)
}

/// Trains with the TOML configuration `text` (in `dir`); the summary and each step's loss.
fn train_toml(dir: &Path, text: &str) -> (TrainSummary, Vec<f64>) {
    let path = dir.join("train.toml");
    std::fs::write(&path, text).unwrap();
    let cfg = TrainConfig::parse(text, &path).unwrap();
    let rt = common::runtime();
    let mut losses = Vec::new();
    let summary = train(&rt, &cfg, &path, false, |r| losses.push(r.loss)).unwrap();
    (summary, losses)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn tokens(batch: usize, seq: usize, vocab: usize) -> Tensor {
    let v: Vec<i64> = (0..batch * seq).map(|i| (i * 7 % vocab) as i64).collect();
    Tensor::i64(vec![batch, seq], v).unwrap()
}

#[test]
fn gpt2_with_a_dynamic_batch_runs_any_batch_and_passes_the_checker() {
    let dir = tmp("gpt2_dynamic");
    let cfg = Gpt2Config::default();
    let (model, path) = write_model(&ModelSpec::Gpt2(cfg.clone()), &dir);
    onnx_check(&path);
    for batch in [1, 3] {
        let logits = forward(&model, &[("tokens", &tokens(batch, cfg.seq, cfg.vocab))]);
        assert_eq!(logits.shape, vec![batch * cfg.seq, cfg.vocab]);
        assert!(logits.as_f32().unwrap().iter().all(|v| v.is_finite()));
    }
}

#[test]
fn gpt2_with_a_fixed_batch_and_tied_embeddings_runs_and_passes_the_checker() {
    let dir = tmp("gpt2_fixed");
    let cfg = Gpt2Config {
        batch: Some(2),
        tie_embeddings: true,
        layers: 1,
        ..Default::default()
    };
    let (model, path) = write_model(&ModelSpec::Gpt2(cfg.clone()), &dir);
    onnx_check(&path);
    let logits = forward(&model, &[("tokens", &tokens(2, cfg.seq, cfg.vocab))]);
    assert_eq!(logits.shape, vec![2 * cfg.seq, cfg.vocab]);
}

#[test]
fn squeezenet_runs_and_passes_the_checker() {
    let dir = tmp("squeezenet_forward");
    let cfg = SqueezeNetConfig::default();
    let (model, path) = write_model(&ModelSpec::Squeezenet(cfg), &dir);
    onnx_check(&path);
    let x = Tensor::f32(vec![2, 3, 32, 32], vec![0.5; 2 * 3 * 32 * 32]).unwrap();
    let logits = forward(&model, &[("x", &x)]);
    assert_eq!(logits.shape, vec![2, 10]);
}

#[test]
fn mlp_runs_and_passes_the_checker() {
    let dir = tmp("mlp_forward");
    let (model, path) = write_model(&ModelSpec::Mlp(MlpConfig::default()), &dir);
    onnx_check(&path);
    let x = Tensor::f32(vec![5, 784], vec![0.1; 5 * 784]).unwrap();
    assert_eq!(forward(&model, &[("x", &x)]).shape, vec![5, 10]);
}

/// A training configuration: the model and data in the folder, softmax cross-entropy
/// of `logits` against `label`, and the given data layout, batch and optimizer sections.
fn config(label: &str, layout: &str, batches: &str, optimizer: &str) -> String {
    format!(
        "model_path = \"model.onnx\"\n{batches}\ndisplay_loss_steps = 1000\n\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"{label}\"\n\n\
         [data]\npath = \"data.npz\"\nlayout = {layout}\n\n{optimizer}\n"
    )
}

const NEXT_TOKEN: &str =
    r#"{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }"#;
const ARRAYS: &str = r#"{ kind = "arrays", feeds = { x = "x", y = "y" } }"#;
const GPT2_ADAMW: &str =
    "[optimizer]\nkind = \"adamw\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 3e-3";

/// Writes the default GPT-2 (dynamic batch) and the default language to `dir`.
fn gpt2_setup(dir: &Path) -> LanguageConfig {
    write_model(&ModelSpec::Gpt2(Gpt2Config::default()), dir);
    let lang = LanguageConfig::default();
    write_data(&SynthSpec::Language(lang.clone()), dir);
    lang
}

/// Measured: 100 AdamW steps of 16 sequences take the loss from 4.16 (ln 64; mean of
/// the first 5 steps 3.91) to 1.53 (last 5), against the language's floor ln 4 = 1.386,
/// in about 1 s.
#[test]
fn gpt2_learns_the_synthetic_language() {
    let dir = tmp("gpt2_train");
    let lang = gpt2_setup(&dir);
    let batches = "batch_size = 16\nnum_train_steps = 100";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("targets", NEXT_TOKEN, batches, GPT2_ADAMW));
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    let floor = lang.entropy_floor();
    eprintln!(
        "gpt2: {} steps in {:.1?}: loss {first:.3} -> {last:.3} (floor {floor:.3})",
        summary.steps,
        start.elapsed()
    );
    assert_eq!(summary.steps, 100);
    assert!(
        (losses[0] - 64f64.ln()).abs() < 0.05,
        "starts near ln 64: {}",
        losses[0]
    );
    assert!(first - last > 2.0, "loss {first:.3} -> {last:.3}");
    assert!(
        last < floor + 0.4,
        "{last:.3} is not near the floor {floor:.3}"
    );
    assert!(
        last > floor - 0.05,
        "{last:.3} beats the floor {floor:.3}: labels leak"
    );
}

/// The dynamic-batch GPT-2 trains as a 2-stage pipeline of 4 micro-batches of 4, and
/// its losses are those of one stage taking the 16 sequences at once (micro-batching
/// only changes float32 summation order: measured within 1e-5).
#[test]
fn gpt2_trains_as_a_two_stage_pipeline_of_small_micro_batches() {
    let dir = tmp("gpt2_pipeline");
    gpt2_setup(&dir);
    let whole = "batch_size = 16\nnum_train_steps = 30";
    let piped = "batch_size = 4\ngradient_accumulation_steps = 4\nnum_train_steps = 120\n\
                 pipeline_parallel_size = 2";
    let (one, reference) = train_toml(&dir, &config("targets", NEXT_TOKEN, whole, GPT2_ADAMW));
    let start = Instant::now();
    let (two, losses) = train_toml(&dir, &config("targets", NEXT_TOKEN, piped, GPT2_ADAMW));
    eprintln!(
        "gpt2 pipeline: {} steps of 4 micro-batches in {:.1?}, loss {:.3} -> {:.3}",
        two.steps,
        start.elapsed(),
        losses[0],
        losses[losses.len() - 1]
    );
    assert_eq!((one.stages, two.stages), (1, 2));
    assert_eq!(losses.len(), reference.len());
    let worst = losses
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!("max |pipeline - single stage| loss: {worst:.2e}");
    assert!(worst < 1e-4, "pipeline losses differ by {worst:.2e}");
    assert!(losses[0] - losses[losses.len() - 1] > 1.0);
}

/// Measured: 200 Adam steps (cosine, 5% warmup) of 32 images take the held-out accuracy
/// from 0.12 to 0.79 (chance 0.10) and the training loss from 2.31 to ~0.46, in ~7.5 s.
#[test]
fn squeezenet_learns_the_synthetic_images() {
    let dir = tmp("squeezenet_train");
    let (model, _) = write_model(&ModelSpec::Squeezenet(SqueezeNetConfig::default()), &dir);
    let images = ImagesConfig::default();
    write_data(&SynthSpec::Images(images.clone()), &dir);
    let optimizer = "[optimizer]\nkind = \"adam\"\n\n\
                     [lr_schedule]\nkind = \"cosine\"\nlr = 3e-4\nwarmup_ratio = 0.05";
    let batches = "batch_size = 32\nnum_train_steps = 200";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("y", ARRAYS, batches, optimizer));
    // Accuracy on held-out images of the same classes, before and after.
    let held_out = ImagesConfig {
        samples: 200,
        sample_seed: 1,
        ..images
    };
    let d = generate(&SynthSpec::Images(held_out)).unwrap();
    let accuracy_of = |m: &ModelProto| accuracy(&forward(m, &[("x", &d["x"])]), &d["y"]);
    let trained: Vec<(&str, &Tensor)> = summary
        .parameters
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let (before, after) = (
        accuracy_of(&model),
        accuracy_of(&export_inference_model(&model, &trained).unwrap()),
    );
    let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
    eprintln!(
        "squeezenet: {} steps in {:.1?}: loss {first:.3} -> {last:.3}, held-out accuracy \
         {before:.3} -> {after:.3}",
        summary.steps,
        start.elapsed()
    );
    assert!(after >= 0.4, "held-out accuracy {after} (chance 0.1)");
    assert!(after > before + 0.2);
    assert!(last < first - 1.0, "loss {first:.3} -> {last:.3}");
}

/// The share of rows whose largest logit is the label.
fn accuracy(logits: &Tensor, y: &Tensor) -> f64 {
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

/// Measured: 150 AdamW steps (lr 1e-3) of 64 teacher-labelled samples take the default
/// MLP's training loss from 2.30 to 0.003 (it memorises the 2048 samples), in ~0.4 s;
/// held-out accuracy (1000 fresh samples) goes from 0.11 to 0.34 (chance 0.1).
#[test]
fn mlp_learns_the_teacher() {
    let dir = tmp("mlp_train");
    let (model, _) = write_model(&ModelSpec::Mlp(MlpConfig::default()), &dir);
    let teacher = TeacherConfig {
        samples: 2048,
        ..Default::default()
    };
    write_data(&SynthSpec::Teacher(teacher.clone()), &dir);
    let optimizer =
        "[optimizer]\nkind = \"adamw\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3";
    let batches = "batch_size = 64\nnum_train_steps = 150";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("y", ARRAYS, batches, optimizer));
    let held_out = TeacherConfig {
        samples: 1000,
        sample_seed: 1,
        ..teacher
    };
    let d = generate(&SynthSpec::Teacher(held_out)).unwrap();
    let accuracy_of = |m: &ModelProto| accuracy(&forward(m, &[("x", &d["x"])]), &d["y"]);
    let trained: Vec<(&str, &Tensor)> = summary
        .parameters
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let (before, after) = (
        accuracy_of(&model),
        accuracy_of(&export_inference_model(&model, &trained).unwrap()),
    );
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    eprintln!(
        "mlp: {} steps in {:.1?}: loss {first:.3} -> {last:.3}, held-out accuracy \
         {before:.3} -> {after:.3}",
        summary.steps,
        start.elapsed()
    );
    assert!(last < 0.1, "loss {first:.3} -> {last:.3}");
    assert!(first > 2.0, "loss {first:.3} -> {last:.3}");
    assert!(after > 0.25, "held-out accuracy {before:.3} -> {after:.3}");
}

/// numpy reads what `write_npz` wrote: shapes, types and values (sums) agree.
#[test]
fn numpy_reads_the_synthetic_data_files() {
    let dir = tmp("numpy");
    let spec = SynthSpec::Teacher(TeacherConfig {
        samples: 100,
        inputs: 8,
        ..Default::default()
    });
    let path = write_data(&spec, &dir);
    let arrays = generate(&spec).unwrap();
    let seen = run_python(
        "import sys, numpy as np\n\
         d = np.load(sys.argv[1])\n\
         print(d['x'].dtype, d['x'].shape, repr(float(d['x'].astype(np.float64).sum())), \
               d['y'].dtype, d['y'].shape, int(d['y'].sum()))",
        &[&path],
    );
    let x_sum: f64 = arrays["x"].to_f64_vec().iter().sum();
    let y_sum: i64 = arrays["y"].as_i64().unwrap().iter().sum();
    let parts: Vec<&str> = seen.split(' ').collect();
    assert_eq!(parts[0], "float32", "{seen}");
    assert_eq!(parts[1..3].join(" "), "(100, 8)", "{seen}");
    assert!(
        (parts[3].parse::<f64>().unwrap() - x_sum).abs() < 1e-9,
        "{seen}"
    );
    assert_eq!(parts[4], "int64", "{seen}");
    assert_eq!(parts[5], "(100,)", "{seen}");
    assert_eq!(parts[6].parse::<i64>().unwrap(), y_sum, "{seen}");
}

/// A model section with a broken rule names the file and the field.
#[test]
fn bad_model_configs_name_the_field() {
    let cases = [
        ("kind = \"gpt2\"\nd_model = 30\nheads = 4", "model.heads"),
        ("kind = \"gpt2\"\nbatch = 0", "model.batch"),
        ("kind = \"squeezenet\"\nimage_size = 16", "model.image_size"),
        ("kind = \"mlp\"\nhidden = [64, 0]", "model.hidden[1]"),
    ];
    for (text, want) in cases {
        let spec: ModelSpec = toml::from_str(text).unwrap();
        match spec.validate(Path::new("run.toml")) {
            Err(Error::Config { path, field, .. }) => {
                assert_eq!(
                    (path.as_path(), field.as_str()),
                    (Path::new("run.toml"), want)
                )
            }
            other => panic!("{text}: {other:?}"),
        }
        assert!(matches!(build(&spec), Err(Error::Config { .. })), "{text}");
    }
}
