//! Mixed precision (`graph::autocast`): which nodes compute in half precision, what is
//! left in float32, and that ONNX Runtime takes the rewritten graph and computes it
//! within float16's rounding. Training curves in half precision are a GPU's check
//! (`scripts/gpu-check.sh --checks precision`): ONNX Runtime's CPU provider has float16
//! kernels for few products and runs the rest in float32 (the peers' tiny GPT trains
//! bitwise as in float32 there).

use crate::common;

use pipetrain::compute::{GraphSession, SessionOptions};
use pipetrain::graph::autocast::{autocast, products, Half};
use pipetrain::graph::{int_attr, make_node, untyped_value_info, Graph};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::Tensor;

/// `y = LayerNorm(Gemm(x, W1, b1) + MatMul(x, W2)) @ W2ᵀ`-like chain: a Gemm with a
/// bias, two MatMuls sharing `x`, a LayerNormalization between them.
fn model() -> (ModelProto, Tensor) {
    let t = |shape: Vec<usize>, k: usize| {
        let n = shape.iter().product::<usize>();
        Tensor::f32(
            shape,
            (0..n).map(|i| ((i * k) % 17) as f32 / 17.0 - 0.4).collect(),
        )
        .unwrap()
    };
    let nodes = vec![
        make_node(
            "Gemm",
            "fc",
            &["x", "W1", "b1"],
            &["h1"],
            vec![int_attr("transB", 1)],
        ),
        make_node("MatMul", "mm", &["x", "W2"], &["h2"], vec![]),
        make_node("Add", "add", &["h1", "h2"], &["h"], vec![]),
        make_node(
            "LayerNormalization",
            "ln",
            &["h", "g", "b1"],
            &["n"],
            vec![],
        ),
        make_node("MatMul", "out", &["n", "W3"], &["y"], vec![]),
    ];
    let inits = [
        t(vec![8, 6], 5).to_proto("W1"),
        t(vec![8], 3).to_proto("b1"),
        t(vec![6, 8], 7).to_proto("W2"),
        t(vec![8], 11).to_proto("g"),
        t(vec![8, 4], 13).to_proto("W3"),
    ];
    let x = pipetrain::graph::ValueMeta {
        dtype: pipetrain::tensor::DType::F32,
        shape: vec![5, 6],
    };
    let model = common::opset17_model(
        "mixed",
        nodes,
        inits.to_vec(),
        vec![pipetrain::graph::value_info("x", &x)],
        vec![untyped_value_info("y")],
    );
    (model, t(vec![5, 6], 19))
}

#[test]
fn products_read_half_casts_once_per_value_and_everything_else_stays_float32() {
    let (model, _) = model();
    let mut g = Graph::from_model(&model).unwrap();
    assert_eq!(autocast(&mut g, Half::F16, products(false)), 3);
    let op = |name: &str| g.nodes.iter().find(|n| n.name == name).unwrap().clone();
    // `x` is read by two products and cast once; `b1` by the Gemm (cast) and the
    // LayerNorm (not: it reads the float32 value).
    let casts: Vec<_> = g.nodes.iter().filter(|n| n.op_type == "Cast").collect();
    let to_half = casts
        .iter()
        .filter(|n| n.input[0] != n.output[0] && n.name.ends_with("_as_f16"));
    assert_eq!(to_half.count(), 6, "x, W1, b1, W2, n, W3");
    assert_eq!(op("fc").input, ["x_as_f16", "W1_as_f16", "b1_as_f16"]);
    assert_eq!(op("mm").input, ["x_as_f16", "W2_as_f16"]);
    assert_eq!(op("ln").input, ["h", "g", "b1"]);
    assert_eq!(op("add").input, ["h1", "h2"]);
    // Each product's output comes back as float32 under its own name.
    for (node, out) in [("fc", "h1"), ("mm", "h2"), ("out", "y")] {
        assert_eq!(op(node).output[0], format!("{out}_in_f16"));
        let back = op(&format!("{out}_to_f32"));
        assert_eq!(
            (back.input[0].as_str(), back.output[0].as_str()),
            (op(node).output[0].as_str(), out)
        );
    }
    // Casts come before their readers.
    let at = |name: &str| {
        g.nodes
            .iter()
            .position(|n| n.output.iter().any(|o| o == name))
    };
    for n in &g.nodes {
        let me = at(&n.output[0]).unwrap();
        for i in n.input.iter().filter_map(|i| at(i)) {
            assert!(i < me, "{} reads a value made after it", n.name);
        }
    }
    // On a GPU convolutions are products too.
    assert!(products(true).contains(&"Conv") && !products(false).contains(&"Conv"));
}

#[test]
fn onnx_runtime_takes_the_half_graph_and_computes_within_float16_rounding() {
    let rt = common::runtime();
    let (model, x) = model();
    let run = |half: Option<Half>| {
        let opts = SessionOptions {
            mixed_precision: half,
            state_on_device: true,
            cuda_kernels: true,
            ..SessionOptions::default()
        };
        let mut s = GraphSession::from_model(&rt, &model, &opts, "mixed").unwrap();
        s.run(&[("x", &x)]).unwrap().remove(0).to_f64_vec()
    };
    let (full, half) = (run(None), run(Some(Half::F16)));
    assert_eq!(full.len(), 20);
    // float16 keeps 11 significant bits: within a few units of 2^-11 of the float32 run.
    let scale = full.iter().fold(0f64, |m, v| m.max(v.abs()));
    let worst = full
        .iter()
        .zip(&half)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= 4e-3 * scale, "{worst:e} of {scale:e}");
}
