//! Every differentiable operator's gradient against central finite differences: float64
//! graphs within 1e-4 relative where ONNX Runtime has double kernels, float32 with the
//! tolerance justified in `common/gradcheck.rs` otherwise (Erf, Gelu).

use crate::common::gradcheck::{check, ints, GradCheck, Rng, F32, F64};
use pipetrain::graph::{float_attr, int_attr, ints_attr, string_attr};
use pipetrain::tensor::{DType, Tensor};

const D: DType = DType::F64;

#[test]
fn matmul_all_ranks() {
    let mut r = Rng::new(1);
    let cases: [(&[usize], &[usize]); 6] = [
        (&[3, 4], &[4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[2, 1, 3, 4], &[3, 4, 5]),
        (&[4], &[4, 5]),
        (&[3, 4], &[4]),
        (&[2, 3, 4], &[2, 4, 2]),
    ];
    for (sa, sb) in cases {
        for contrib in [true, false] {
            let mut c = GradCheck::new(17)
                .param("A", r.tensor(D, sa, -1.0, 1.0))
                .param("B", r.tensor(D, sb, -1.0, 1.0))
                .node("MatMul", &["A", "B"], &["Y"], vec![]);
            if !contrib {
                c = c.without_contrib();
            }
            check(&format!("MatMul {sa:?} x {sb:?} contrib={contrib}"), c, F64);
        }
    }
}

/// `nn.Linear` as `torch.onnx.export` writes it without constant folding:
/// `MatMul(X, Transpose(W))`. With contrib ops the product becomes one `FusedMatMul`
/// reading `W` (`graph::fusion::linear`), without them the gradient reads `W` instead of
/// its transpose (`RuleCtx::untransposed`); both against finite differences. Float32:
/// ONNX Runtime's `FusedMatMul` has no double kernel.
#[test]
fn a_linear_layer_through_a_transposed_weight() {
    let mut r = Rng::new(21);
    for sx in [&[3usize, 4][..], &[2, 3, 4]] {
        for contrib in [true, false] {
            let mut c = GradCheck::new(17)
                .param("X", r.tensor(DType::F32, sx, -1.0, 1.0))
                .param("W", r.tensor(DType::F32, &[5, 4], -1.0, 1.0))
                .node(
                    "Transpose",
                    &["W"],
                    &["Wt"],
                    vec![ints_attr("perm", &[1, 0])],
                )
                .node("MatMul", &["X", "Wt"], &["Y"], vec![]);
            if !contrib {
                c = c.without_contrib();
            }
            check(&format!("linear {sx:?} contrib={contrib}"), c, F32);
        }
    }
}

#[test]
fn gemm_transposes_alpha_beta_and_bias() {
    let mut r = Rng::new(2);
    for (ta, tb) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        let sa: &[usize] = if ta == 1 { &[4, 3] } else { &[3, 4] };
        let sb: &[usize] = if tb == 1 { &[5, 4] } else { &[4, 5] };
        let c = GradCheck::new(17)
            .param("A", r.tensor(D, sa, -1.0, 1.0))
            .param("B", r.tensor(D, sb, -1.0, 1.0))
            .param("C", r.tensor(D, &[5], -1.0, 1.0))
            .node(
                "Gemm",
                &["A", "B", "C"],
                &["Y"],
                vec![
                    int_attr("transA", ta),
                    int_attr("transB", tb),
                    float_attr("alpha", 0.7),
                    float_attr("beta", 1.3),
                ],
            );
        check(&format!("Gemm transA={ta} transB={tb}"), c, F64);
    }
}

