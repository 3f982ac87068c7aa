//! Model files: external data, saving, exporting the trained model, and bad input that
//! must fail with a typed error naming the file, node or name.

use crate::common;

use std::path::PathBuf;

use crate::common::PeerModel;
use pipetrain::compute::{GraphSession, SessionOptions, TrainSession};
use pipetrain::graph::{
    build_training_graph, export_inference_model, make_node, LossSpec, TrainOptions,
};
use pipetrain::onnx::proto::{
    tensor_proto::DataLocation, GraphProto, ModelProto, OperatorSetIdProto, StringStringEntryProto,
};
use pipetrain::onnx::{load_model, save_model};
use pipetrain::tensor::Tensor;
use pipetrain::Error;

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("files");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn mlp_path() -> PathBuf {
    common::peers_dir().join("data/mlp.onnx")
}

#[test]
fn exported_model_gives_pipetrains_logits_in_onnx_runtime() {
    let rt = common::runtime();
    let peer = PeerModel::load("tiny_gpt");
    let tg = peer.training_graph(&rt);
    let mut session = TrainSession::new(&rt, &tg, &SessionOptions::default()).unwrap();
    let mut params = common::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    for step in 0..5 {
        let out = session.step(&params, &peer.batch(step), &seed).unwrap();
        common::sgd(&mut params, &out.grads, 0.05);
    }
    // pipetrain's forward with the trained parameters.
    let batch = peer.batch(7);
    let fwd = tg.forward_graph(&["logits"]).unwrap();
    let mut ours = GraphSession::new(&rt, &fwd, &SessionOptions::default(), "forward").unwrap();
    let mut feeds: Vec<(&str, &Tensor)> = params.iter().map(|(k, v)| (k.as_str(), v)).collect();
    feeds.push(("tokens", &batch["tokens"]));
    let ours = ours.run(&feeds).unwrap().remove(0);

    // The exported file, loaded by ONNX Runtime as any user would.
    let trained: Vec<(&str, &Tensor)> = params.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let exported = export_inference_model(&peer.model, &trained).unwrap();
    let path = tmp("tiny_gpt_trained.onnx");
    save_model(&exported, &path).unwrap();
    let reloaded = load_model(&path).unwrap();
    let g = reloaded.graph.as_ref().unwrap();
    assert!(
        g.node
            .iter()
            .all(|n| !n.op_type.contains("Grad") && n.op_type != "SoftmaxCrossEntropyLoss"),
        "no training nodes"
    );
    assert_eq!(g.output.len(), 1);
    let mut theirs =
        GraphSession::from_model(&rt, &reloaded, &SessionOptions::default(), "exported").unwrap();
    let theirs = theirs
        .run(&[("tokens", &batch["tokens"])])
        .unwrap()
        .remove(0);
    assert_eq!(ours.shape, theirs.shape);
    let max_diff = ours
        .to_f64_vec()
        .iter()
        .zip(theirs.to_f64_vec())
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_diff <= 1e-6, "exported logits differ by {max_diff:e}");
    // ...and the trained weights differ from the initial ones (the export is not a no-op).
    assert_ne!(params["head.weight"], peer.init["head.weight"]);
}

