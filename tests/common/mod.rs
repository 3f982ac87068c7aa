//! Shared test helpers: the ONNX Runtime, and the peers' models, weights, data and curves
//! in `../shared/peers` (see its README).
#![allow(dead_code)]

pub mod gradcheck;

use std::collections::HashMap;
use std::path::PathBuf;

use pipetrain::compute::{Runtime, TensorMap};
use pipetrain::graph::{LossSpec, TrainOptions};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::Tensor;

/// The loaded ONNX Runtime (one per test process).
pub fn runtime() -> Runtime {
    Runtime::from_env().expect("ONNX Runtime: run `bash scripts/setup.sh` first")
}

/// `../shared/peers` beside the project.
pub fn peers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/peers")
}

/// One of the peers' models with its initial weights, data and batch order.
pub struct PeerModel {
    pub name: &'static str,
    pub model: ModelProto,
    pub init: HashMap<String, Tensor>,
    pub data: HashMap<String, Tensor>,
    pub batch_idx: Vec<Vec<usize>>,
}

impl PeerModel {
    pub fn load(name: &'static str) -> PeerModel {
        let dir = peers_dir().join("data");
        let model = pipetrain::onnx::load_model(&dir.join(format!("{name}.onnx"))).unwrap();
        let init = pipetrain::data::read_safetensors(&dir.join(format!("{name}_init.safetensors")))
            .unwrap();
        let data = pipetrain::data::read_npz(&dir.join(format!("{name}_data.npz"))).unwrap();
        let idx = &data["batch_idx"];
        let width = idx.shape[1];
        let flat: Vec<usize> = idx.to_f64_vec().into_iter().map(|v| v as usize).collect();
        let batch_idx = flat.chunks(width).map(<[usize]>::to_vec).collect();
        PeerModel {
            name,
            model,
            init,
            data,
            batch_idx,
        }
    }

    /// The model with the safetensors initial weights in its initializers.
    pub fn model_with_init(&self) -> ModelProto {
        let mut m = self.model.clone();
        for t in &mut m.graph.as_mut().unwrap().initializer {
            if let Some(v) = self.init.get(&t.name) {
                *t = v.to_proto(&t.name);
            }
        }
        m
    }

    /// The loss the peers train.
    pub fn options(&self) -> TrainOptions {
        let label = if self.name == "mlp" { "y" } else { "targets" };
        TrainOptions {
            loss: LossSpec::SoftmaxCrossEntropy {
                prediction: "logits".into(),
                label: label.into(),
                ignore_index: None,
            },
            trainable: None,
            contrib_ops: true,
        }
    }

    /// The inputs and labels of step `step`.
    pub fn batch(&self, step: usize) -> TensorMap {
        let rows = &self.batch_idx[step];
        let mut m = TensorMap::new();
        if self.name == "mlp" {
            m.insert("x".into(), self.data["x"].gather_rows(rows).unwrap());
            m.insert("y".into(), self.data["y"].gather_rows(rows).unwrap());
        } else {
            let t = self.data["tokens"].gather_rows(rows).unwrap();
            let (b, w) = (t.shape[0], t.shape[1]);
            let v = t.as_i64().unwrap();
            let take = |off: usize| -> Vec<i64> {
                (0..b)
                    .flat_map(|r| v[r * w + off..r * w + off + w - 1].iter().copied())
                    .collect()
            };
            m.insert(
                "tokens".into(),
                Tensor::i64(vec![b, w - 1], take(0)).unwrap(),
            );
            m.insert(
                "targets".into(),
                Tensor::i64(vec![b, w - 1], take(1)).unwrap(),
            );
        }
        m
    }

    /// The feeds of a batch as a list.
    pub fn example(batch: &TensorMap) -> Vec<(&str, &Tensor)> {
        batch.iter().map(|(k, v)| (k.as_str(), v)).collect()
    }
}

/// A column of `../shared/peers/results/loss_<model>_<opt>.csv`.
pub fn reference_curve(model: &str, opt: &str, column: &str) -> Vec<f64> {
    let path = peers_dir().join(format!("results/loss_{model}_{opt}.csv"));
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == column).unwrap();
    lines
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect()
}

/// `p -= lr * g` for every parameter.
pub fn sgd(params: &mut TensorMap, grads: &TensorMap, lr: f32) {
    for (name, g) in grads {
        let p = params.get_mut(name).unwrap().as_f32_mut().unwrap();
        for (w, d) in p.iter_mut().zip(g.as_f32().unwrap()) {
            *w -= lr * d;
        }
    }
}
