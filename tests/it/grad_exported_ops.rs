//! The gradients of the operators that Hugging Face and torchvision exports add to the
//! ones in `grad_ops.rs` (ReLU6 and clamp as Clip, HardSwish, BatchNormalization in
//! training mode, rotary embeddings' Sin and Cos, RMSNorm's Reciprocal, ...), each
//! against central finite differences: float64 where ONNX Runtime has double kernels,
//! float32 (the tolerance of `common/gradcheck.rs`) where it has none.

use crate::common::gradcheck::{check, ints, GradCheck, Rng, F32, F64};
use pipetrain::graph::{float_attr, int_attr, ints_attr, string_attr};
use pipetrain::tensor::{DType, Tensor};

const D: DType = DType::F64;

fn scalar(dtype: DType, v: f64) -> Tensor {
    match dtype {
        DType::F64 => Tensor::f64(vec![], vec![v]).unwrap(),
        _ => Tensor::f32(vec![], vec![v as f32]).unwrap(),
    }
}

#[test]
fn smooth_unary_ops() {
    let mut r = Rng::new(21);
    for op in ["Sin", "Cos", "Reciprocal", "Abs"] {
        let x = if op == "Sin" || op == "Cos" {
            r.tensor(D, &[3, 4], -3.0, 3.0)
        } else {
            r.away_from_zero(D, &[3, 4], 0.3)
        };
        let c = GradCheck::new(17)
            .param("X", x)
            .node(op, &["X"], &["Y"], vec![]);
        check(op, c, F64);
    }
    // No double kernel for Softplus: float32.
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[3, 4], -3.0, 3.0))
        .node("Softplus", &["X"], &["Y"], vec![]);
    check("Softplus", c, F32);
}

#[test]
fn clip_with_either_bound_or_both() {
    let mut r = Rng::new(22);
    // ReLU6 as torch exports it (opset 11+: bounds are inputs); values stay away from
    // the bounds, where PyTorch's hardtanh passes no gradient.
    let x = r.away_from_zero(D, &[4, 5], 0.05);
    let c = GradCheck::new(17)
        .param("X", x.clone())
        .constant("lo", scalar(D, -0.5))
        .constant("hi", scalar(D, 0.5))
        .node("Clip", &["X", "lo", "hi"], &["Y"], vec![]);
    check("Clip [lo, hi]", c, F64);
    let c = GradCheck::new(17)
        .param("X", x.clone())
        .constant("lo", scalar(D, 0.0))
        .node("Clip", &["X", "lo"], &["Y"], vec![]);
    check("Clip [lo,)", c, F64);
    let c = GradCheck::new(17)
        .param("X", x)
        .constant("hi", scalar(D, 0.2))
        .node("Clip", &["X", "", "hi"], &["Y"], vec![]);
    check("Clip (, hi]", c, F64);
}

#[test]
fn hard_sigmoid_and_hard_swish() {
    let mut r = Rng::new(23);
    // Both sides of each kink: below -3, between, above 3 (no double kernels).
    let x = r.tensor(DType::F32, &[4, 6], -5.0, 5.0);
    let c = GradCheck::new(14)
        .param("X", x.clone())
        .node("HardSwish", &["X"], &["Y"], vec![]);
    check("HardSwish", c, F32);
    let c = GradCheck::new(14).param("X", x.clone()).node(
        "HardSigmoid",
        &["X"],
        &["Y"],
        vec![float_attr("alpha", 1.0 / 6.0), float_attr("beta", 0.5)],
    );
    check("HardSigmoid (PyTorch's)", c, F32);
    let c = GradCheck::new(14)
        .param("X", x)
        .node("HardSigmoid", &["X"], &["Y"], vec![]);
    check("HardSigmoid (ONNX defaults)", c, F32);
}

