//! pipetrain's fused kernels (custom operators in its backward graphs): each against
//! the standard-op graph it replaces, and the switch that turns them off
//! (`runtime.fused_kernels`). Their gradients against finite differences: the float32
//! LayerNormalization case of `tests/grad_ops.rs` runs with fused kernels on.

mod common;

use common::gradcheck::Rng;
use pipetrain::compute::{SessionOptions, TensorMap, TrainSession};
use pipetrain::graph::custom_ops::{DOMAIN, LAYER_NORM_GRAD};
use pipetrain::graph::{build_training_graph, make_node, untyped_value_info};
use pipetrain::graph::{LossSpec, TrainOptions, TrainingGraph};
use pipetrain::onnx::proto::{GraphProto, ModelProto, OperatorSetIdProto};
use pipetrain::tensor::{DType, Tensor};

/// `loss = sum(LayerNorm(X) * R)` over the last axis of `[6, 33, 48]` (rows of 48, with
/// lanes of 8 and no remainder, and of 45, with one), float32.
fn layer_norm_model(cols: usize) -> ModelProto {
    let mut r = Rng::new(3);
    let inits = [
        ("X", r.tensor(DType::F32, &[6, 33, cols], -2.0, 2.0)),
        ("W", r.tensor(DType::F32, &[cols], 0.5, 1.5)),
        ("B", r.tensor(DType::F32, &[cols], -0.5, 0.5)),
        ("R", r.tensor(DType::F32, &[6, 33, cols], -1.0, 1.0)),
    ];
    let nodes = vec![
        make_node(
            "LayerNormalization",
            "ln",
            &["X", "W", "B"],
            &["Y", "M", "I"],
            vec![],
        ),
        make_node("Mul", "m", &["Y", "R"], &["YR"], vec![]),
        make_node("ReduceSum", "s", &["YR"], &["total"], vec![]),
    ];
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: "ln".into(),
            node: nodes,
            initializer: inits.iter().map(|(n, t)| t.to_proto(n)).collect(),
            output: vec![untyped_value_info("total")],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn gradients(model: &ModelProto, fused: bool) -> (TrainingGraph, TensorMap) {
    let rt = common::runtime();
    let opts = TrainOptions {
        loss: LossSpec::Output {
            name: "total".into(),
        },
        trainable: Some(vec!["X".into(), "W".into(), "B".into()]),
        contrib_ops: true,
        fused_kernels: fused,
        params: Default::default(),
    };
    let tg = build_training_graph(&rt, model, &opts, &[]).unwrap();
    let session_opts = SessionOptions {
        intra_threads: 2,
        ..SessionOptions::default()
    };
    let mut s = TrainSession::new(&rt, &tg, &session_opts).unwrap();
    let params: TensorMap = tg
        .params
        .iter()
        .map(|p| (p.name.clone(), p.init.clone()))
        .collect();
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let grads = s.step(&params, &TensorMap::new(), &seed).unwrap().grads;
    (tg, grads)
}

fn fused_nodes(tg: &TrainingGraph) -> usize {
    let g = &tg.graph;
    g.nodes
        .iter()
        .filter(|n| n.domain == DOMAIN && n.op_type == LAYER_NORM_GRAD)
        .count()
}

#[test]
fn layer_norm_grad_gives_the_standard_op_graphs_gradients() {
    for cols in [48, 45] {
        let model = layer_norm_model(cols);
        let (fused_tg, fused) = gradients(&model, true);
        let (plain_tg, plain) = gradients(&model, false);
        assert_eq!(
            fused_nodes(&fused_tg),
            1,
            "one LayerNormGrad replaces the rule's ops"
        );
        assert_eq!(fused_nodes(&plain_tg), 0);
        assert!(fused_tg.graph.nodes.len() + 10 < plain_tg.graph.nodes.len());
        for name in ["X", "W", "B"] {
            let (a, b) = (fused[name].to_f64_vec(), plain[name].to_f64_vec());
            let scale = b.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            let worst = a
                .iter()
                .zip(&b)
                .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            // float32 rounding of sums over up to 198 rows in another order.
            assert!(
                worst <= 2e-6 * scale,
                "d{name} (cols {cols}): {worst:e} of {scale:e}"
            );
        }
    }
}

#[test]
fn fused_and_unfused_runs_follow_the_same_curve() {
    let dir = tempfile::tempdir().unwrap();
    let run = |fused: bool| {
        let path = dir.path().join(format!("f{fused}.toml"));
        let text = format!(
            "batch_size = 8\nnum_train_steps = 40\n\
             [model]\nkind = \"gpt2\"\nlayers = 2\nd_model = 64\nheads = 4\nvocab = 64\nseq = 32\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"targets\"\n\
             [data]\nsynth = {{ kind = \"language\", samples = 512, seq = 32, vocab = 64, seed = 7 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 3e-3\n\
             [runtime]\nfused_kernels = {fused}\n"
        );
        std::fs::write(&path, text).unwrap();
        let cfg = pipetrain::config::TrainConfig::load(&path).unwrap();
        let mut losses = Vec::new();
        pipetrain::train::train(&common::runtime(), &cfg, &path, false, |r| {
            losses.push(r.loss)
        })
        .unwrap();
        losses
    };
    let (on, off) = (run(true), run(false));
    assert_eq!(on.len(), 40);
    let worst = on
        .iter()
        .zip(&off)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "fused and unfused curves differ by {worst:e}");
}
