//! Model inputs the data does not feed, and `pipetrain check` as a gate: a scalar the
//! TorchScript exporter adds for a `forward` argument left at its default (Hugging
//! Face's `num_logits_to_keep`, read as `x[-n:]`) trains as its default, 0, exactly as
//! the model without it; another scalar takes its value from `[inputs]`, exactly as the
//! model with that constant; without one, `check` and `train` name it. `check` fails
//! (exit status 1) on each error it finds and passes on warnings.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pipetrain::config::TrainConfig;
use pipetrain::graph::{make_node, tensor_attr, untyped_value_info, value_info, ValueMeta};
use pipetrain::onnx::proto::{ModelProto, NodeProto};
use pipetrain::onnx::save_model;
use pipetrain::tensor::{DType, Tensor};
use pipetrain::Error;

use crate::common;

const BATCH: usize = 4;
const SEQ: usize = 5;

fn constant(name: &str, t: Tensor) -> NodeProto {
    make_node(
        "Constant",
        name,
        &[],
        &[name],
        vec![tensor_attr("value", t.to_proto(name))],
    )
}

/// `logits = (x -> the nodes `extra` make of it, ending in `h`) @ W`, classes last:
/// x [4, 5, 3] f32, W [3, 2], with `scalars` as more rank-0 inputs.
fn model(extra: Vec<NodeProto>, scalars: &[(&str, DType)]) -> ModelProto {
    let w = Tensor::f32(vec![3, 2], vec![0.3, -0.2, 0.1, 0.5, -0.4, 0.2]).unwrap();
    let mut nodes = extra;
    nodes.push(make_node(
        "MatMul",
        "head",
        &["h", "W"],
        &["logits"],
        vec![],
    ));
    let meta = |dtype, shape| ValueMeta { dtype, shape };
    let mut inputs = vec![value_info("x", &meta(DType::F32, vec![BATCH, SEQ, 3]))];
    inputs.extend(
        scalars
            .iter()
            .map(|(n, d)| value_info(n, &meta(*d, vec![]))),
    );
    let mut m = common::opset17_model("unfed", nodes, vec![w.to_proto("W")], inputs, vec![]);
    m.graph.as_mut().unwrap().output = vec![untyped_value_info("logits")];
    m
}

/// `h = x[:, -n:]`, as the TorchScript exporter writes `hidden[:, -num_logits_to_keep:, :]`.
fn logits_to_keep() -> ModelProto {
    let nodes = vec![
        constant("zero_axis", Tensor::i64(vec![1], vec![0]).unwrap()),
        constant("ends", Tensor::i64(vec![1], vec![i64::MAX]).unwrap()),
        constant("axes", Tensor::i64(vec![1], vec![1]).unwrap()),
        make_node("Neg", "Neg_2", &["onnx::Neg_1"], &["minus_n"], vec![]),
        make_node(
            "Unsqueeze",
            "Unsqueeze_3",
            &["minus_n", "zero_axis"],
            &["starts"],
            vec![],
        ),
        make_node(
            "Slice",
            "Slice_4",
            &["x", "starts", "ends", "axes"],
            &["h"],
            vec![],
        ),
    ];
    model(nodes, &[("onnx::Neg_1", DType::I64)])
}

/// `h = x * scale` with `scale` a rank-0 float input, or (`Some(v)`) the constant `v`.
fn scaled(value: Option<f32>) -> ModelProto {
    let mut nodes = vec![make_node("Mul", "scale_x", &["x", "scale"], &["h"], vec![])];
    match value {
        Some(v) => {
            nodes.insert(0, constant("scale", Tensor::f32(vec![], vec![v]).unwrap()));
            model(nodes, &[])
        }
        None => model(nodes, &[("scale", DType::F32)]),
    }
}

/// `h = x`.
fn plain() -> ModelProto {
    model(
        vec![make_node("Identity", "same", &["x"], &["h"], vec![])],
        &[],
    )
}

