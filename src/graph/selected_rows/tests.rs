//! The row moves against ONNX Runtime on small graphs.

use super::*;
use crate::compute::Runtime;
use crate::graph::ir::ValueMeta;
use crate::graph::ShapeProbe;
use crate::tensor::DType;

fn f32s(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let v = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    Tensor::f32(shape.to_vec(), v).unwrap()
}

fn i64s(name: &str, v: &[i64], scalar: bool) -> crate::onnx::proto::TensorProto {
    let shape = if scalar { vec![] } else { vec![v.len()] };
    Tensor::i64(shape, v.to_vec()).unwrap().to_proto(name)
}

/// One attention layer as exporters write it (queries, keys and values from `x`, a
/// broadcast mask, heads by reshapes and a transpose, a residual, a norm and a
/// feed-forward), then `y[:, 0]` through a full `Slice` and a scalar `Gather`, and a
/// classifier.
fn layer() -> Graph {
    let mut g = Graph::default();
    let n = |op: &str, ins: &[&str], out: &str| make_node(op, out, ins, &[out], vec![]);
    let weights: [(&str, &[usize]); 8] = [
        ("wq", &[4, 4]),
        ("wk", &[4, 4]),
        ("wv", &[4, 4]),
        ("gamma", &[4]),
        ("beta", &[4]),
        ("w1", &[4, 6]),
        ("w2", &[6, 4]),
        ("wc", &[4, 3]),
    ];
    for (i, (name, shape)) in weights.iter().enumerate() {
        g.initializers
            .push(f32s(shape, 10 + i as u64).to_proto(name));
    }
    g.initializers
        .push(Tensor::f32(vec![], vec![0.5]).unwrap().to_proto("half"));
    g.initializers.push(i64s("heads", &[2, 5, 2, 2], false));
    g.initializers.push(i64s("merged", &[0, 5, -1], false));
    g.initializers.push(i64s("zero", &[0], false));
    g.initializers.push(i64s("two", &[2], false));
    g.initializers.push(i64s("first", &[0], true));
    let perm = |p: &[i64]| vec![crate::graph::ir::ints_attr("perm", p)];
    g.nodes = vec![
        n("MatMul", &["x", "wq"], "q"),
        n("MatMul", &["x", "wk"], "k"),
        n("MatMul", &["x", "wv"], "v"),
        make_node("Transpose", "kt", &["k"], &["kt"], perm(&[0, 2, 1])),
        n("MatMul", &["q", "kt"], "s"),
        n("Mul", &["s", "half"], "scaled"),
        n("Add", &["scaled", "mask"], "masked"),
        n("Softmax", &["masked"], "p"),
        n("MatMul", &["p", "v"], "ctx"),
        n("Reshape", &["ctx", "heads"], "split"),
        make_node(
            "Transpose",
            "swapped",
            &["split"],
            &["swapped"],
            perm(&[0, 1, 3, 2]),
        ),
        n("Reshape", &["swapped", "merged"], "joined"),
        n("Add", &["joined", "x"], "residual"),
        n("LayerNormalization", &["residual", "gamma", "beta"], "ln"),
        n("MatMul", &["ln", "w1"], "h"),
        n("Relu", &["h"], "a"),
        n("MatMul", &["a", "w2"], "f"),
        n("Add", &["ln", "f"], "y"),
        n("Slice", &["y", "zero", "two", "zero"], "all"),
        make_node(
            "Gather",
            "cls",
            &["all", "first"],
            &["cls"],
            vec![int_attr("axis", 1)],
        ),
        n("MatMul", &["cls", "wc"], "logits"),
    ];
    let meta = |shape: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    };
    g.inputs = vec![
        crate::graph::ir::value_info("x", &meta(&[2, 5, 4])),
        crate::graph::ir::value_info("mask", &meta(&[2, 1, 5])),
    ];
    g.outputs = vec![crate::graph::ir::untyped_value_info("logits")];
    g.opsets = vec![crate::onnx::proto::OperatorSetIdProto {
        domain: String::new(),
        version: 17,
    }];
    g.ir_version = 8;
    g
}

