//! The coordinator's decisions on real training: the global gradient norm and clipping,
//! static and dynamic loss scaling with an injected overflow, the stop on a non-finite
//! loss, and the loss normalized by tokens under accumulation.

use crate::common;

use std::path::Path;

use crate::common::mlp::Mlp;
use pipetrain::checkpoint::{folder_name, latest_complete, LoadedCheckpoint};
use pipetrain::compute::Runtime;
use pipetrain::tensor::Tensor;
use pipetrain::train::StepReport;

const PLAIN_SGD: &str =
    "[optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.05\n";

fn train(rt: &Runtime, mlp: &Mlp, dir: &Path) -> (Vec<StepReport>, Vec<(String, Tensor)>) {
    let (cfg, path) = mlp.config(dir);
    let mut reports = Vec::new();
    let s = pipetrain::train::train(rt, &cfg, &path, false, |r| reports.push(r.clone())).unwrap();
    let mut params = s.parameters;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    (reports, params)
}

/// PyTorch float64's L2 norm of the step-0 gradients of the peers' MLP, from the norms of
/// each tensor in `peers/results/tensor_stats.csv`.
fn torch_f64_step0_norm() -> f64 {
    let text =
        std::fs::read_to_string(common::peers_dir().join("results/tensor_stats.csv")).unwrap();
    let sq: f64 = text
        .lines()
        .filter(|l| l.starts_with("mlp,sgd,torch_f64,grad_step0,"))
        .map(|l| l.split(',').nth(5).unwrap().parse::<f64>().unwrap().powi(2))
        .sum();
    assert!(sq > 0.0, "no torch_f64 step-0 gradient norms found");
    sq.sqrt()
}

/// The global norm sums every stage of the pipeline and counts each replica's gradients
/// once after the all-reduce: at (dp, pp) = (2, 2) it is PyTorch float64's norm of the
/// whole batch's gradient. Clipping to a tenth of it scales the step by
/// `max / (norm + 1e-6)`, which the same run without clipping at that smaller learning
/// rate reproduces.
#[test]
fn global_norm_and_clipping() {
    let rt = common::runtime();
    let reference = torch_f64_step0_norm();
    let tmp = tempfile::tempdir().unwrap();
    let base = Mlp {
        dp: 2,
        pp: 2,
        accum: 2,
        steps: 1,
        optimizer: PLAIN_SGD,
        ..Mlp::default()
    };
    let (plain, unclipped) = train(&rt, &base, tmp.path());
    let norm = plain[0].grad_norm;
    eprintln!("global norm {norm:.9} vs torch f64 {reference:.9}");
    assert!(
        (norm - reference).abs() <= 1e-6 * reference,
        "{norm} vs {reference}"
    );
    assert_eq!(plain[0].clip_coef, None);

    let max = reference / 10.0;
    let clipped_cfg = Mlp {
        extra: format!("max_grad_norm = {max}\n"),
        ..base.clone()
    };
    let (clipped, weights) = train(&rt, &clipped_cfg, tmp.path());
    let coef = clipped[0].clip_coef.unwrap();
    assert!((coef - max / (norm + 1e-6)).abs() < 1e-12, "{coef}");
    assert_eq!(
        clipped[0].grad_norm, norm,
        "the norm is taken before clipping"
    );

    let lr = 0.05 * coef;
    let slower = Mlp {
        optimizer: Box::leak(
            format!("[optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = {lr}\n")
                .into_boxed_str(),
        ),
        ..base
    };
    let (_, expected) = train(&rt, &slower, tmp.path());
    for (((name, w), (_, e)), (_, w0)) in weights.iter().zip(&expected).zip(&unclipped) {
        let (w, e, w0) = (w.to_f64_vec(), e.to_f64_vec(), w0.to_f64_vec());
        // Each value within 1e-5 of its step, plus two float32 roundings of the weight:
        // `w - lr * (coef * g)` and `w - (lr * coef) * g` round differently.
        for ((a, b), c) in w.iter().zip(&e).zip(&w0) {
            let tol = 1e-5 * (b - c).abs() + 2.0 * f64::from(f32::EPSILON) * b.abs();
            assert!((a - b).abs() <= tol, "{name}: {a} vs {b} (from {c})");
        }
    }
}

