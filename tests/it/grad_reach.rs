//! The operators and forms ONNX Runtime's training build differentiates that pipetrain
//! once refused, against central finite differences: the index operators (GatherElements,
//! GatherND, ScatterElements, ScatterND, TopK, Trilu), the reductions (ReduceL2,
//! ReduceL1, ReduceSumSquare, ReduceLogSum, ReduceLogSumExp, ReduceMin), Atan,
//! GlobalMaxPool, GroupNormalization, strided and reversed Slice, Pad in every mode and
//! with negative pads, Min/Max of several inputs, SoftmaxCrossEntropyLoss with class
//! weights, and Einsum with ellipses, three operands and repeated indices.

use crate::common::gradcheck::{check, ints, GradCheck, Rng, F32, F64};
use pipetrain::graph::{float_attr, int_attr, ints_attr, string_attr};
use pipetrain::tensor::{DType, Tensor};

const D: DType = DType::F64;

fn i64s(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::i64(shape.to_vec(), v.to_vec()).unwrap()
}

#[test]
fn gathers_and_scatters() {
    let mut r = Rng::new(31);
    // Repeated indices: the gathered gradients add up.
    for axis in [0i64, 1, -1] {
        let idx = match axis {
            0 => i64s(&[2, 3], &[0, 2, 1, 2, 2, 0]),
            _ => i64s(&[3, 2], &[0, 0, 2, -1, 1, 0]),
        };
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[3, 3], -1.0, 1.0))
            .constant("I", idx)
            .node(
                "GatherElements",
                &["X", "I"],
                &["Y"],
                vec![int_attr("axis", axis)],
            );
        check(&format!("GatherElements axis {axis}"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
        .constant("I", i64s(&[3, 2], &[0, 1, 1, 2, 0, 1]))
        .node("GatherND", &["X", "I"], &["Y"], vec![]);
    check("GatherND slices, an index twice", c, F64);
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
        .constant("I", i64s(&[2, 2, 1], &[2, -1, 0, 0]))
        .node(
            "GatherND",
            &["X", "I"],
            &["Y"],
            vec![int_attr("batch_dims", 1)],
        );
    check("GatherND batch_dims 1, negative index", c, F64);
    for reduction in ["none", "add"] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[3, 4], -1.0, 1.0))
            .param("U", r.tensor(D, &[2, 4], -1.0, 1.0))
            .constant("I", i64s(&[2, 4], &[1, 0, 2, 1, 0, 2, 1, 0]))
            .node(
                "ScatterElements",
                &["X", "I", "U"],
                &["Y"],
                vec![int_attr("axis", 0), string_attr("reduction", reduction)],
            );
        check(&format!("ScatterElements reduction {reduction}"), c, F64);
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[4, 3], -1.0, 1.0))
            .param("U", r.tensor(D, &[2, 3], -1.0, 1.0))
            .constant("I", i64s(&[2, 1], &[3, 1]))
            .node(
                "ScatterND",
                &["X", "I", "U"],
                &["Y"],
                vec![string_attr("reduction", reduction)],
            );
        check(&format!("ScatterND reduction {reduction}"), c, F64);
    }
}

#[test]
fn top_k_and_trilu() {
    let mut r = Rng::new(32);
    for (largest, axis) in [(1, -1), (0, 0)] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[4, 5], -1.0, 1.0))
            .constant("K", ints(&[3]))
            .node(
                "TopK",
                &["X", "K"],
                &["V", "I"],
                vec![int_attr("axis", axis), int_attr("largest", largest)],
            )
            .loss_of(&["V"]);
        check(&format!("TopK largest {largest} axis {axis}"), c, F64);
    }
    for (upper, k) in [(1, 0i64), (0, -1), (1, 2)] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 4, 5], -1.0, 1.0))
            .constant("k", Tensor::i64(vec![], vec![k]).unwrap())
            .node("Trilu", &["X", "k"], &["Y"], vec![int_attr("upper", upper)]);
        check(&format!("Trilu upper {upper} k {k}"), c, F64);
    }
}

