//! Evaluation rounds: every `evaluation_period` steps the pipeline runs the evaluation set
//! forward only, and the mean loss equals the loss of that set computed independently
//! (the whole training graph in one session, same weights); the accuracy equals the
//! share of rows whose arg-max logit is the label, counted here from the inference
//! model's logits.

use crate::common;

use std::path::Path;

use pipetrain::compute::{SessionOptions, TensorMap, TrainSession};
use pipetrain::config::TrainConfig;
use pipetrain::tensor::Tensor;

#[test]
fn evaluation_after_every_period_matches_the_whole_graph_loss() {
    let rt = common::runtime();
    // A learning rate so small that the weights stay at their initial values to ~1e-9.
    let text = r#"
model_path = "../peers/data/mlp.onnx"
init_path = "../peers/data/mlp_init.safetensors"
batch_size = 16
gradient_accumulation_steps = 4
num_train_steps = 40
pipeline_parallel_size = 2
evaluation_period = 5
eval_micro_batches = 4
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
path = "../peers/data/mlp_data.npz"
batch_order = "batch_idx"
layout = { kind = "arrays", feeds = { x = "x", y = "y" } }
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 1e-9
"#;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/evaluation.toml");
    let cfg = TrainConfig::parse(text, &path).unwrap();
    let mut evals = Vec::new();
    pipetrain::train::train(&rt, &cfg, &path, false, |r| {
        evals.push((r.step, r.eval_loss))
    })
    .unwrap();
    let at: Vec<u64> = evals
        .iter()
        .filter(|(_, e)| e.is_some())
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(at, vec![4, 9], "after steps 5 and 10");

    // The evaluation set: the data file's first 4 x 16 rows, in the whole training graph.
    let peer = common::PeerModel::load("mlp");
    let data = pipetrain::data::read_npz(&common::peers_dir().join("data/mlp_data.npz")).unwrap();
    let rows: Vec<usize> = (0..64).collect();
    let batch: TensorMap = ["x", "y"]
        .iter()
        .map(|n| (n.to_string(), data[*n].gather_rows(&rows).unwrap()))
        .collect();
    let tg = peer.training_graph(&rt);
    let params = common::initial_params(&tg);
    let reference = TrainSession::new(&rt, &tg, &SessionOptions::default())
        .unwrap()
        .step(&params, &batch, &Tensor::f32(vec![], vec![1.0]).unwrap())
        .unwrap()
        .loss;
    for (step, e) in evals.iter().filter_map(|(s, e)| e.map(|e| (s, e))) {
        assert!(
            (e - reference).abs() < 1e-5,
            "step {step}: eval loss {e} vs {reference}"
        );
    }
}

/// The accuracy of the evaluation rounds, against arg-max counted from the logits of the
/// same weights in the forward model alone; with `ignore_index`, over the positions
/// with another label only.
#[test]
fn evaluation_reports_accuracy_of_the_arg_max() {
    let rt = common::runtime();
    let peer = common::PeerModel::load("mlp");
    let data = pipetrain::data::read_npz(&common::peers_dir().join("data/mlp_data.npz")).unwrap();
    let rows: Vec<usize> = (0..64).collect();
    let x = data["x"].gather_rows(&rows).unwrap();
    let y = data["y"].gather_rows(&rows).unwrap().to_i64_vec().unwrap();
    let mut session = pipetrain::compute::GraphSession::from_model(
        &rt,
        &peer.model_with_init(),
        &SessionOptions::default(),
        "mlp",
    )
    .unwrap();
    let logits = session.run(&[("x", &x)]).unwrap().remove(0);
    let v = logits.as_f32().unwrap();
    let classes = logits.shape[1];
    let hit = |r: usize| {
        let row = &v[r * classes..(r + 1) * classes];
        let best = (0..classes).fold(0, |b, c| if row[c] > row[b] { c } else { b });
        best as i64 == y[r]
    };
    let all = (0..64).filter(|&r| hit(r)).count() as f64 / 64.0;
    for ignore in [None, Some(y[0])] {
        let kept: Vec<usize> = (0..64).filter(|&r| Some(y[r]) != ignore).collect();
        let hits = kept.iter().filter(|&&r| hit(r)).count();
        let want = hits as f64 / kept.len() as f64;
        // Leaving the label out must change the answer, or this checks nothing.
        assert_eq!(want == all, ignore.is_none(), "{want} vs {all}");
        let accuracy = trained_accuracy(&rt, ignore);
        assert_eq!(accuracy, want, "{accuracy} vs {hits}/{}", kept.len());
    }
}

/// The evaluation accuracy of the peers' MLP after 4 steps at a learning rate of 1e-9,
/// labels `ignore` left out.
fn trained_accuracy(rt: &pipetrain::compute::Runtime, ignore: Option<i64>) -> f64 {
    let ignore = ignore.map_or(String::new(), |i| format!("ignore_index = {i}"));
    let text = format!(
        r#"
model_path = "../peers/data/mlp.onnx"
init_path = "../peers/data/mlp_init.safetensors"
batch_size = 16
gradient_accumulation_steps = 4
num_train_steps = 4
pipeline_parallel_size = 2
evaluation_period = 1
eval_micro_batches = 4
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
{ignore}
[data]
path = "../peers/data/mlp_data.npz"
batch_order = "batch_idx"
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 1e-9
"#
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/evaluation.toml");
    let cfg = TrainConfig::parse(&text, &path).unwrap();
    let mut accuracy = None;
    pipetrain::train::train(rt, &cfg, &path, false, |r| accuracy = r.eval_accuracy).unwrap();
    accuracy.expect("an accuracy after every step")
}