/// Scaling the loss by a power of two changes no bit: the gradients scale exactly and
/// are unscaled exactly before the optimizer.
#[test]
fn static_loss_scale_changes_nothing() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let base = Mlp {
        steps: 5,
        ..Mlp::default()
    };
    let (r1, w1) = train(&rt, &base, tmp.path());
    let scaled = Mlp {
        extra: "loss_scale = 1024.0\n".into(),
        ..base
    };
    let (r2, w2) = train(&rt, &scaled, tmp.path());
    assert_eq!(r2[0].loss_scale, 1024.0);
    let bits = |w: &[(String, Tensor)]| -> Vec<Vec<u32>> {
        w.iter()
            .map(|(_, t)| t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    assert!(bits(&w1) == bits(&w2));
    let losses = |r: &[StepReport]| r.iter().map(|s| s.loss).collect::<Vec<_>>();
    assert_eq!(losses(&r1), losses(&r2));
}

/// Dynamic scaling (ONNX Runtime's semantics): an inf injected into one stage of one
/// replica skips the step on every stage and replica (parameters and optimizer state
/// unchanged, bit for bit), halves the scale, and is reported; training goes on.
#[test]
fn an_overflow_skips_the_step_everywhere_and_halves_the_scale() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        dp: 2,
        pp: 2,
        accum: 2,
        steps: 5,
        schedule: "zb_h1",
        optimizer: common::mlp::ADAMW_COSINE,
        extra: format!(
            "loss_scale = 0.0\ncheckpoints_dir = \"{}\"\ncheckpoint_period = 1\n\
             [[debug.inject_grad_overflow]]\nstep = 3\nstage = 1\nreplica = 1\n",
            tmp.path().join("ck").display()
        ),
        ..Mlp::default()
    };
    let (reports, _) = train(&rt, &mlp, tmp.path());
    let skipped: Vec<bool> = reports.iter().map(|r| r.skipped).collect();
    assert_eq!(skipped, vec![false, false, true, false, false]);
    let scales: Vec<f64> = reports.iter().map(|r| r.loss_scale).collect();
    assert_eq!(scales, vec![65536.0, 65536.0, 65536.0, 32768.0, 32768.0]);
    assert!(
        reports.iter().all(|r| r.loss.is_finite()),
        "replica 1 kept finite weights"
    );
    // Replica 0 had finite gradients itself, and still skipped: its state after step 3
    // is its state after step 2, file for file.
    let dir = |n| tmp.path().join("ck").join(folder_name(n));
    let files = ["stage-000", "stage-001"].iter().flat_map(|s| {
        [
            format!("{s}.params.safetensors"),
            format!("{s}.optimizer.safetensors"),
        ]
    });
    for f in files {
        let (a, b) = (
            std::fs::read(dir(2).join(&f)).unwrap(),
            std::fs::read(dir(3).join(&f)).unwrap(),
        );
        assert!(a == b, "{f} changed in the skipped step");
    }
    let after = LoadedCheckpoint::open(&dir(3)).unwrap();
    assert_eq!(
        after.optimizer_steps(),
        2,
        "a skipped update is not counted"
    );
    assert_eq!(after.manifest.loss_scaler.state.scale, 32768.0);
    assert_eq!(after.manifest.loss_scaler.mode, "dynamic");
}