#[test]
fn the_read_position_is_computed_alone_back_to_the_attention_and_the_result_is_the_same() {
    let rt = Runtime::from_env().unwrap();
    let (x, mask) = (f32s(&[2, 5, 4], 1), f32s(&[2, 1, 5], 2));
    let feeds = [("x", &x), ("mask", &mask)];
    let mut g = layer();
    let before = rt.values(&g, &feeds).unwrap();
    let mut metas = rt.probe(&g, &feeds).unwrap();

    let moved = select_rows_early(&mut g, &mut metas);
    // Slice, Add, both products and the Relu of the feed-forward, the norm, the
    // residual, both reshapes and the transpose, the second product of the
    // attention, its softmax, mask, scale and first product, the queries.
    assert_eq!(moved, 16);
    for (value, shape) in [("y", [2, 1, 4]), ("h", [2, 1, 6]), ("q", [2, 1, 4])] {
        assert_eq!(metas[value].shape, shape, "{value}");
    }
    assert_eq!(metas["k"].shape, [2, 5, 4]);
    // One `Gather` of `x` feeds the queries and the residual; the keys read it whole.
    let gathers: Vec<&NodeProto> = g.nodes.iter().filter(|n| n.op_type == "Gather").collect();
    assert_eq!(gathers.len(), 1);
    assert_eq!(gathers[0].input[0], "x");
    let reads = |v: &str| {
        g.nodes
            .iter()
            .filter(|n| n.input.contains(&v.to_string()))
            .count()
    };
    assert_eq!(reads(&gathers[0].output[0]), 2);
    let cls = g.nodes.iter().find(|n| n.output[0] == "cls").unwrap();
    assert_eq!(cls.op_type, "Squeeze");

    // The graph is in order and computes the same logits.
    assert_eq!(rt.probe(&g, &feeds).unwrap()["ln"].shape, [2, 1, 4]);
    let after = rt.values(&g, &feeds).unwrap();
    let (b, a) = (before[0].as_f32().unwrap(), after[0].as_f32().unwrap());
    assert_eq!(before[0].shape, after[0].shape);
    for (x, y) in b.iter().zip(a) {
        assert!((x - y).abs() <= 1e-6, "{x} against {y}");
    }
}

#[test]
fn a_value_read_whole_elsewhere_or_mixed_along_the_axis_keeps_its_rows() {
    let rt = Runtime::from_env().unwrap();
    let mut g = layer();
    // The norm's output is a graph output too: the rows stop there.
    g.outputs.push(crate::graph::ir::untyped_value_info("ln"));
    let (x, mask) = (f32s(&[2, 5, 4], 1), f32s(&[2, 1, 5], 2));
    let mut metas = rt.probe(&g, &[("x", &x), ("mask", &mask)]).unwrap();
    assert_eq!(select_rows_early(&mut g, &mut metas), 5);
    assert_eq!(metas["ln"].shape, [2, 5, 4]);
    assert_eq!(metas["f"].shape, [2, 1, 4]);

    // A softmax over the read axis mixes its positions.
    let mut g = layer();
    let soft = g.nodes.iter_mut().find(|n| n.op_type == "Softmax").unwrap();
    soft.attribute.push(int_attr("axis", 1));
    let mut metas = rt.probe(&g, &[("x", &x), ("mask", &mask)]).unwrap();
    assert_eq!(select_rows_early(&mut g, &mut metas), 11);
    assert_eq!(metas["p"].shape, [2, 5, 5]);
    assert_eq!(metas["ctx"].shape, [2, 1, 4]);
}

