//! `BlasMatMul` against ONNX Runtime's own products, and on any thread count.

use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::custom_ops::BLAS_MATMUL;
use crate::graph::ValueMeta;
use crate::graph::{float_attr, int_attr, make_node};
use crate::tensor::{DType, Tensor};

/// Values in [-1, 1) from `seed`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// One product, as `op` (domain, type) with `attrs`, of inputs shaped `shapes`, on
/// `threads` intra-op threads: its output.
fn run(op: (&str, &str), attrs: &[(&str, f32)], shapes: &[&[usize]], threads: usize) -> Tensor {
    let names = ["a", "b", "c"];
    let attrs = attrs
        .iter()
        .map(|&(n, v)| match n.starts_with("trans") {
            true => int_attr(n, v as i64),
            false => float_attr(n, v),
        })
        .collect();
    let node = make_node(op.1, "p", &names[..shapes.len()], &["y"], attrs);
    let meta = |s: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: s.to_vec(),
    };
    let inputs: Vec<(&str, ValueMeta)> = names
        .iter()
        .zip(shapes)
        .map(|(n, s)| (*n, meta(s)))
        .collect();
    let mut model = crate::compute::test_model::model("product", vec![node], &inputs, &["y"]);
    model
        .opset_import
        .push(crate::onnx::proto::OperatorSetIdProto {
            domain: "com.microsoft".into(),
            version: 1,
        });
    if let Some(g) = model.graph.as_mut() {
        g.node[0].domain = op.0.into();
    }
    let rt = Runtime::from_env().unwrap();
    let opts = SessionOptions {
        intra_threads: threads,
        ..SessionOptions::default()
    };
    let mut session = GraphSession::from_model(&rt, &model, &opts, "product").unwrap();
    let tensors: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            Tensor::f32(s.to_vec(), values(n, i as u64 + 1)).unwrap()
        })
        .collect();
    let feeds: Vec<(&str, &Tensor)> = names.iter().copied().zip(&tensors).collect();
    session.run(&feeds).unwrap().remove(0)
}

/// A product: its operator (domain, type), attributes and input shapes.
type Case<'a> = ((&'a str, &'a str), &'a [(&'a str, f32)], &'a [&'a [usize]]);

/// The largest difference between two outputs of the same shape.
fn largest_difference(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.shape, b.shape);
    let (a, b) = (a.as_f32().unwrap(), b.as_f32().unwrap());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn has_blas() -> bool {
    Runtime::from_env()
        .ok()
        .and_then(|r| r.blas().cloned())
        .is_some()
}

#[test]
fn each_form_computes_what_onnx_runtime_computes() {
    if !has_blas() {
        eprintln!("skipped: no scipy-openblas32 beside ONNX Runtime");
        return;
    }
    let fused = ("com.microsoft", "FusedMatMul");
    // The last two with a C, cut by rows (80 x 50) and by columns (20 x 50).
    let cases: [Case; 6] = [
        (("", "MatMul"), &[], &[&[2, 40, 33], &[33, 50]]),
        (
            fused,
            &[("transA", 1.0), ("alpha", 0.5)],
            &[&[33, 80], &[33, 50]],
        ),
        (fused, &[("transB", 1.0)], &[&[80, 33], &[50, 33]]),
        (
            ("", "Gemm"),
            &[
                ("transA", 1.0),
                ("transB", 1.0),
                ("alpha", 2.0),
                ("beta", 0.5),
            ],
            &[&[33, 80], &[50, 33], &[50]],
        ),
        (
            ("", "Gemm"),
            &[("beta", -1.0)],
            &[&[80, 33], &[33, 50], &[80, 50]],
        ),
        (
            ("", "Gemm"),
            &[("beta", 2.0)],
            &[&[20, 33], &[33, 50], &[20, 50]],
        ),
    ];
    for (op, attrs, shapes) in cases {
        let want = run(op, attrs, shapes, 2);
        let got = run(("ai.pipetrain", BLAS_MATMUL), attrs, shapes, 2);
        let d = largest_difference(&got, &want);
        assert!(d < 1e-5, "{op:?} {attrs:?}: {d}");
    }
}

#[test]
fn results_do_not_depend_on_the_threads() {
    if !has_blas() {
        eprintln!("skipped: no scipy-openblas32 beside ONNX Runtime");
        return;
    }
    let op = ("ai.pipetrain", BLAS_MATMUL);
    // Cut by rows (300 >= 40), then by columns (20 < 300).
    for (attrs, shapes) in [
        (&[("transA", 1.0)][..], &[&[70, 300][..], &[70, 40]][..]),
        (&[], &[&[20, 70], &[70, 300]]),
    ] {
        let one = run(op, attrs, shapes, 1);
        for threads in [2, 3] {
            let more = run(op, attrs, shapes, threads);
            assert_eq!(
                one.as_f32().unwrap(),
                more.as_f32().unwrap(),
                "{threads} threads"
            );
        }
    }
}