#[test]
fn broadcasting_arithmetic() {
    let mut r = Rng::new(3);
    for op in ["Add", "Sub", "Mul", "Div"] {
        let lo = if op == "Div" { 0.5 } else { -1.0 };
        let c = GradCheck::new(17)
            .param("A", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
            .param("B", r.tensor(D, &[3, 1], lo, 1.5))
            .node(op, &["A", "B"], &["Y"], vec![]);
        check(op, c, F64);
    }
    let c = GradCheck::new(17)
        .param("A", r.tensor(D, &[3], 0.5, 1.5))
        .param("B", r.tensor(D, &[2, 3], -1.0, 1.0))
        .node("Pow", &["A", "B"], &["Y"], vec![]);
    check("Pow tensor exponent", c, F64);
    let c = GradCheck::new(17)
        .param("A", r.tensor(D, &[2, 3], -1.0, 1.0))
        .constant("E", Tensor::f64(vec![], vec![3.0]).unwrap())
        .node("Pow", &["A", "E"], &["Y"], vec![]);
    check("Pow constant exponent", c, F64);
}

#[test]
fn unary_functions() {
    let mut r = Rng::new(4);
    let positive = ["Sqrt", "Log"];
    for op in [
        "Neg",
        "Sqrt",
        "Exp",
        "Log",
        "Tanh",
        "Sigmoid",
        "Relu",
        "LeakyRelu",
        "Identity",
    ] {
        let x = if positive.contains(&op) {
            r.tensor(D, &[3, 4], 0.3, 2.0)
        } else {
            r.away_from_zero(D, &[3, 4], 0.05)
        };
        let attrs = if op == "LeakyRelu" {
            vec![float_attr("alpha", 0.2)]
        } else {
            vec![]
        };
        let c = GradCheck::new(17)
            .param("X", x)
            .node(op, &["X"], &["Y"], attrs);
        check(op, c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[3, 4], -1.0, 1.0))
        .node(
            "Cast",
            &["X"],
            &["Y"],
            vec![int_attr("to", DType::F64.onnx() as i64)],
        );
    check("Cast f32 -> f64 (float32 input)", c, F32);
}

#[test]
fn erf_and_gelu_in_float32() {
    // ONNX Runtime has no double kernel for Erf (nor Gelu): float32, tolerance in F32.
    let mut r = Rng::new(5);
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[3, 5], -2.0, 2.0))
        .node("Erf", &["X"], &["Y"], vec![]);
    check("Erf", c, F32);
    for approx in ["none", "tanh"] {
        let c = GradCheck::new(20)
            .param("X", r.tensor(DType::F32, &[3, 5], -3.0, 3.0))
            .node(
                "Gelu",
                &["X"],
                &["Y"],
                vec![string_attr("approximate", approx)],
            );
        check(&format!("Gelu approximate={approx}"), c, F32);
    }
    // The decomposition torch exports: 0.5 * x * (1 + erf(x / sqrt 2)).
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[4, 3], -3.0, 3.0))
        .constant(
            "s",
            Tensor::f32(vec![], vec![std::f32::consts::SQRT_2]).unwrap(),
        )
        .constant("one", Tensor::f32(vec![], vec![1.0]).unwrap())
        .constant("half", Tensor::f32(vec![], vec![0.5]).unwrap())
        .node("Div", &["X", "s"], &["a"], vec![])
        .node("Erf", &["a"], &["b"], vec![])
        .node("Add", &["b", "one"], &["c"], vec![])
        .node("Mul", &["X", "c"], &["d"], vec![])
        .node("Mul", &["d", "half"], &["Y"], vec![]);
    check("Gelu as Erf decomposition", c, F32);
    // The same with `x * (1 / sqrt 2)` and the operands the other way round; and with
    // `1 + erf` also read elsewhere (differentiated node by node then).
    for also_read in [false, true] {
        let mut c = GradCheck::new(17)
            .param("X", r.tensor(DType::F32, &[4, 3], -3.0, 3.0))
            .constant(
                "s",
                Tensor::f32(vec![], vec![std::f32::consts::FRAC_1_SQRT_2]).unwrap(),
            )
            .constant("one", Tensor::f32(vec![], vec![1.0]).unwrap())
            .constant("half", Tensor::f32(vec![], vec![0.5]).unwrap())
            .node("Mul", &["s", "X"], &["a"], vec![])
            .node("Erf", &["a"], &["b"], vec![])
            .node("Add", &["one", "b"], &["c"], vec![])
            .node("Mul", &["c", "X"], &["d"], vec![])
            .node("Mul", &["half", "d"], &["Y"], vec![]);
        if also_read {
            c = c
                .node("Mul", &["c", "c"], &["c2"], vec![])
                .loss_of(&["Y", "c2"]);
        }
        check(
            &format!("Gelu as x * (1 / sqrt 2), 1 + erf read elsewhere: {also_read}"),
            c,
            F32,
        );
    }
    // The tanh decomposition, checked in float64 (Tanh and Pow have double kernels).
    let k = (2.0f64 / std::f64::consts::PI).sqrt();
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[4, 3], -3.0, 3.0))
        .constant("three", Tensor::f64(vec![], vec![3.0]).unwrap())
        .constant("c", Tensor::f64(vec![], vec![0.044715]).unwrap())
        .constant("k", Tensor::f64(vec![], vec![k]).unwrap())
        .constant("one", Tensor::f64(vec![], vec![1.0]).unwrap())
        .constant("half", Tensor::f64(vec![], vec![0.5]).unwrap())
        .node("Pow", &["X", "three"], &["x3"], vec![])
        .node("Mul", &["x3", "c"], &["cx3"], vec![])
        .node("Add", &["X", "cx3"], &["in"], vec![])
        .node("Mul", &["in", "k"], &["u"], vec![])
        .node("Tanh", &["u"], &["t"], vec![])
        .node("Add", &["t", "one"], &["t1"], vec![])
        .node("Mul", &["X", "t1"], &["xt"], vec![])
        .node("Mul", &["xt", "half"], &["Y"], vec![]);
    check("Gelu as Tanh decomposition", c, F64);
}