#[test]
fn external_data_is_read_and_bad_offsets_are_named() {
    let model = load_model(&mlp_path()).unwrap();
    // Move fc1.weight's bytes into a side file, as large models store them.
    let mut ext = model.clone();
    let t = ext
        .graph
        .as_mut()
        .unwrap()
        .initializer
        .iter_mut()
        .find(|t| t.name == "fc1.weight")
        .unwrap();
    let bytes = std::mem::take(&mut t.raw_data);
    let data_path = tmp("mlp_external.bin");
    let mut file = vec![0u8; 16];
    file.extend(&bytes);
    std::fs::write(&data_path, &file).unwrap();
    let entry = |k: &str, v: String| StringStringEntryProto {
        key: k.into(),
        value: v,
    };
    t.data_location = DataLocation::External as i32;
    t.external_data = vec![
        entry("location", "mlp_external.bin".into()),
        entry("offset", "16".into()),
        entry("length", bytes.len().to_string()),
    ];
    let path = tmp("mlp_external.onnx");
    save_model(&ext, &path).unwrap();
    assert_eq!(
        load_model(&path).unwrap(),
        model,
        "external data resolved into the model"
    );

    let t = ext
        .graph
        .as_mut()
        .unwrap()
        .initializer
        .iter_mut()
        .find(|t| t.name == "fc1.weight")
        .unwrap();
    t.external_data[1].value = "64".into();
    let bad = tmp("mlp_external_bad.onnx");
    save_model(&ext, &bad).unwrap();
    let err = load_model(&bad).unwrap_err();
    assert!(
        matches!(err, Error::ExternalData { ref tensor, .. } if tensor == "fc1.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("past its end"), "{err}");
}

/// The peers' MLP with every weight moved into one external data file: the first at an
/// offset no element type is aligned to (read out as a copy), the others at multiples of
/// 8 (memory-mapped and read in place), as large exports store their weights.
fn all_external(dir: &std::path::Path) -> PathBuf {
    let mut model = load_model(&mlp_path()).unwrap();
    let mut file = vec![0u8; 3];
    for t in &mut model.graph.as_mut().unwrap().initializer {
        let bytes = std::mem::take(&mut t.raw_data);
        if file.len() > 3 {
            file.resize(file.len().next_multiple_of(8), 0);
        }
        t.data_location = DataLocation::External as i32;
        t.external_data = [
            ("location", "weights.bin".to_string()),
            ("offset", file.len().to_string()),
            ("length", bytes.len().to_string()),
        ]
        .into_iter()
        .map(|(k, value)| StringStringEntryProto {
            key: k.into(),
            value,
        })
        .collect();
        file.extend(&bytes[..]);
    }
    std::fs::write(dir.join("weights.bin"), &file).unwrap();
    let path = dir.join("mlp.onnx");
    save_model(&model, &path).unwrap();
    path
}

/// Weights in an external data file (mapped, each stage copying out its own) train as
/// the same weights inline, bit for bit: two stages, two micro-batches a step (the
/// second added into the accumulators as it is made).
#[test]
fn a_model_with_external_weights_trains_as_the_same_model_inline() {
    let dir = tempfile::tempdir().unwrap();
    let external = all_external(dir.path());
    let data = common::peers_dir().join("data/mlp_data.npz");
    let run = |model: &std::path::Path, name: &str| {
        let cfg = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "model_path = {model:?}\nbatch_size = 32\ngradient_accumulation_steps = 2\n\
                 num_train_steps = 8\npipeline_parallel_size = 2\n\
                 [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
                 [data]\npath = {data:?}\nlayout = {{ kind = \"arrays\", feeds = {{ x = \"x\", y = \"y\" }} }}\n\
                 [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.01\n"
            ),
        )
        .unwrap();
        common::train_losses(&cfg, &dir.path().join(format!("{name}.jsonl")))
    };
    let inline = run(&mlp_path(), "inline");
    assert_eq!(inline.len(), 4);
    assert_eq!(run(&external, "external"), inline);
}

#[test]
fn truncated_and_foreign_files_are_not_onnx() {
    let bytes = std::fs::read(mlp_path()).unwrap();
    let cut = tmp("mlp_truncated.onnx");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model(&cut).unwrap_err();
    assert!(
        matches!(err, Error::NotOnnx { ref path, .. } if path == &cut),
        "{err}"
    );
    assert!(err.to_string().contains("mlp_truncated.onnx"), "{err}");

    for foreign in [
        common::peers_dir().join("data/mlp_data.npz"),
        common::peers_dir().join("README.md"),
    ] {
        let err = load_model(&foreign).unwrap_err();
        assert!(
            matches!(err, Error::NotOnnx { .. }),
            "{}: {err}",
            foreign.display()
        );
    }
    let missing = tmp("does_not_exist.onnx");
    assert!(matches!(
        load_model(&missing).unwrap_err(),
        Error::Io { .. }
    ));
}

fn tiny_model(op: &str, opset: i64) -> ModelProto {
    let w = Tensor::f32(vec![2, 2], vec![0.1, -0.2, 0.3, 0.4]).unwrap();
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: opset,
        }],
        graph: Some(GraphProto {
            name: "tiny".into(),
            node: vec![
                make_node("MatMul", "mm", &["x", "W"], &["h"], vec![]),
                make_node(op, "the_node", &["h"], &["y"], vec![]),
            ],
            initializer: vec![w.to_proto("W")],
            input: vec![pipetrain::graph::value_info(
                "x",
                &pipetrain::graph::ValueMeta {
                    dtype: pipetrain::tensor::DType::F32,
                    shape: vec![3, 2],
                },
            )],
            output: vec![pipetrain::graph::untyped_value_info("y")],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn mse(prediction: &str, label: &str) -> TrainOptions {
    TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::Mse {
            prediction: prediction.into(),
            label: label.into(),
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

#[test]
fn bad_models_and_names_get_typed_errors() {
    let rt = common::runtime();
    let x = Tensor::f32(vec![3, 2], vec![1.0; 6]).unwrap();
    let y = Tensor::f32(vec![3, 2], vec![0.5; 6]).unwrap();
    let example = [("x", &x), ("target", &y)];

    // An op with no gradient rule on the path from W to the loss (`MaxRoiPool`).
    let mut one = tiny_model("Tanh", 17);
    let g = one.graph.as_mut().unwrap();
    g.node.pop();
    let (nodes, init) = common::no_rule_nodes("the_node", "h", "y");
    g.node.extend(nodes);
    g.initializer.extend(init);
    let err = build_training_graph(&rt, &one, &mse("y", "target"), &example).unwrap_err();
    assert!(
        matches!(&err, Error::NoGradient { node, op_type, param, .. } if node == "the_node" && op_type == "MaxRoiPool" && param == "W"),
        "{err}"
    );
    // Two such ops: both named in the one error, nearest the loss first.
    let mut two = one.clone();
    let g = two.graph.as_mut().unwrap();
    g.node.last_mut().unwrap().output[0] = "a".into();
    let (nodes, init) = common::no_rule_nodes("second_node", "a", "y");
    g.node.extend(nodes);
    g.initializer.extend(init);
    let err = build_training_graph(&rt, &two, &mse("y", "target"), &example).unwrap_err();
    assert!(
        matches!(&err, Error::NoGradient { node, also, .. }
            if node == "second_node" && also.contains("`the_node` (MaxRoiPool)")),
        "{err}"
    );
    // The same model trains with an op that has one (and MSE works end to end).
    build_training_graph(&rt, &tiny_model("Tanh", 17), &mse("y", "target"), &example).unwrap();

    let err = build_training_graph(
        &rt,
        &tiny_model("Tanh", 17),
        &mse("logits", "target"),
        &example,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::MissingValue { role: "prediction", name, .. } if name == "logits"),
        "{err}"
    );
    assert!(
        err.to_string().contains("graph outputs are [\"y\"]"),
        "{err}"
    );

    let err = build_training_graph(&rt, &tiny_model("Tanh", 17), &mse("y", "labels"), &example)
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingValue { role: "label", name, .. } if name == "labels"),
        "{err}"
    );

    let err = build_training_graph(&rt, &tiny_model("Tanh", 11), &mse("y", "target"), &example)
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnsupportedOpset { version: 11, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("opsets 13 to 21"), "{err}");

    let err = build_training_graph(
        &rt,
        &tiny_model("Tanh", 17),
        &mse("y", "target"),
        &[("target", &y)],
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::UnfedInputs { first, inputs } if first == "x" && inputs.starts_with("`x` (F32, rank 2")),
        "{err}"
    );

    let wrong = Tensor::f32(vec![4], vec![0.0; 4]).unwrap();
    let err = build_training_graph(
        &rt,
        &tiny_model("Tanh", 17),
        &mse("y", "target"),
        &[("x", &x), ("target", &wrong)],
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { name, .. } if name == "target"),
        "{err}"
    );

    let opts = TrainOptions {
        inputs: Default::default(),
        trainable: Some(vec!["V".into()]),
        ..mse("y", "target")
    };
    let err = build_training_graph(&rt, &tiny_model("Tanh", 17), &opts, &example).unwrap_err();
    assert!(
        matches!(&err, Error::MissingValue { role: "trainable parameter", name, .. } if name == "V"),
        "{err}"
    );
}