#[test]
fn min_max_sum_and_reduce_max() {
    let mut r = Rng::new(24);
    for op in ["Min", "Max"] {
        let c = GradCheck::new(17)
            .param("A", r.tensor(D, &[3, 4], -1.0, 1.0))
            .param("B", r.tensor(D, &[4], -1.0, 1.0))
            .node(op, &["A", "B"], &["Y"], vec![]);
        check(&format!("{op} broadcasting"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("A", r.tensor(D, &[2, 3], -1.0, 1.0))
        .param("B", r.tensor(D, &[3], -1.0, 1.0))
        .param("C", r.tensor(D, &[2, 1], -1.0, 1.0))
        .node("Sum", &["A", "B", "C"], &["Y"], vec![]);
    check("Sum of three, broadcasting", c, F64);
    for (axes, keep) in [(vec![1i64], 1i64), (vec![0, 2], 0), (vec![-1], 0)] {
        let c = GradCheck::new(18)
            .param("X", r.tensor(D, &[3, 4, 5], -1.0, 1.0))
            .constant("axes", ints(&axes))
            .node(
                "ReduceMax",
                &["X", "axes"],
                &["Y"],
                vec![int_attr("keepdims", keep)],
            );
        check(&format!("ReduceMax axes {axes:?} keepdims {keep}"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[3, 4], -1.0, 1.0))
        .node("ReduceMax", &["X"], &["Y"], vec![ints_attr("axes", &[1])]);
    check("ReduceMax opset 17 (axes attribute)", c, F64);
}

#[test]
fn batch_normalization_training_and_inference() {
    let mut r = Rng::new(25);
    for (shape, training) in [
        (&[4usize, 3, 5, 5][..], 1i64),
        (&[6, 4][..], 1),
        (&[4, 3, 5, 5][..], 0),
    ] {
        let c = shape[1];
        let case = GradCheck::new(15)
            .param("X", r.tensor(D, shape, -2.0, 2.0))
            .param("scale", r.tensor(D, &[c], 0.5, 1.5))
            .param("B", r.tensor(D, &[c], -0.5, 0.5))
            .constant("mean", r.tensor(D, &[c], -0.2, 0.2))
            .constant("var", r.tensor(D, &[c], 0.5, 1.5))
            .node(
                "BatchNormalization",
                &["X", "scale", "B", "mean", "var"],
                if training == 1 {
                    &["Y", "running_mean", "running_var"][..]
                } else {
                    &["Y"][..]
                },
                vec![
                    int_attr("training_mode", training),
                    float_attr("epsilon", 1e-5),
                    float_attr("momentum", 0.9),
                ],
            )
            .loss_of(&["Y"]);
        check(
            &format!("BatchNormalization {shape:?} training_mode={training}"),
            case,
            F64,
        );
    }
}

#[test]
fn tile_pad_and_cumsum() {
    let mut r = Rng::new(26);
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3], -1.0, 1.0))
        .constant("reps", ints(&[3, 2]))
        .node("Tile", &["X", "reps"], &["Y"], vec![]);
    check("Tile", c, F64);
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
        .constant("pads", ints(&[0, 1, 2, 1, 0, 3]))
        .node("Pad", &["X", "pads"], &["Y"], vec![]);
    check("Pad constant", c, F64);
    let c = GradCheck::new(18)
        .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
        .constant("pads", ints(&[1, 2, 0, 1]))
        .constant("axes", ints(&[0, -1]))
        .node("Pad", &["X", "pads", "", "axes"], &["Y"], vec![]);
    check("Pad with axes (opset 18)", c, F64);
    for (exclusive, reverse) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[3, 4], -1.0, 1.0))
            .constant("axis", Tensor::i64(vec![], vec![1]).unwrap())
            .node(
                "CumSum",
                &["X", "axis"],
                &["Y"],
                vec![
                    int_attr("exclusive", exclusive),
                    int_attr("reverse", reverse),
                ],
            );
        check(
            &format!("CumSum exclusive={exclusive} reverse={reverse}"),
            c,
            F64,
        );
    }
}

