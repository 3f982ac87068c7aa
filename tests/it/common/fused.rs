//! Helpers for the fused kernels' tests: a training graph's gradients with and without
//! fused kernels, its fused nodes, and the comparison of two sets of gradients.

use pipetrain::compute::{SessionOptions, TensorMap, TrainSession};
use pipetrain::graph::custom_ops::DOMAIN;
use pipetrain::graph::{build_training_graph, LossSpec, TrainOptions, TrainingGraph};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::Tensor;

/// The training graph and the gradients of `wrt`, with or without fused kernels.
pub fn gradients(model: &ModelProto, fused: bool, wrt: &[&str]) -> (TrainingGraph, TensorMap) {
    let loss = LossSpec::Output {
        name: "total".into(),
    };
    gradients_with(model, loss, &[], fused, wrt)
}

/// The training graph and the gradients of `wrt` (with the loss, named `loss`) for
/// `loss` and data `feeds`, with or without fused kernels.
pub fn gradients_with(
    model: &ModelProto,
    loss: LossSpec,
    feeds: &[(&str, &Tensor)],
    fused: bool,
    wrt: &[&str],
) -> (TrainingGraph, TensorMap) {
    gradients_of(model, loss, feeds, (fused, false), wrt)
}

/// [`gradients`] with fused kernels and `flash_attention` (attention keeps its rows'
/// log-sum-exps, not its probabilities).
pub fn gradients_flash(model: &ModelProto, wrt: &[&str]) -> (TrainingGraph, TensorMap) {
    let loss = LossSpec::Output {
        name: "total".into(),
    };
    gradients_of(model, loss, &[], (true, true), wrt)
}

fn gradients_of(
    model: &ModelProto,
    loss: LossSpec,
    feeds: &[(&str, &Tensor)],
    (fused, flash): (bool, bool),
    wrt: &[&str],
) -> (TrainingGraph, TensorMap) {
    let rt = super::runtime();
    let opts = TrainOptions {
        inputs: Default::default(),
        loss,
        trainable: Some(wrt.iter().map(|s| s.to_string()).collect()),
        contrib_ops: true,
        fused_kernels: fused,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: flash,
        params: Default::default(),
    };
    let tg = build_training_graph(&rt, model, &opts, feeds).unwrap();
    let session_opts = SessionOptions {
        intra_threads: 2,
        ..SessionOptions::default()
    };
    let mut s = TrainSession::new(&rt, &tg, &session_opts).unwrap();
    let params = super::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let data: TensorMap = feeds
        .iter()
        .map(|(n, t)| (n.to_string(), (*t).clone()))
        .collect();
    let out = s.step(&params, &data, &seed).unwrap();
    let mut grads = out.grads;
    grads.insert("loss".into(), Tensor::f64(vec![], vec![out.loss]).unwrap());
    (tg, grads)
}

pub fn fused_nodes(tg: &TrainingGraph, op: &str) -> usize {
    let g = &tg.graph;
    g.nodes
        .iter()
        .filter(|n| n.domain == DOMAIN && n.op_type == op)
        .count()
}

/// Every gradient of `wrt` within `tol` (relative to the largest) of the other's.
pub fn assert_same(what: &str, a: &TensorMap, b: &TensorMap, wrt: &[&str], tol: f64) {
    for name in wrt {
        let (x, y) = (a[*name].to_f64_vec(), b[*name].to_f64_vec());
        let scale = y.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        let worst = x
            .iter()
            .zip(&y)
            .fold(0f64, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            worst <= tol * scale,
            "{what}: d{name} {worst:e} of {scale:e}"
        );
    }
}