/// Without dynamic scaling, a diverging run (learning rate 1e6) stops with an error
/// naming the step and the stage, and exits non-zero; the checkpoints it completed
/// before stay loadable.
#[test]
fn a_diverging_run_stops_and_keeps_its_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        steps: 50,
        optimizer: "[optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e6\n",
        extra: format!(
            "checkpoints_dir = \"{}\"\ncheckpoint_period = 1\n",
            tmp.path().join("ck").display()
        ),
        ..Mlp::default()
    };
    let (_, path) = mlp.config(tmp.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["train", path.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        line.contains("optimizer step") && line.contains("non-finite") && line.contains("stage"),
        "{err}"
    );
    let step: u64 = line
        .split("optimizer step ")
        .nth(1)
        .and_then(|t| t.split(':').next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    let (latest, m) = latest_complete(&tmp.path().join("ck")).unwrap().unwrap();
    assert!(
        m.steps_done < step,
        "checkpoint {} at or after the bad step {step}",
        m.steps_done
    );
    LoadedCheckpoint::open(&latest).unwrap();
}

/// `loss.normalize = "tokens"`: with unevenly ignored labels, 2 micro-batches of 4 give
/// one batch of 8's loss and update; `"micro_batch"` gives the mean of the two
/// micro-batches' means instead.
#[test]
fn token_normalization_equals_one_big_batch() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("ignored.npz");
    let script = r#"
import numpy as np, sys
src = np.load(sys.argv[1])
x = src["x"][:8].copy()
y = src["y"][:8].copy()
y[[0, 1, 2]] = -100          # 3 of the first micro-batch's 4 rows ignored, none of the second's
np.savez(sys.argv[2], x=x, y=y, order=np.arange(8, dtype=np.int64).reshape(1, 8),
         first=np.arange(0, 4, dtype=np.int64).reshape(1, 4), second=np.arange(4, 8, dtype=np.int64).reshape(1, 4))
"#;
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let src = common::peers_dir().join("data/mlp_data.npz");
    let ok = std::process::Command::new(&python)
        .args(["-c", script, src.to_str().unwrap(), data.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(
        ok.success(),
        "{} failed: run `bash scripts/setup.sh`",
        python.display()
    );
    let run = |batch: usize, accum: usize, normalize: &str, order: &str| {
        let text = format!(
            r#"
model_path = "{peers}/mlp.onnx"
init_path = "{peers}/mlp_init.safetensors"
batch_size = {batch}
gradient_accumulation_steps = {accum}
num_train_steps = {accum}
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
ignore_index = -100
normalize = "{normalize}"
[data]
path = "{data}"
batch_order = "{order}"
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.5
[runtime]
intra_op_threads = 1
"#,
            peers = common::peers_dir().join("data").display(),
            data = data.display(),
        );
        let path = tmp.path().join("run.toml");
        let cfg = pipetrain::config::TrainConfig::parse(&text, &path).unwrap();
        let mut loss = f64::NAN;
        let s = pipetrain::train::train(&rt, &cfg, &path, false, |r| loss = r.loss).unwrap();
        let mut p = s.parameters;
        p.sort_by(|a, b| a.0.cmp(&b.0));
        (loss, p)
    };
    let (whole_loss, whole) = run(8, 1, "micro_batch", "order");
    let (tok_loss, tok) = run(4, 2, "tokens", "order");
    eprintln!("one batch {whole_loss}, tokens {tok_loss}");
    assert!(
        (whole_loss - tok_loss).abs() <= 1e-6 * whole_loss,
        "{whole_loss} vs {tok_loss}"
    );
    for ((name, a), (_, b)) in whole.iter().zip(&tok) {
        let d = a
            .to_f64_vec()
            .iter()
            .zip(b.to_f64_vec())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(d <= 1e-6, "{name}: {d:e}");
    }
    let (mb_loss, _) = run(4, 2, "micro_batch", "order");
    let (first, _) = run(4, 1, "micro_batch", "first");
    let (second, _) = run(4, 1, "micro_batch", "second");
    let mean_of_means = (first + second) / 2.0;
    eprintln!("micro_batch {mb_loss}, mean of means {mean_of_means}");
    assert!((mb_loss - mean_of_means).abs() <= 1e-6 * mb_loss.abs());
    assert!(
        (mb_loss - whole_loss).abs() > 1e-3,
        "the two normalizations must differ here"
    );
}