/// Shape arithmetic as exporters write it (Llama's rotary embedding halves the head with
/// `Shape -> Gather -> Div -> Unsqueeze -> Slice`; positions come from `Range` on a
/// shape): folded to constants before autodiff, so the Slice bounds, the Reshape shape
/// and the rotary angles are constants and the graph differentiates.
#[test]
fn slice_reshape_and_angles_computed_from_shapes() {
    let mut r = Rng::new(27);
    let i64s = |v: i64| Tensor::i64(vec![], vec![v]).unwrap();
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 8], -1.0, 1.0))
        .constant("one", i64s(1))
        .constant("two", i64s(2))
        .constant("last", i64s(-1))
        .constant("zero1", ints(&[0]))
        .constant("axis2", ints(&[2]))
        .constant("axis0", ints(&[0]))
        .constant("big", ints(&[i64::MAX]))
        .constant("start", i64s(0))
        .constant("step", i64s(1))
        .constant("minus1", ints(&[-1]))
        // half = Shape(X)[-1] / 2
        .node("Shape", &["X"], &["sx"], vec![])
        .node("Gather", &["sx", "last"], &["d"], vec![int_attr("axis", 0)])
        .node("Div", &["d", "two"], &["h"], vec![])
        .node("Unsqueeze", &["h", "axis0"], &["hu"], vec![])
        .node("Slice", &["X", "zero1", "hu", "axis2"], &["x1"], vec![])
        .node("Slice", &["X", "hu", "big", "axis2"], &["x2"], vec![])
        .node("Neg", &["x2"], &["nx2"], vec![])
        .node(
            "Concat",
            &["nx2", "x1"],
            &["rot"],
            vec![int_attr("axis", -1)],
        )
        // angles[t, k] = t * (k + 1): positions from Range on Shape(X)[1]
        .node("Gather", &["sx", "one"], &["t"], vec![int_attr("axis", 0)])
        .node("Range", &["start", "t", "step"], &["pos"], vec![])
        .node("Cast", &["pos"], &["posf"], vec![int_attr("to", 11)])
        .node("Unsqueeze", &["posf", "last"], &["pcol"], vec![])
        .node("Range", &["start", "d", "step"], &["k"], vec![])
        .node("Cast", &["k"], &["kf"], vec![int_attr("to", 11)])
        .node("Mul", &["pcol", "kf"], &["ang"], vec![])
        .node("Cos", &["ang"], &["cos"], vec![])
        .node("Sin", &["ang"], &["sin"], vec![])
        .node("Mul", &["X", "cos"], &["xc"], vec![])
        .node("Mul", &["rot", "sin"], &["rs"], vec![])
        .node("Add", &["xc", "rs"], &["Y0"], vec![])
        // Reshape to [Shape(X)[0], -1] and a ReduceSum over an axis computed the same way.
        .node(
            "Gather",
            &["sx", "start"],
            &["b"],
            vec![int_attr("axis", 0)],
        )
        .node("Unsqueeze", &["b", "axis0"], &["bu"], vec![])
        .node(
            "Concat",
            &["bu", "minus1"],
            &["shape"],
            vec![int_attr("axis", 0)],
        )
        .node("Reshape", &["Y0", "shape"], &["Y1"], vec![])
        .node("Sub", &["one", "start"], &["ax"], vec![])
        .node("Unsqueeze", &["ax", "axis0"], &["axes"], vec![])
        .node(
            "ReduceSum",
            &["Y1", "axes"],
            &["Y"],
            vec![int_attr("keepdims", 1)],
        )
        .loss_of(&["Y"]);
    check("rotary-style shape arithmetic", c, F64);
}

#[test]
fn instance_normalization() {
    let mut r = Rng::new(28);
    let case = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[2, 3, 4, 5], -2.0, 2.0))
        .param("scale", r.tensor(DType::F32, &[3], 0.5, 1.5))
        .param("B", r.tensor(DType::F32, &[3], -0.5, 0.5))
        .node(
            "InstanceNormalization",
            &["X", "scale", "B"],
            &["Y"],
            vec![float_attr("epsilon", 1e-5)],
        );
    // No double kernel for InstanceNormalization: float32.
    check("InstanceNormalization", case, F32);
}

/// Attention's contractions and others, two operands and one, with an index the operand
/// sums alone (broadcast back).
#[test]
fn einsum_two_operands_and_one() {
    let mut r = Rng::new(29);
    for (eq, sa, sb) in [
        ("bhqd,bhkd->bhqk", &[2, 2, 3, 4][..], &[2, 2, 5, 4][..]),
        ("bhqk,bhkd->bhqd", &[2, 2, 3, 5][..], &[2, 2, 5, 4][..]),
        ("ij,jk->ik", &[3, 4][..], &[4, 5][..]),
        ("i,j->ij", &[3][..], &[4][..]),
        ("ij,k->i", &[3, 4][..], &[5][..]),
    ] {
        let c = GradCheck::new(17)
            .param("A", r.tensor(D, sa, -1.0, 1.0))
            .param("B", r.tensor(D, sb, -1.0, 1.0))
            .node(
                "Einsum",
                &["A", "B"],
                &["Y"],
                vec![string_attr("equation", eq)],
            );
        check(&format!("Einsum {eq}"), c, F64);
    }
    for eq in ["ij->ji", "ijk->ik"] {
        let c = GradCheck::new(17)
            .param(
                "A",
                r.tensor(
                    D,
                    &[3, 4, 2][..eq.split("->").next().unwrap().len()],
                    -1.0,
                    1.0,
                ),
            )
            .node("Einsum", &["A"], &["Y"], vec![string_attr("equation", eq)]);
        check(&format!("Einsum {eq}"), c, F64);
    }
}