#[test]
fn reductions_atan_and_global_max_pool() {
    let mut r = Rng::new(33);
    for op in [
        "ReduceL2",
        "ReduceL1",
        "ReduceSumSquare",
        "ReduceLogSumExp",
        "ReduceMin",
    ] {
        for keep in [0, 1] {
            let c = GradCheck::new(17)
                .param("X", r.away_from_zero(D, &[2, 3, 4], 0.05))
                .node(
                    op,
                    &["X"],
                    &["Y"],
                    vec![ints_attr("axes", &[1, -1]), int_attr("keepdims", keep)],
                );
            check(&format!("{op} opset 17 keepdims {keep}"), c, F64);
        }
        let c = GradCheck::new(18)
            .param("X", r.away_from_zero(D, &[2, 3, 4], 0.05))
            .constant("axes", ints(&[0]))
            .node(op, &["X", "axes"], &["Y"], vec![]);
        check(&format!("{op} opset 18"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 4], 0.5, 2.0))
        .node(
            "ReduceLogSum",
            &["X"],
            &["Y"],
            vec![ints_attr("axes", &[2])],
        );
    check("ReduceLogSum", c, F64);
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[3, 4], -2.0, 2.0))
        .node("Atan", &["X"], &["Y"], vec![]);
    check("Atan", c, F32);
    let c = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[2, 3, 4, 5], -1.0, 1.0))
        .node("GlobalMaxPool", &["X"], &["Y"], vec![]);
    check("GlobalMaxPool", c, F32);
}

#[test]
fn group_normalization_per_group_and_per_channel() {
    let mut r = Rng::new(34);
    for (opset, params) in [(18, 2), (21, 6)] {
        let c = GradCheck::new(opset)
            .param("X", r.tensor(DType::F32, &[2, 6, 3, 2], -1.0, 1.0))
            .param("S", r.tensor(DType::F32, &[params], 0.5, 1.5))
            .param("B", r.tensor(DType::F32, &[params], -0.5, 0.5))
            .node(
                "GroupNormalization",
                &["X", "S", "B"],
                &["Y"],
                vec![int_attr("num_groups", 2), float_attr("epsilon", 1e-5)],
            );
        check(&format!("GroupNormalization opset {opset}"), c, F32);
    }
}

/// A Slice's starts, ends, axes and steps.
type SliceCase<'a> = (&'a [i64], &'a [i64], &'a [i64], &'a [i64]);

#[test]
fn strided_and_reversed_slices() {
    let mut r = Rng::new(35);
    // (starts, ends, axes, steps) on X [6, 7]: every other channel as GPT-J's rotary
    // reads them, a window with stride 3, reversed, reversed with stride, out of range.
    let cases: [SliceCase; 6] = [
        (&[0], &[i64::MAX], &[1], &[2]),
        (&[1], &[i64::MAX], &[1], &[2]),
        (&[1, 0], &[6, 7], &[0, 1], &[3, 2]),
        (&[-1], &[i64::MIN], &[0], &[-1]),
        (&[5, -2], &[0, 0], &[0, 1], &[-2, -3]),
        (&[-100, 2], &[100, 3], &[1, 0], &[4, 1]),
    ];
    for (st, en, ax, sp) in cases {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[6, 7], -1.0, 1.0))
            .constant("st", ints(st))
            .constant("en", ints(en))
            .constant("ax", ints(ax))
            .constant("sp", ints(sp))
            .node("Slice", &["X", "st", "en", "ax", "sp"], &["Y"], vec![]);
        check(
            &format!("Slice {st:?}:{en:?} axes {ax:?} steps {sp:?}"),
            c,
            F64,
        );
    }
}

#[test]
fn pad_in_every_mode() {
    let mut r = Rng::new(36);
    let pads: [&[i64]; 3] = [&[1, 2, 2, 1], &[0, 3, 1, 0], &[2, 0, 0, 2]];
    for mode in ["constant", "reflect", "edge", "wrap"] {
        for p in pads {
            let opset = if mode == "wrap" { 19 } else { 18 };
            let c = GradCheck::new(opset)
                .param("X", r.tensor(D, &[2, 3, 4], -1.0, 1.0))
                .constant("p", ints(p))
                .constant("ax", ints(&[1, 2]))
                .node(
                    "Pad",
                    &["X", "p", "", "ax"],
                    &["Y"],
                    vec![string_attr("mode", mode)],
                );
            check(&format!("Pad {mode} {p:?}"), c, F64);
        }
    }
    // Negative pads crop; the constant's own gradient.
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[3, 5], -1.0, 1.0))
        .param("v", Tensor::f64(vec![], vec![0.3]).unwrap())
        .constant("p", ints(&[1, -2, -1, 2]))
        .node("Pad", &["X", "p", "v"], &["Y"], vec![]);
    check("Pad negative pads, trained constant", c, F64);
}

