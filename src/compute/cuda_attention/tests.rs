//! The CUDA attention operators on a GPU (skipped without one): against the CPU's, and
//! the two forms timed side by side for `scripts/gpu-check.sh`.

use crate::compute::{Device, GraphSession, Runtime, SessionOptions};
use crate::graph::custom_ops::{PACKED_ATTENTION, PACKED_ATTENTION_GRAD};
use crate::graph::{float_attr, int_attr, ints_attr, make_node, ValueMeta};
use crate::tensor::Tensor;

/// On a GPU (skipped without one): GPT-2's packed causal attention forward and
/// backward, `[2, 300, 3 x 4 x 32]` (rows longer than a block) with an additive
/// padding mask `[2, 1, 1, 300]`, on the CUDA operators against the CPU's, within
/// float32 reordering; the same bits twice.
#[test]
fn on_a_gpu_packed_attention_is_the_cpus() {
    packed_attention_on_both(false);
}

/// The same with `lse` (the flash kernels, `compute/kernels/flash.rs`): O, each row's
/// log-sum-exp and the gradient against the CPU operator's `lse` form.
#[test]
fn on_a_gpu_flash_attention_is_the_cpus() {
    packed_attention_on_both(true);
}

/// The attributes of GPT-2's packed causal attention, `h` heads of `d`.
fn packed_causal(h: usize, d: usize, lse: bool) -> Vec<crate::onnx::proto::AttributeProto> {
    vec![
        float_attr("scale", 1.0 / (d as f32).sqrt()),
        int_attr("causal", 1),
        int_attr("lse", i64::from(lse)),
        ints_attr("q_perm", &[0, 2, 1, 3]),
        ints_attr("k_perm", &[0, 2, 3, 1]),
        ints_attr("v_perm", &[0, 2, 1, 3]),
        ints_attr("out_perm", &[0, 2, 1, 3]),
        ints_attr("heads_dim", &[h as i64, d as i64]),
        ints_attr("offsets", &[0, (h * d) as i64, (2 * h * d) as i64]),
    ]
}

fn packed_attention_on_both(lse: bool) {
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let (b, t, h, d) = (2usize, 300usize, 4usize, 32usize);
    let w = 3 * h * d;
    let attrs = || packed_causal(h, d, lse);
    let grad_inputs: &[&str] = match lse {
        true => &["do", "qkv", "p", "o", "mask"],
        false => &["do", "qkv", "p"],
    };
    let nodes = vec![
        make_node(
            PACKED_ATTENTION,
            "att",
            &["qkv", "mask"],
            &["o", "p"],
            attrs(),
        ),
        make_node(
            PACKED_ATTENTION_GRAD,
            "grad",
            grad_inputs,
            &["dqkv"],
            attrs(),
        ),
    ];
    let inputs = [
        ("qkv", ValueMeta::f32(&[b, t, w])),
        ("do", ValueMeta::f32(&[b, t, h, d])),
        ("mask", ValueMeta::f32(&[b, 1, 1, t])),
    ];
    let model = crate::compute::test_model::model("att", nodes, &inputs, &["o", "p", "dqkv"]);
    let wave = |n: usize, k: f32| {
        (0..n)
            .map(|i| (i as f32 * 0.37 + k).sin())
            .collect::<Vec<_>>()
    };
    let qkv = Tensor::f32(vec![b, t, w], wave(b * t * w, 0.1)).unwrap();
    let d_o = Tensor::f32(vec![b, t, h, d], wave(b * t * h * d, 0.7)).unwrap();
    let padding = (0..b * t).map(|k| if k >= t && k % t >= t - 7 { -1e4 } else { 0.0 });
    let mask = Tensor::f32(vec![b, 1, 1, t], padding.collect()).unwrap();
    let feeds = [("qkv", &qkv), ("do", &d_o), ("mask", &mask)];
    let rt = Runtime::from_env().unwrap();
    let run = |device| {
        let opts = SessionOptions {
            device,
            ..SessionOptions::default()
        };
        let mut s = GraphSession::from_model(&rt, &model, &opts, "att").unwrap();
        s.run(&feeds).unwrap()
    };
    let (cpu, gpu, again) = (run(Device::Cpu), run(Device::Cuda(0)), run(Device::Cuda(0)));
    let kept = if lse { "L" } else { "P" };
    for (k, name) in ["O", kept, "dQKV"].iter().enumerate() {
        let (a, g) = (cpu[k].as_f32().unwrap(), gpu[k].as_f32().unwrap());
        let scale = a.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let worst = a.iter().zip(g).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(worst <= 1e-4 * scale, "{name}: {worst} of {scale}");
        assert!(
            gpu[k].as_f32() == again[k].as_f32(),
            "{name}: a second run differs"
        );
    }
}