#[test]
fn softmax_family() {
    let mut r = Rng::new(6);
    for (op, axis) in [
        ("Softmax", -1),
        ("Softmax", 1),
        ("LogSoftmax", -1),
        ("LogSoftmax", 0),
    ] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 3, 4], -2.0, 2.0))
            .node(op, &["X"], &["Y"], vec![int_attr("axis", axis)]);
        check(&format!("{op} axis={axis}"), c, F64);
    }
}

#[test]
fn softmax_cross_entropy_reductions_and_ignore_index() {
    let mut r = Rng::new(7);
    let labels = Tensor::i64(vec![6], vec![0, 3, 1, 4, 3, 2]).unwrap();
    for (reduction, ignore) in [
        ("mean", None),
        ("mean", Some(3)),
        ("sum", None),
        ("none", Some(1)),
    ] {
        let mut attrs = vec![string_attr("reduction", reduction)];
        if let Some(ii) = ignore {
            attrs.push(int_attr("ignore_index", ii));
        }
        let c = GradCheck::new(17)
            .param("S", r.tensor(D, &[6, 5], -2.0, 2.0))
            .constant("L", labels.clone())
            .node("SoftmaxCrossEntropyLoss", &["S", "L"], &["l"], attrs)
            .loss_of(&["l"]);
        check(
            &format!("SoftmaxCrossEntropyLoss {reduction} ignore={ignore:?}"),
            c,
            F64,
        );
    }
    // Scores [N, C, d]: classes on axis 1.
    let c = GradCheck::new(17)
        .param("S", r.tensor(D, &[2, 4, 3], -2.0, 2.0))
        .constant(
            "L",
            Tensor::i64(vec![2, 3], vec![0, 3, 1, 2, 2, 0]).unwrap(),
        )
        .node(
            "SoftmaxCrossEntropyLoss",
            &["S", "L"],
            &["l", "log_prob"],
            vec![],
        )
        .loss_of(&["l"]);
    check("SoftmaxCrossEntropyLoss [N,C,d]", c, F64);
    // An ignored label that is no class (PyTorch's -100), under opset 17 (the gradient's
    // label term is scattered) and opset 13 (a one-hot instead).
    let padded = Tensor::i64(vec![6], vec![0, -100, 1, 4, -100, 2]).unwrap();
    for opset in [17, 13] {
        let c = GradCheck::new(opset)
            .param("S", r.tensor(D, &[6, 5], -2.0, 2.0))
            .constant("L", padded.clone())
            .node(
                "SoftmaxCrossEntropyLoss",
                &["S", "L"],
                &["l"],
                vec![int_attr("ignore_index", -100)],
            )
            .loss_of(&["l"]);
        check(
            &format!("SoftmaxCrossEntropyLoss ignore=-100 opset {opset}"),
            c,
            F64,
        );
    }
}