#[test]
fn min_max_of_several_inputs() {
    let mut r = Rng::new(37);
    for op in ["Min", "Max"] {
        let c = GradCheck::new(17)
            .param("A", r.tensor(D, &[2, 3], -1.0, 1.0))
            .param("B", r.tensor(D, &[3], -1.0, 1.0))
            .param("C", r.tensor(D, &[2, 1], -1.0, 1.0))
            .param("E", r.tensor(D, &[2, 3], -1.0, 1.0))
            .node(op, &["A", "B", "C", "E"], &["Y"], vec![]);
        check(&format!("{op} of 4 inputs, broadcast"), c, F64);
    }
}

#[test]
fn softmax_cross_entropy_with_class_weights() {
    let mut r = Rng::new(38);
    for (reduction, ignore) in [
        ("mean", None),
        ("mean", Some(1)),
        ("sum", Some(0)),
        ("none", None),
    ] {
        let mut attrs = vec![string_attr("reduction", reduction)];
        if let Some(i) = ignore {
            attrs.push(int_attr("ignore_index", i));
        }
        let c = GradCheck::new(17)
            .param("S", r.tensor(D, &[4, 3, 2], -2.0, 2.0))
            .constant("L", i64s(&[4, 2], &[0, 1, 2, 1, 1, 0, 2, 2]))
            .constant("W", Tensor::f64(vec![3], vec![0.2, 1.5, 0.7]).unwrap())
            .node(
                "SoftmaxCrossEntropyLoss",
                &["S", "L", "W"],
                &["Y", "P"],
                attrs,
            )
            .loss_of(&["Y"]);
        check(
            &format!("SoftmaxCrossEntropyLoss weights, {reduction}, ignore {ignore:?}"),
            c,
            F64,
        );
    }
}

#[test]
fn einsum_ellipses_three_operands_and_diagonals() {
    let mut r = Rng::new(39);
    let cases: [(&str, &[&[usize]]); 8] = [
        ("...ij,...jk->...ik", &[&[2, 3, 4], &[2, 4, 5]]),
        ("...ij,jk", &[&[2, 2, 3, 4], &[4, 5]]),
        ("bij,bjk,bkl->bil", &[&[2, 3, 4], &[2, 4, 2], &[2, 2, 3]]),
        ("ii->i", &[&[4, 4]]),
        ("bii->b", &[&[2, 3, 3]]),
        ("ij,jj->i", &[&[2, 3], &[3, 3]]),
        ("...i,...i->...", &[&[3, 2, 4], &[3, 2, 4]]),
        ("ij,jk", &[&[2, 3], &[3, 4]]),
    ];
    for (eq, shapes) in cases {
        let names = ["A", "B", "C"];
        let mut c = GradCheck::new(17);
        for (k, s) in shapes.iter().enumerate() {
            c = c.param(names[k], r.tensor(D, s, -1.0, 1.0));
        }
        let c = c.node(
            "Einsum",
            &names[..shapes.len()],
            &["Y"],
            vec![string_attr("equation", eq)],
        );
        check(&format!("Einsum {eq}"), c, F64);
    }
}

/// The check in float64 where ONNX Runtime's CPU provider has a double kernel for the
/// operator, else in float32 (with its tolerance).
fn in_double_or_single(name: &str, case: impl Fn(DType) -> GradCheck) {
    let rt = crate::common::runtime();
    match case(D).run(&rt, F64) {
        Ok(worst) => eprintln!("{name} (float64): worst error {worst:.3} of tolerance"),
        Err(e) if e.contains("Could not find an implementation") || e.contains("Type Error") => {
            check(name, case(DType::F32), F32)
        }
        Err(e) => panic!("{name}: {e}"),
    }
}