/// A measurement for `scripts/gpu-check.sh --checks kernels` (ignored here; run there
/// with `--ignored`), not a timing goal: GPT-2 small's attention, `[4, 1024, 3 x 12 x
/// 64]` causal, twelve layers' forward and backward in one session run (one copy of the
/// inputs in, one number out), with the probabilities (cuBLAS products) and on the
/// flash kernels, in three alternating windows of three runs after a warm-up each;
/// prints the median run of each. The two forms' sums of the gradients agree.
#[test]
#[ignore]
fn on_a_gpu_time_the_attention_forms() {
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let (b, t, h, d, layers) = (4usize, 1024usize, 12usize, 64usize, 12usize);
    let w = 3 * h * d;
    let session = |rt: &Runtime, lse: bool| {
        let attrs = || packed_causal(h, d, lse);
        let mut nodes = Vec::new();
        let names: Vec<[String; 3]> = (0..layers)
            .map(|l| [format!("o{l}"), format!("p{l}"), format!("g{l}")])
            .collect();
        for [o, p, g] in &names {
            let grad_in: Vec<&str> = match lse {
                true => vec!["do", "qkv", p, o],
                false => vec!["do", "qkv", p],
            };
            nodes.push(make_node(PACKED_ATTENTION, o, &["qkv"], &[o, p], attrs()));
            nodes.push(make_node(PACKED_ATTENTION_GRAD, g, &grad_in, &[g], attrs()));
        }
        let inputs = [
            ("qkv", ValueMeta::f32(&[b, t, w])),
            ("do", ValueMeta::f32(&[b, t, h, d])),
        ];
        let mut model = crate::compute::test_model::model("att", nodes, &inputs, &["total"]);
        let graph = model.graph.as_mut().expect("a graph");
        let grads: Vec<&str> = names.iter().map(|n| n[2].as_str()).collect();
        graph
            .node
            .push(make_node("Sum", "sum", &grads, &["all"], vec![]));
        let keep = vec![int_attr("keepdims", 0)];
        graph
            .node
            .push(make_node("ReduceSum", "total", &["all"], &["total"], keep));
        let opts = SessionOptions {
            device: Device::Cuda(0),
            ..SessionOptions::default()
        };
        GraphSession::from_model(rt, &model, &opts, "att").unwrap()
    };
    let wave = |n: usize, k: f32| (0..n).map(|i| (i as f32 * 0.37 + k).sin()).collect();
    let qkv = Tensor::f32(vec![b, t, w], wave(b * t * w, 0.1)).unwrap();
    let d_o = Tensor::f32(vec![b, t, h, d], wave(b * t * h * d, 0.7)).unwrap();
    let feeds = [("qkv", &qkv), ("do", &d_o)];
    let rt = Runtime::from_env().unwrap();
    let mut forms = [session(&rt, false), session(&rt, true)];
    let mut totals = [0f64; 2];
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for (k, s) in forms.iter_mut().enumerate() {
        totals[k] = s.run(&feeds).unwrap()[0].to_f64_vec()[0];
    }
    for _ in 0..3 {
        for (k, s) in forms.iter_mut().enumerate() {
            for _ in 0..3 {
                let start = std::time::Instant::now();
                s.run(&feeds).unwrap();
                times[k].push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [products, flash] = [median(&mut times[0]), median(&mut times[1])];
    println!(
        "attention timing: GPT-2 small's, 12 layers forward and backward in one run \
         (inputs copied in): products {products:.1} ms, flash {flash:.1} ms \
         (flash/products {:.2})",
        flash / products
    );
    let off = (totals[0] - totals[1]).abs() / totals[0].abs().max(1.0);
    assert!(off < 1e-3, "sums of the gradients {totals:?}");
}