#[test]
fn gemm_rows_and_columns_are_read_through_its_transposes_and_bias() {
    let rt = Runtime::from_env().unwrap();
    let trans = |a, b| vec![int_attr("transA", a), int_attr("transB", b)];
    // Row 2 of `Gemm(a^T, w^T) + c` and column 1 of `Gemm(x, v) + d` (a `[1, N]` bias
    // along the rows, a `[M, 1]` one along the columns).
    let mut g = Graph::default();
    for (name, shape, seed) in [
        ("w", &[3, 4][..], 3),
        ("c", &[1, 3], 4),
        ("v", &[4, 5], 5),
        ("d", &[6, 1], 6),
    ] {
        g.initializers.push(f32s(shape, seed).to_proto(name));
    }
    g.initializers.push(i64s("two", &[2], false));
    g.initializers.push(i64s("one", &[1], true));
    g.nodes = vec![
        make_node("Gemm", "rows", &["a", "w", "c"], &["r"], trans(1, 1)),
        make_node("Relu", "relu", &["r"], &["rr"], vec![]),
        make_node("Gather", "row", &["rr", "two"], &["row"], vec![]),
        make_node("Gemm", "cols", &["x", "v", "d"], &["k"], trans(0, 0)),
        make_node(
            "Gather",
            "col",
            &["k", "one"],
            &["col"],
            vec![int_attr("axis", 1)],
        ),
    ];
    let meta = |shape: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    };
    g.inputs = vec![
        crate::graph::ir::value_info("a", &meta(&[4, 6])),
        crate::graph::ir::value_info("x", &meta(&[6, 4])),
    ];
    g.outputs = ["row", "col"]
        .map(crate::graph::ir::untyped_value_info)
        .to_vec();
    g.opsets = layer().opsets;
    g.ir_version = 8;
    let (a, x) = (f32s(&[4, 6], 7), f32s(&[6, 4], 8));
    let feeds = [("a", &a), ("x", &x)];
    let before = rt.values(&g, &feeds).unwrap();
    let mut metas = rt.probe(&g, &feeds).unwrap();
    assert_eq!(select_rows_early(&mut g, &mut metas), 3);
    assert_eq!(metas["r"].shape, [1, 3]);
    assert_eq!(metas["k"].shape, [6, 1]);
    // `a` is read at its column 2 (transA), `v` at its column 1, `d` whole.
    let read = |v: &str| {
        g.nodes
            .iter()
            .find(|n| n.op_type == "Gather" && n.input[0] == v)
    };
    assert_eq!(
        crate::graph::ir::attr_i(read("a").unwrap(), "axis"),
        Some(1)
    );
    assert_eq!(
        crate::graph::ir::attr_i(read("v").unwrap(), "axis"),
        Some(1)
    );
    assert!(read("d").is_none() && read("w").is_none());
    let after = rt.values(&g, &feeds).unwrap();
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(b.shape, a.shape);
        for (x, y) in b.as_f32().unwrap().iter().zip(a.as_f32().unwrap()) {
            assert!((x - y).abs() <= 1e-6, "{x} against {y}");
        }
    }
}

#[test]
fn a_dropout_is_read_through_only_where_it_is_an_identity() {
    let meta = |shape: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    };
    let metas: Metas = [
        ("x".to_string(), meta(&[2, 5])),
        ("y".to_string(), meta(&[2, 5])),
    ]
    .into_iter()
    .collect();
    let consts: HashMap<String, Tensor> = [
        ("half", Tensor::f32(vec![], vec![0.5]).unwrap()),
        ("none", Tensor::f32(vec![], vec![0.0]).unwrap()),
        (
            "on",
            Tensor::new(vec![], crate::tensor::TensorData::Bool(vec![true])).unwrap(),
        ),
        (
            "off",
            Tensor::new(vec![], crate::tensor::TensorData::Bool(vec![false])).unwrap(),
        ),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    let reads = |inputs: &[&str]| {
        let n = make_node("Dropout", "d", inputs, &["y"], vec![]);
        row_reads(&n, 1, &metas, &consts).is_some()
    };
    assert!(reads(&["x"]), "not training by default");
    assert!(reads(&["x", "half", "off"]));
    assert!(reads(&["x", "none", "on"]));
    assert!(!reads(&["x", "half", "on"]));
    assert!(!reads(&["x", "", "on"]), "the default ratio is 0.5");
}