#[test]
fn layer_normalization_with_and_without_statistics() {
    let mut r = Rng::new(8);
    for (axis, outputs) in [(-1, 1), (1, 1), (-1, 3)] {
        let outs: Vec<&str> = ["Y", "Mean", "InvStd"][..outputs].to_vec();
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 3, 4], -2.0, 2.0))
            .param("W", r.tensor(D, &[4], 0.5, 1.5))
            .param("B", r.tensor(D, &[4], -0.5, 0.5))
            .node(
                "LayerNormalization",
                &["X", "W", "B"],
                &outs,
                vec![int_attr("axis", axis), float_attr("epsilon", 1e-5)],
            )
            .loss_of(&["Y"]);
        let c = if axis == 1 {
            // normalized over the last two axes: scale and bias of shape [3, 4]
            GradCheck::new(17)
                .param("X", r.tensor(D, &[2, 3, 4], -2.0, 2.0))
                .param("W", r.tensor(D, &[3, 4], 0.5, 1.5))
                .param("B", r.tensor(D, &[3, 4], -0.5, 0.5))
                .node(
                    "LayerNormalization",
                    &["X", "W", "B"],
                    &outs,
                    vec![int_attr("axis", axis)],
                )
                .loss_of(&["Y"])
        } else {
            c
        };
        check(
            &format!("LayerNormalization axis={axis} outputs={outputs}"),
            c,
            F64,
        );
    }
    // Opset 18 takes the backward's `ReduceMean` axes as an input, not an attribute.
    let c = GradCheck::new(18)
        .param("X", r.tensor(D, &[2, 3, 5], -2.0, 2.0))
        .param("W", r.tensor(D, &[5], 0.5, 1.5))
        .param("B", r.tensor(D, &[5], -0.5, 0.5))
        .node(
            "LayerNormalization",
            &["X", "W", "B"],
            &["Y", "Mean", "InvStd"],
            vec![int_attr("axis", -1)],
        )
        .loss_of(&["Y"]);
    check("LayerNormalization opset 18", c, F64);
    // float32 with the statistics outputs in X's type: the rule reads them.
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[3, 8], -2.0, 2.0))
        .param("W", r.tensor(DType::F32, &[8], 0.5, 1.5))
        .param("B", r.tensor(DType::F32, &[8], -0.5, 0.5))
        .node(
            "LayerNormalization",
            &["X", "W", "B"],
            &["Y", "Mean", "InvStd"],
            vec![],
        )
        .loss_of(&["Y"]);
    check("LayerNormalization float32 with stashed statistics", c, F32);
}

#[test]
fn reductions() {
    let mut r = Rng::new(9);
    for keep in [0, 1] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
            .constant("axes", ints(&[1, -1]))
            .node(
                "ReduceSum",
                &["X", "axes"],
                &["Y"],
                vec![int_attr("keepdims", keep)],
            );
        check(&format!("ReduceSum keepdims={keep}"), c, F64);
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
            .node(
                "ReduceMean",
                &["X"],
                &["Y"],
                vec![ints_attr("axes", &[0, 2]), int_attr("keepdims", keep)],
            );
        check(&format!("ReduceMean opset 17 keepdims={keep}"), c, F64);
        let c = GradCheck::new(18)
            .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
            .constant("axes", ints(&[2]))
            .node(
                "ReduceMean",
                &["X", "axes"],
                &["Y"],
                vec![int_attr("keepdims", keep)],
            );
        check(&format!("ReduceMean opset 18 keepdims={keep}"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3], -1.0, 1.0))
        .node("ReduceMean", &["X"], &["Y"], vec![]);
    check("ReduceMean over all axes", c, F64);
}

