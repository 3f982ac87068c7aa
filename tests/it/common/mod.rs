//! Shared test helpers: the ONNX Runtime, and the peers' models, weights, data and curves
//! in `peers/` (see its README).
#![allow(dead_code)]

pub mod exported;
pub mod fused;
pub mod gradcheck;
pub mod launch;
pub mod mlp;

use std::collections::HashMap;
use std::path::PathBuf;

use pipetrain::compute::{Runtime, TensorMap};
use pipetrain::config::{DataConfig, DataLayout};
use pipetrain::data::Batches;
use pipetrain::graph::{build_training_graph, LossSpec, TrainOptions, TrainingGraph};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::Tensor;

/// The parameters of `tg` at their initial values, by name: what a session's first step
/// feeds.
pub fn initial_params(tg: &TrainingGraph) -> TensorMap {
    tg.params
        .iter()
        .map(|p| (p.name.clone(), p.init.to_tensor().unwrap()))
        .collect()
}

/// An opset-17 model of `nodes` with `inits` as initializers, `inputs` and `outputs`.
pub fn opset17_model(
    name: &str,
    nodes: Vec<pipetrain::onnx::proto::NodeProto>,
    inits: Vec<pipetrain::onnx::proto::TensorProto>,
    input: Vec<pipetrain::onnx::proto::ValueInfoProto>,
    output: Vec<pipetrain::onnx::proto::ValueInfoProto>,
) -> pipetrain::onnx::proto::ModelProto {
    use pipetrain::onnx::proto::{GraphProto, ModelProto, OperatorSetIdProto};
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: name.into(),
            node: nodes,
            initializer: inits,
            input,
            output,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The loaded ONNX Runtime (one per test process).
pub fn runtime() -> Runtime {
    Runtime::from_env().expect("ONNX Runtime: run `bash scripts/setup.sh` first")
}

/// Trains `config` with `pipetrain train`, the step metrics into `metrics`; the losses.
/// Panics with the process's stderr when it fails.
pub fn train_losses(config: &std::path::Path, metrics: &std::path::Path) -> Vec<f64> {
    launch::one_process(config, metrics);
    metrics_losses(metrics)
}

/// The `loss` of every line of a metrics file (`--metrics`), in order.
pub fn metrics_losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// The peers' models, initial weights, data and reference curves (`peers/`).
pub fn peers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("peers")
}

/// One of the peers' models with its initial weights, data and batch order.
pub struct PeerModel {
    pub name: &'static str,
    pub model: ModelProto,
    pub init: HashMap<String, Tensor>,
    batches: Batches,
}

impl PeerModel {
    pub fn load(name: &'static str) -> PeerModel {
        let dir = peers_dir().join("data");
        let model = pipetrain::onnx::load_model(&dir.join(format!("{name}.onnx"))).unwrap();
        let init = pipetrain::data::read_safetensors(&dir.join(format!("{name}_init.safetensors")))
            .unwrap();
        // The same batches `pipetrain train` makes from the examples' data sections.
        let (layout, global) = if name == "mlp" {
            let feeds = [("x", "x"), ("y", "y")]
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .into();
            (DataLayout::Arrays { feeds }, 64)
        } else {
            let layout = DataLayout::NextToken {
                array: "tokens".into(),
                input: "tokens".into(),
                label: "targets".into(),
            };
            (layout, 8)
        };
        let cfg = DataConfig {
            path: dir.join(format!("{name}_data.npz")),
            synth: None,
            batch_order: Some("batch_idx".into()),
            layout,
            shards: None,
            check: true,
        };
        let batches = Batches::open(&cfg, global, &dir).unwrap();
        PeerModel {
            name,
            model,
            init,
            batches,
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
            inputs: Default::default(),
            loss: LossSpec::SoftmaxCrossEntropy {
                prediction: "logits".into(),
                label: label.into(),
                ignore_index: None,
                class_axis: None,
                normalize: Default::default(),
            },
            trainable: None,
            contrib_ops: true,
            fused_kernels: true,
            cuda_kernels: false,
            cuda_kernels_untried: false,
            flash_attention: false,
            params: Default::default(),
        }
    }

    /// The training graph of the model with its initial weights, for the peers' batch.
    pub fn training_graph(&self, rt: &Runtime) -> TrainingGraph {
        build_training_graph(
            rt,
            &self.model_with_init(),
            &self.options(),
            &PeerModel::example(&self.batch(0)),
        )
        .unwrap()
    }

    /// The inputs and labels of step `step`.
    pub fn batch(&self, step: usize) -> TensorMap {
        self.batches.batch(step).unwrap()
    }

    /// The feeds of a batch as a list.
    pub fn example(batch: &TensorMap) -> Vec<(&str, &Tensor)> {
        batch.iter().map(|(k, v)| (k.as_str(), v)).collect()
    }
}

/// A column of `peers/results/loss_<model>_<opt>.csv`.
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

/// Nodes computing `to` from `from` (same shape) through an operator without a gradient
/// rule, named `name`: `MaxRoiPool` over each value as a 1 x 1 image of its own, one
/// region of interest per value (the regions computed from `from`'s size); with the
/// initializers they read.
pub fn no_rule_nodes(
    name: &str,
    from: &str,
    to: &str,
) -> (
    Vec<pipetrain::onnx::proto::NodeProto>,
    Vec<pipetrain::onnx::proto::TensorProto>,
) {
    use pipetrain::graph::{int_attr, ints_attr, make_node};
    let v = |what: &str| format!("{name}/{what}");
    let (images, zero, one, axis, nothing) = (v("images"), v("zero"), v("one"), v("axis"), v("0f"));
    let node = |op: &str, what: &str, inputs: &[&str]| {
        make_node(op, &v(what), inputs, &[&v(what)], vec![])
    };
    let nodes = vec![
        node("Shape", "shape", &[from]),
        node("Reshape", "x", &[from, &images]),
        node("Size", "n", &[from]),
        node("Range", "ids", &[&zero, &v("n"), &one]),
        make_node(
            "Cast",
            &v("fids"),
            &[&v("ids")],
            &[&v("fids")],
            vec![int_attr("to", 1)],
        ),
        node("Unsqueeze", "column", &[&v("fids"), &axis]),
        node("Mul", "zeros", &[&v("column"), &nothing]),
        make_node(
            "Concat",
            &v("rois"),
            &[
                &v("column"),
                &v("zeros"),
                &v("zeros"),
                &v("zeros"),
                &v("zeros"),
            ],
            &[&v("rois")],
            vec![int_attr("axis", 1)],
        ),
        make_node(
            "MaxRoiPool",
            name,
            &[&v("x"), &v("rois")],
            &[&v("pooled")],
            vec![ints_attr("pooled_shape", &[1, 1])],
        ),
        make_node(
            "Reshape",
            &v("back"),
            &[&v("pooled"), &v("shape")],
            &[to],
            vec![],
        ),
    ];
    let inits = vec![
        Tensor::i64(vec![4], vec![-1, 1, 1, 1])
            .unwrap()
            .to_proto(&images),
        Tensor::i64(vec![], vec![0]).unwrap().to_proto(&zero),
        Tensor::i64(vec![], vec![1]).unwrap().to_proto(&one),
        Tensor::i64(vec![1], vec![1]).unwrap().to_proto(&axis),
        Tensor::f32(vec![], vec![0.0]).unwrap().to_proto(&nothing),
    ];
    (nodes, inits)
}
