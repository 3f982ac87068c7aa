//! Data and pipeline parallelism change nothing but float32 summation order: with the
//! same global batch (64 samples, micro-batches of 8), 20 SGD steps give the weights of
//! the single-stage run.
//!
//! - Pipeline stages (dp = 1) sum each parameter's micro-batch gradients in the same order
//!   (micro-batch 0..7) with the same kernels, one thread each: bit-identical.
//! - Two replicas sum 4 micro-batches each and then add the two sums, where one replica
//!   adds 8 in a row: float32 rounds differently (~1e-7 relative per step), so there the
//!   weights agree to 1e-5 of each tensor's largest magnitude after 20 steps.

use std::path::Path;

use pipetrain::compute::Runtime;
use pipetrain::config::TrainConfig;
use pipetrain::tensor::Tensor;

fn config(dp: usize, pp: usize, accum: usize) -> TrainConfig {
    config_with(dp, pp, accum, "1f1b")
}

fn config_with(dp: usize, pp: usize, accum: usize, schedule: &str) -> TrainConfig {
    let batch = 64 / (dp * accum);
    let text = format!(
        r#"
model_path = "../peers/data/mlp.onnx"
init_path = "../peers/data/mlp_init.safetensors"
batch_size = {batch}
gradient_accumulation_steps = {accum}
num_train_steps = {steps}
data_parallel_size = {dp}
pipeline_parallel_size = {pp}
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
path = "../peers/data/mlp_data.npz"
batch_order = "batch_idx"
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.05
[pipeline]
schedule = "{schedule}"
[runtime]
intra_op_threads = 1
"#,
        steps = 20 * accum
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/equivalence.toml");
    TrainConfig::parse(&text, &path).unwrap()
}

fn trained(rt: &Runtime, dp: usize, pp: usize, accum: usize) -> (Vec<(String, Tensor)>, f64) {
    let cfg = config(dp, pp, accum);
    let s =
        pipetrain::train::train(rt, &cfg, Path::new("equivalence.toml"), false, |_| {}).unwrap();
    assert_eq!(s.steps, 20);
    assert_eq!(s.stages, pp);
    let mut p = s.parameters;
    p.sort_by(|a, b| a.0.cmp(&b.0));
    (p, s.final_loss)
}

/// Largest |a - b| over a tensor, relative to the tensor's largest |a|.
fn max_rel_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            let (x, y) = (ta.to_f64_vec(), tb.to_f64_vec());
            let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            x.iter()
                .zip(&y)
                .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()))
                / scale
        })
        .fold(0.0, f64::max)
}

#[test]
fn parallel_layouts_train_the_same_weights() {
    let rt = Runtime::from_env().unwrap();
    let (reference, ref_loss) = trained(&rt, 1, 1, 8);
    for (dp, pp, accum) in [(1, 2, 8), (1, 4, 8), (2, 1, 4), (2, 2, 4)] {
        let (weights, loss) = trained(&rt, dp, pp, accum);
        let diff = max_rel_diff(&reference, &weights);
        eprintln!("dp={dp} pp={pp} accum={accum}: max relative weight difference {diff:.3e}, loss {loss} vs {ref_loss}");
        if dp == 1 {
            assert_eq!(
                diff, 0.0,
                "dp={dp} pp={pp} accum={accum}: not bit-identical"
            );
            assert_eq!(loss, ref_loss);
        } else {
            assert!(diff <= 1e-5, "dp={dp} pp={pp} accum={accum}: {diff:.3e}");
        }
    }
}

/// ZB-V folds two stages onto each rank (rank r holds stages r and 2p - 1 - r) and splits
/// the backward: at pp = 2 (four stages), the same weights and loss as the single stage,
/// bit for bit, as every other dp = 1 layout.
#[test]
fn zb_v_trains_the_weights_of_the_single_stage() {
    trains_the_weights_of_the_single_stage_on_four_stages("zb_v");
}

/// DualPipeV (DeepSeek) on ZB-V's placement: at pp = 2 (four stages, eight micro-batches)
/// the same weights and loss as the single stage, bit for bit.
#[test]
fn dualpipe_v_trains_the_weights_of_the_single_stage() {
    trains_the_weights_of_the_single_stage_on_four_stages("dualpipe_v");
}

/// V-Half and V-Min (Qi et al. 2024, controllable memory) on ZB-V's placement: at pp = 2
/// (four stages, eight micro-batches) the same weights and loss as the single stage, bit
/// for bit.
#[test]
fn v_half_and_v_min_train_the_weights_of_the_single_stage() {
    trains_the_weights_of_the_single_stage_on_four_stages("v_half");
    trains_the_weights_of_the_single_stage_on_four_stages("v_min");
}

/// `schedule` on the V placement at pp = 2 (four stages), dp 1, 8 micro-batches: the
/// single stage's weights and loss, bit for bit.
fn trains_the_weights_of_the_single_stage_on_four_stages(schedule: &str) {
    let rt = Runtime::from_env().unwrap();
    let (reference, ref_loss) = trained(&rt, 1, 1, 8);
    let cfg = config_with(1, 2, 8, schedule);
    let s =
        pipetrain::train::train(&rt, &cfg, Path::new("equivalence.toml"), false, |_| {}).unwrap();
    assert_eq!((s.steps, s.stages), (20, 4), "{schedule}");
    let mut p = s.parameters;
    p.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(max_rel_diff(&reference, &p), 0.0, "{schedule}");
    assert_eq!(s.final_loss, ref_loss, "{schedule}");
}