#[test]
fn reshaping_ops() {
    let mut r = Rng::new(10);
    let x = |r: &mut Rng| r.tensor(D, &[2, 3, 4], -1.0, 1.0);
    let cases: Vec<(&str, GradCheck)> = vec![
        (
            "Reshape",
            GradCheck::new(17)
                .param("X", x(&mut r))
                .constant("s", ints(&[4, -1]))
                .node("Reshape", &["X", "s"], &["Y"], vec![]),
        ),
        (
            "Flatten",
            GradCheck::new(17).param("X", x(&mut r)).node(
                "Flatten",
                &["X"],
                &["Y"],
                vec![int_attr("axis", 2)],
            ),
        ),
        (
            "Transpose",
            GradCheck::new(17).param("X", x(&mut r)).node(
                "Transpose",
                &["X"],
                &["Y"],
                vec![ints_attr("perm", &[2, 0, 1])],
            ),
        ),
        (
            "Transpose default",
            GradCheck::new(17)
                .param("X", x(&mut r))
                .node("Transpose", &["X"], &["Y"], vec![]),
        ),
        (
            "Unsqueeze",
            GradCheck::new(17)
                .param("X", x(&mut r))
                .constant("a", ints(&[0, 3]))
                .node("Unsqueeze", &["X", "a"], &["Y"], vec![]),
        ),
        (
            "Squeeze",
            GradCheck::new(17)
                .param("X", r.tensor(D, &[2, 1, 4], -1.0, 1.0))
                .constant("a", ints(&[1]))
                .node("Squeeze", &["X", "a"], &["Y"], vec![]),
        ),
        (
            "Expand",
            GradCheck::new(17)
                .param("X", r.tensor(D, &[3, 1], -1.0, 1.0))
                .constant("s", ints(&[2, 3, 4]))
                .node("Expand", &["X", "s"], &["Y"], vec![]),
        ),
        (
            "Slice",
            GradCheck::new(17)
                .param("X", x(&mut r))
                .constant("st", ints(&[1, -3]))
                .constant("en", ints(&[3, 100]))
                .constant("ax", ints(&[1, 2]))
                .node("Slice", &["X", "st", "en", "ax"], &["Y"], vec![]),
        ),
    ];
    for (name, c) in cases {
        check(name, c, F64);
    }
}

#[test]
fn concat_split_where_gather() {
    let mut r = Rng::new(11);
    let c = GradCheck::new(17)
        .param("A", r.tensor(D, &[2, 1, 3], -1.0, 1.0))
        .param("B", r.tensor(D, &[2, 2, 3], -1.0, 1.0))
        .param("C", r.tensor(D, &[2, 3, 3], -1.0, 1.0))
        .node(
            "Concat",
            &["A", "B", "C"],
            &["Y"],
            vec![int_attr("axis", 1)],
        );
    check("Concat", c, F64);
    // One of the three outputs is unused: its gradient is zero.
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 6], -1.0, 1.0))
        .constant("sp", ints(&[1, 2, 3]))
        .node(
            "Split",
            &["X", "sp"],
            &["a", "b", "c"],
            vec![int_attr("axis", 1)],
        )
        .loss_of(&["a", "c"]);
    check("Split", c, F64);
    let cond = Tensor::new(
        vec![3, 1],
        pipetrain::tensor::TensorData::Bool(vec![true, false, true]),
    )
    .unwrap();
    let c = GradCheck::new(17)
        .constant("cond", cond)
        .param("A", r.tensor(D, &[3, 4], -1.0, 1.0))
        .param("B", r.tensor(D, &[4], -1.0, 1.0))
        .node("Where", &["cond", "A", "B"], &["Y"], vec![]);
    check("Where", c, F64);
    // Embedding lookup with repeated and negative indices: gradients of repeats add up.
    let c = GradCheck::new(17)
        .param("E", r.tensor(D, &[5, 3], -1.0, 1.0))
        .constant(
            "i",
            Tensor::i64(vec![2, 3], vec![0, 4, 0, -1, 2, 2]).unwrap(),
        )
        .node("Gather", &["E", "i"], &["Y"], vec![]);
    check("Gather axis 0", c, F64);
    let c = GradCheck::new(17)
        .param("E", r.tensor(D, &[2, 5, 3], -1.0, 1.0))
        .constant("i", Tensor::i64(vec![4], vec![1, 1, 3, 0]).unwrap())
        .node("Gather", &["E", "i"], &["Y"], vec![int_attr("axis", 1)]);
    check("Gather axis 1", c, F64);
}

#[test]
fn tied_parameter_accumulates_gradients() {
    // A weight used twice (embedding lookup and output projection, as in tied embeddings).
    let mut r = Rng::new(12);
    let c = GradCheck::new(17)
        .param("E", r.tensor(D, &[6, 4], -1.0, 1.0))
        .constant("tok", Tensor::i64(vec![3], vec![1, 5, 1]).unwrap())
        .node("Transpose", &["E"], &["Et"], vec![])
        .node("Gather", &["E", "tok"], &["h"], vec![])
        .node("Tanh", &["h"], &["t"], vec![])
        .node("MatMul", &["t", "Et"], &["Y"], vec![]);
    check("tied embedding", c, F64);
}