#[test]
fn dropout_gradient_uses_the_forward_mask() {
    // Dropout is random, so finite differences cannot check it; instead the gradient must
    // be exactly dY * mask / (1 - ratio) for the mask the same run drew.
    let rt = common::runtime();
    let ratio = Tensor::f32(vec![], vec![0.25]).unwrap();
    let training = Tensor::new(vec![], pipetrain::tensor::TensorData::Bool(vec![true])).unwrap();
    let w = Tensor::f32(
        vec![64, 8],
        (0..512).map(|i| (i as f32 * 0.37).sin()).collect(),
    )
    .unwrap();
    let model = common::opset17_model(
        "dropout",
        vec![
            make_node(
                "Dropout",
                "drop",
                &["W", "ratio", "training"],
                &["y", "mask"],
                vec![],
            ),
            make_node(
                "ReduceSum",
                "sum",
                &["y"],
                &["total"],
                vec![pipetrain::graph::int_attr("keepdims", 0)],
            ),
        ],
        vec![
            w.to_proto("W"),
            ratio.to_proto("ratio"),
            training.to_proto("training"),
        ],
        vec![],
        vec![pipetrain::graph::untyped_value_info("total")],
    );
    let opts = TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::Output {
            name: "total".into(),
        },
        trainable: Some(vec!["W".into()]),
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    };
    let mut tg = build_training_graph(&rt, &model, &opts, &[]).unwrap();
    tg.graph
        .outputs
        .push(pipetrain::graph::untyped_value_info("mask"));
    let mut session =
        GraphSession::new(&rt, &tg.graph, &SessionOptions::default(), "dropout").unwrap();
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let out = session.run(&[("W", &w), ("loss_grad", &seed)]).unwrap();
    let names = session.output_names().to_vec();
    let get = |n: &str| &out[names.iter().position(|x| x == n).unwrap()];
    let (grad, mask) = (get("W_grad").to_f64_vec(), get("mask").to_f64_vec());
    gradient_is_the_masked_seed(&grad, &mask);
    // The same with the dropout keyed (`graph::keyed_dropout`): the gradient reads the
    // keyed mask, which a key draws again and another key draws anew.
    assert_eq!(pipetrain::graph::key_dropouts(&mut tg), 1);
    let mut session =
        GraphSession::new(&rt, &tg.graph, &SessionOptions::default(), "keyed").unwrap();
    let names = session.output_names().to_vec();
    let mut keyed = |key: Vec<i64>| {
        let key = Tensor::i64(vec![4], key).unwrap();
        let feeds = [
            ("W", &w),
            ("loss_grad", &seed),
            (pipetrain::graph::DROPOUT_KEY, &key),
        ];
        let out = session.run(&feeds).unwrap();
        let get = |n: &str| out[names.iter().position(|x| x == n).unwrap()].to_f64_vec();
        (get("W_grad"), get("mask"))
    };
    let (grad, mask) = keyed(vec![0, 3, 0, 1]);
    gradient_is_the_masked_seed(&grad, &mask);
    assert_eq!(keyed(vec![0, 3, 0, 1]).1, mask, "one key, one mask");
    assert_ne!(
        keyed(vec![0, 3, 0, 2]).1,
        mask,
        "another micro-batch, another mask"
    );
}

