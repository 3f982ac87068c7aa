//! 200 SGD steps (lr 0.05) of the peers' models from their initial weights, data and batch
//! order: every step's loss within 1e-5 of PyTorch's float64 run (`torch_f64`).

use crate::common;

use crate::common::{reference_curve, sgd, PeerModel};
use pipetrain::compute::{SessionOptions, TrainSession};
use pipetrain::tensor::Tensor;

fn sgd_curve(name: &'static str) -> Vec<f64> {
    let rt = common::runtime();
    let peer = PeerModel::load(name);
    let tg = peer.training_graph(&rt);
    let mut session = TrainSession::new(&rt, &tg, &SessionOptions::default()).unwrap();
    let mut params = common::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    (0..200)
        .map(|step| {
            let out = session.step(&params, &peer.batch(step), &seed).unwrap();
            sgd(&mut params, &out.grads, 0.05);
            out.loss
        })
        .collect()
}

fn assert_close(name: &str, ours: &[f64], reference: &[f64], tol: f64) {
    assert_eq!(ours.len(), reference.len());
    let (worst, at) = ours
        .iter()
        .zip(reference)
        .enumerate()
        .map(|(i, (a, b))| ((a - b).abs(), i))
        .fold((0.0, 0), |m, x| if x.0 > m.0 { x } else { m });
    eprintln!("{name}: max abs diff vs torch_f64 {worst:.3e} at step {at}");
    assert!(
        worst <= tol,
        "{name}: max |loss - torch_f64| = {worst:.3e} at step {at} (ours {}, torch {})",
        ours[at],
        reference[at]
    );
}

#[test]
fn mlp_sgd_matches_torch_f64() {
    let ours = sgd_curve("mlp");
    assert_close(
        "mlp",
        &ours,
        &reference_curve("mlp", "sgd", "torch_f64"),
        1e-5,
    );
}

#[test]
fn tiny_gpt_sgd_matches_torch_f64() {
    let ours = sgd_curve("tiny_gpt");
    assert_close(
        "tiny_gpt",
        &ours,
        &reference_curve("tiny_gpt", "sgd", "torch_f64"),
        1e-5,
    );
}