#[test]
fn more_elementwise_functions() {
    let mut r = Rng::new(40);
    let cases: [(&str, f64, f64, Vec<pipetrain::onnx::proto::AttributeProto>); 16] = [
        ("Asin", -0.9, 0.9, vec![]),
        ("Acos", -0.9, 0.9, vec![]),
        ("Atanh", -0.9, 0.9, vec![]),
        ("Asinh", -2.0, 2.0, vec![]),
        ("Acosh", 1.1, 3.0, vec![]),
        ("Sinh", -2.0, 2.0, vec![]),
        ("Cosh", -2.0, 2.0, vec![]),
        ("Tan", -1.2, 1.2, vec![]),
        ("Elu", -2.0, 2.0, vec![float_attr("alpha", 0.7)]),
        ("Celu", -2.0, 2.0, vec![float_attr("alpha", 1.3)]),
        ("Selu", -2.0, 2.0, vec![]),
        ("Mish", -3.0, 3.0, vec![]),
        ("Softsign", -3.0, 3.0, vec![]),
        ("ThresholdedRelu", -2.0, 2.0, vec![float_attr("alpha", 0.5)]),
        (
            "Shrink",
            -2.0,
            2.0,
            vec![float_attr("lambd", 0.6), float_attr("bias", 0.2)],
        ),
        (
            "LpNormalization",
            -2.0,
            2.0,
            vec![int_attr("p", 1), int_attr("axis", 0)],
        ),
    ];
    for (op, lo, hi, attrs) in cases {
        // Away from the kinks: pick values not near 0 (and not near the thresholds).
        let x = loop {
            let t = r.tensor(D, &[3, 4], lo, hi);
            if t.to_f64_vec().iter().all(|v| {
                (v.abs() - 0.5).abs() > 0.05 && (v.abs() - 0.6).abs() > 0.05 && v.abs() > 0.05
            }) {
                break t;
            }
        };
        let case = |float| {
            GradCheck::new(18)
                .param("X", crate::common::gradcheck::cast(&x, float))
                .node(op, &["X"], &["Y"], attrs.clone())
        };
        match op {
            // ONNX Runtime's double Shrink rounds through float32.
            "Shrink" => check(op, case(DType::F32), F32),
            _ => in_double_or_single(op, case),
        }
    }
    let c = GradCheck::new(17)
        .param("X", r.away_from_zero(D, &[3, 4], 0.1))
        .node("LpNormalization", &["X"], &["Y"], vec![int_attr("p", 2)]);
    check("LpNormalization p 2", c, F64);
}

#[test]
fn prelu_mod_mean_and_moving_channels() {
    let mut r = Rng::new(41);
    let c = GradCheck::new(17)
        .param("X", r.away_from_zero(D, &[2, 3, 4], 0.1))
        .param("S", r.tensor(D, &[3, 1], 0.1, 0.5))
        .node("PRelu", &["X", "S"], &["Y"], vec![]);
    check("PRelu, slope per channel", c, F64);
    // Floats take fmod = 1 only (C's fmod, the quotient toward zero).
    let c = GradCheck::new(17)
        .param("A", r.tensor(D, &[3, 4], -5.0, 5.0))
        .param("B", r.tensor(D, &[4], 0.7, 1.9))
        .node("Mod", &["A", "B"], &["Y"], vec![int_attr("fmod", 1)]);
    check("Mod fmod 1", c, F64);
    let (a, b, c) = (
        r.tensor(D, &[2, 3], -1.0, 1.0),
        r.tensor(D, &[3], -1.0, 1.0),
        r.tensor(D, &[2, 1], -1.0, 1.0),
    );
    in_double_or_single("Mean of 3, broadcast", |float| {
        let cast = |t: &Tensor| crate::common::gradcheck::cast(t, float);
        GradCheck::new(17)
            .param("A", cast(&a))
            .param("B", cast(&b))
            .param("C", cast(&c))
            .node("Mean", &["A", "B", "C"], &["Y"], vec![])
    });
    for mode in ["DCR", "CRD"] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 8, 2, 3], -1.0, 1.0))
            .node(
                "DepthToSpace",
                &["X"],
                &["Y"],
                vec![int_attr("blocksize", 2), string_attr("mode", mode)],
            );
        check(&format!("DepthToSpace {mode}"), c, F64);
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[2, 3, 4, 6], -1.0, 1.0))
        .node(
            "SpaceToDepth",
            &["X"],
            &["Y"],
            vec![int_attr("blocksize", 2)],
        );
    check("SpaceToDepth", c, F64);
    let x = r.tensor(D, &[2, 3, 4, 5], -1.0, 1.0);
    in_double_or_single("MeanVarianceNormalization", |float| {
        GradCheck::new(17)
            .param("X", crate::common::gradcheck::cast(&x, float))
            .node("MeanVarianceNormalization", &["X"], &["Y"], vec![])
    });
    for (reduction, ignore) in [("mean", Some(2)), ("sum", None), ("none", Some(0))] {
        let mut attrs = vec![string_attr("reduction", reduction)];
        if let Some(i) = ignore {
            attrs.push(int_attr("ignore_index", i));
        }
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[4, 3, 2], -2.0, 0.0))
            .constant("T", i64s(&[4, 2], &[0, 1, 2, 1, 1, 0, 2, 2]))
            .constant("W", Tensor::f64(vec![3], vec![0.2, 1.5, 0.7]).unwrap())
            .node("NegativeLogLikelihoodLoss", &["X", "T", "W"], &["Y"], attrs);
        check(
            &format!("NegativeLogLikelihoodLoss {reduction} ignore {ignore:?}"),
            c,
            F64,
        );
    }
}