/// About 3/4 of 512 values kept by `mask` (ratio 0.25), and `grad` = dY * mask / (1 -
/// ratio) with dY = 1.
fn gradient_is_the_masked_seed(grad: &[f64], mask: &[f64]) {
    let kept = mask.iter().filter(|&&m| m != 0.0).count();
    assert!(
        kept > 300 && kept < 470,
        "about 3/4 of 512 kept, got {kept}"
    );
    for (g, m) in grad.iter().zip(mask) {
        assert_eq!(*g, (m / 0.75) as f32 as f64, "dX = dY * mask / (1 - ratio)");
    }
}

/// Graph building runs nothing itself: the caller measures shapes (`ShapeProbe`). Shapes
/// recorded from one ONNX Runtime probe and replayed by a probe with no runtime give the
/// same training graph.
#[test]
fn training_graphs_are_built_from_measured_shapes_alone() {
    use pipetrain::graph::{Graph, Metas, ShapeProbe};
    use std::cell::RefCell;

    struct Recording<'a> {
        rt: &'a pipetrain::compute::Runtime,
        seen: RefCell<Vec<Metas>>,
    }
    impl ShapeProbe for Recording<'_> {
        fn probe(&self, g: &Graph, feeds: &[(&str, &Tensor)]) -> pipetrain::Result<Metas> {
            let m = self.rt.probe(g, feeds)?;
            self.seen.borrow_mut().push(m.clone());
            Ok(m)
        }
    }
    struct Replay(RefCell<Vec<Metas>>);
    impl ShapeProbe for Replay {
        fn probe(&self, _: &Graph, _: &[(&str, &Tensor)]) -> pipetrain::Result<Metas> {
            Ok(self.0.borrow_mut().remove(0))
        }
    }

    let rt = common::runtime();
    let x = Tensor::f32(vec![3, 2], vec![0.5, -1.0, 2.0, 0.25, -0.5, 1.5]).unwrap();
    let y = Tensor::f32(vec![3, 2], vec![0.0; 6]).unwrap();
    let example = [("x", &x), ("y_true", &y)];
    let recording = Recording {
        rt: &rt,
        seen: RefCell::new(Vec::new()),
    };
    let opts = mse("y", "y_true");
    let measured =
        build_training_graph(&recording, &tiny_model("Tanh", 17), &opts, &example).unwrap();
    let replay = Replay(RefCell::new(recording.seen.into_inner()));
    let pure = build_training_graph(&replay, &tiny_model("Tanh", 17), &opts, &example).unwrap();
    assert!(pure.graph.to_model() == measured.graph.to_model());
    assert_eq!(pure.params.len(), 1);
    assert_eq!(pure.metas, measured.metas);
}