/// The model in `dir` with 3 steps of data and a configuration (`extra` appended).
fn setup(dir: &Path, name: &str, m: &ModelProto, extra: &str) -> PathBuf {
    let model = dir.join(format!("{name}.onnx"));
    save_model(m, &model).unwrap();
    let rows = BATCH * 3;
    let x: Vec<f32> = (0..rows * SEQ * 3)
        .map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let y: Vec<i64> = (0..rows * SEQ).map(|i| (i % 3 == 0) as i64).collect();
    let data = dir.join("data.npz");
    let x = Tensor::f32(vec![rows, SEQ, 3], x).unwrap();
    let y = Tensor::i64(vec![rows, SEQ], y).unwrap();
    pipetrain::data::write_npz(&data, &[("x", &x), ("labels", &y)]).unwrap();
    let text = format!(
        r#"model_path = "{name}.onnx"
batch_size = {BATCH}
num_train_steps = 3
display_loss_steps = 1
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "labels"
[data]
path = "data.npz"
layout = {{ kind = "arrays", feeds = {{ x = "x", labels = "labels" }} }}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.5
{extra}
"#
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn losses(config: &Path) -> pipetrain::Result<Vec<f64>> {
    let cfg = TrainConfig::load(config)?;
    let mut out = Vec::new();
    pipetrain::train::train(&common::runtime(), &cfg, config, false, |r| {
        out.push(r.loss)
    })?;
    Ok(out)
}

fn check(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("check")
        .args(args)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_count_kept_from_the_end_trains_as_its_default_keeping_everything() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = setup(dir.path(), "keep", &logits_to_keep(), "");
    let out = check(&[&dir.path().join("keep.onnx"), &cfg]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains(
            "note: model input `onnx::Neg_1` (I64, rank 0, read by Neg -> Unsqueeze -> Slice"
        ) && text.contains("is taken as 0: it is read as `x[-n:]`"),
        "{text}"
    );
    assert!(text.contains("ok: the training graph builds"), "{text}");
    let reference = setup(dir.path(), "plain", &plain(), "");
    assert_eq!(losses(&cfg).unwrap(), losses(&reference).unwrap());
}

#[test]
fn a_scalar_takes_its_value_from_inputs_and_without_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("scaled.onnx");
    // No value: `check` fails naming it, alone and with the configuration, and so does
    // training.
    let bare = setup(dir.path(), "scaled", &scaled(None), "");
    for args in [vec![model.as_path()], vec![model.as_path(), bare.as_path()]] {
        let out = check(&args);
        let text = stdout(&out);
        assert_eq!(out.status.code(), Some(1), "{text}");
        assert!(
            text.contains("error: model input `scale` (F32, rank 0, read by Mul -> MatMul)"),
            "{text}"
        );
    }
    let err = losses(&bare).unwrap_err();
    assert!(
        matches!(&err, Error::UnfedInputs { first, .. } if first == "scale"),
        "{err}"
    );
    assert!(err.to_string().contains("[inputs]"), "{err}");
    // A value: the same run as the model with that constant, bit for bit.
    let set = setup(dir.path(), "scaled", &scaled(None), "[inputs]\nscale = 0.5");
    let out = check(&[&model, &set]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).contains("note: model input `scale` is set by [inputs] to 0.5"));
    let ours = losses(&set).unwrap();
    let reference = setup(dir.path(), "constant", &scaled(Some(0.5)), "");
    assert_eq!(ours, losses(&reference).unwrap());
    // A value that does not fit the input is refused, naming it.
    let list = setup(
        dir.path(),
        "scaled",
        &scaled(None),
        "[inputs]\nscale = [1, 2]",
    );
    let err = losses(&list).unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { name, reason } if name == "scale" && reason.contains("rank 0")),
        "{err}"
    );
}

#[test]
fn check_fails_on_each_error_and_passes_on_warnings() {
    let dir = tempfile::tempdir().unwrap();
    // An operator without a gradient rule on a parameter's way to the output.
    let mut no_rule_model = plain();
    let g = no_rule_model.graph.as_mut().unwrap();
    g.node.last_mut().unwrap().output = vec!["pre".into()];
    let (nodes, init) = common::no_rule_nodes("no_rule", "pre", "logits");
    g.node.extend(nodes);
    g.initializer.extend(init);
    let path = dir.path().join("no_rule_model.onnx");
    save_model(&no_rule_model, &path).unwrap();
    let out = check(&[&path]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).contains("error: 1 nodes on the way from a parameter to an output have no gradient rule: `no_rule` (MaxRoiPool)"));
    // A training graph that does not build: the loss reads a value the model lacks.
    let cfg = setup(dir.path(), "plain", &plain(), "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("prediction = \"logits\"", "prediction = \"scores\"");
    std::fs::write(&cfg, text).unwrap();
    let out = check(&[&dir.path().join("plain.onnx"), &cfg]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("error: the training graph for"),
        "{}",
        stdout(&out)
    );
    // Warnings alone (the model's fixed batch): 0.
    let out = check(&[&dir.path().join("plain.onnx")]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).contains("warning: input `x` has a fixed batch of 4"));
    assert!(!stdout(&out).contains("error"));
}
