//! The seeds' intermediate models: `model_with_loss_func_path` (forward + loss) and
//! `model_with_training_graph_path` (forward, loss and backward in standard ONNX ops).
//! Stock ONNX Runtime, run from Python in the project's venv, runs both files on a batch
//! with nothing but the data fed; the loss and every gradient equal pipetrain's (within
//! 1e-6 of the same graph run by pipetrain, 1e-5 of the largest gradient of a tensor
//! with its fused kernels).

use crate::common;

use std::path::Path;

use pipetrain::compute::{SessionOptions, TrainSession};
use pipetrain::graph::{build_training_graph, TrainOptions};
use pipetrain::tensor::{Tensor, TensorMap};

const CONFIG: &str = r#"
batch_size = 32
num_train_steps = 1
model_with_loss_func_path = "with_loss.onnx"
model_with_training_graph_path = "training_graph.onnx"
[model]
kind = "mlp"
inputs = 20
hidden = [16]
classes = 4
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
synth = { kind = "teacher", samples = 64, inputs = 20, classes = 4, seed = 2 }
layout = { kind = "arrays", feeds = { x = "x", y = "y" } }
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.1
"#;

#[test]
fn stock_onnx_runtime_runs_the_training_graph_file() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("run.toml");
    let cfg = pipetrain::config::TrainConfig::parse(CONFIG, &path).unwrap();
    pipetrain::train::train(&rt, &cfg, &path, false, |_| {}).unwrap();

    // pipetrain's own loss and gradients on the first batch, initial weights.
    let batches = pipetrain::data::Batches::open(&cfg.data, 32, &path).unwrap();
    let batch: TensorMap = batches.batch(0).unwrap();
    let example: Vec<(&str, &Tensor)> = batch.iter().map(|(k, v)| (k.as_str(), v)).collect();
    // The same graph (standard ops), and the one pipetrain trains with (fused kernels).
    let ours = |fused_kernels: bool| {
        let opts = TrainOptions {
            inputs: Default::default(),
            loss: cfg.loss.clone(),
            trainable: None,
            contrib_ops: true,
            fused_kernels,
            cuda_kernels: false,
            cuda_kernels_untried: false,
            flash_attention: false,
            params: Default::default(),
        };
        let model = cfg.load_model().unwrap();
        let tg = build_training_graph(&rt, &model, &opts, &example).unwrap();
        let params = common::initial_params(&tg);
        let out = TrainSession::new(&rt, &tg, &SessionOptions::default())
            .unwrap()
            .step(&params, &batch, &Tensor::f32(vec![], vec![1.0]).unwrap())
            .unwrap();
        (tg, out)
    };

    // Stock ONNX Runtime from Python, on the files alone.
    let feeds = tmp.path().join("batch.npz");
    pipetrain::data::write_npz(&feeds, &[("x", &batch["x"]), ("y", &batch["y"])]).unwrap();
    let out = tmp.path().join("out.npz");
    let script = r#"
import sys, numpy as np, onnxruntime as ort
d, feeds, out = sys.argv[1], np.load(sys.argv[2]), sys.argv[3]
res = {}
for name in ["with_loss.onnx", "training_graph.onnx"]:
    s = ort.InferenceSession(f"{d}/{name}", providers=["CPUExecutionProvider"])
    wanted = {i.name for i in s.get_inputs()}
    got = s.run(None, {k: feeds[k] for k in feeds.files if k in wanted})
    for o, v in zip(s.get_outputs(), got):
        res[name.split(".")[0] + ":" + o.name] = v
np.savez(out, **res)
"#;
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let run = std::process::Command::new(&python)
        .args([
            "-c",
            script,
            tmp.path().to_str().unwrap(),
            feeds.to_str().unwrap(),
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `bash scripts/setup.sh`", python.display()));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let theirs = pipetrain::data::read_npz(&out).unwrap();

    for (fused, tol) in [(false, 1e-6), (true, 1e-5)] {
        let (tg, ours) = ours(fused);
        let close = |a: f64, b: f64| (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-6);
        for file in ["with_loss", "training_graph"] {
            let loss = theirs[&format!("{file}:loss")].to_f64_vec()[0];
            assert!(
                close(loss, ours.loss),
                "{file}: loss {loss} vs {} (fused {fused})",
                ours.loss
            );
        }
        assert_eq!(tg.params.len(), 4, "2 layers' weights and biases");
        for p in &tg.params {
            let g = &theirs[&format!("training_graph:{}", p.grad)];
            let want = &ours.grads[&p.name];
            assert_eq!(g.shape, want.shape, "{}", p.name);
            let want = want.to_f64_vec();
            // Fused kernels round differently: measured against the tensor's largest.
            let largest = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (a, b) in g.to_f64_vec().iter().zip(want) {
                let near = (a - b).abs() <= tol * largest;
                assert!(
                    close(*a, b) || (fused && near),
                    "{}: {a} vs {b} (fused {fused})",
                    p.name
                );
            }
        }
    }
}
