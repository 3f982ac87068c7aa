//! Operators ONNX Runtime's training build cannot differentiate, against finite
//! differences: GridSample (`torch.nn.functional.grid_sample`), LpPool and GlobalLpPool,
//! ReduceProd (with zeros among its inputs), LRN, MaxUnpool, Compress, CenterCropPad,
//! Col2Im, Det. Float32 where ONNX Runtime has no float64
//! kernel.

use crate::common::gradcheck::{check, ints, GradCheck, Rng, Tol, F32, F64};
use pipetrain::graph::{int_attr, ints_attr, string_attr};
use pipetrain::tensor::{DType, Tensor, TensorData};

const D: DType = DType::F32;

/// A grid whose pixel coordinates are an integer plus 0.2-0.8 (never within a finite
/// difference's step of a corner, where the bilinear weights' slopes jump), from one
/// pixel before the input to one after it, so that corners fall outside.
fn grid(r: &mut Rng, ho: usize, wo: usize, (h, w): (usize, usize), align: bool) -> Tensor {
    let mut v = Vec::with_capacity(ho * wo * 2);
    for _ in 0..ho * wo {
        for size in [w, h] {
            let pixel = r.uniform(-1.0, size as f64).floor() + r.uniform(0.2, 0.8);
            // The inverse of ix = a g + (size - 1) / 2.
            let a = if align {
                (size as f64 - 1.0) / 2.0
            } else {
                size as f64 / 2.0
            };
            v.push(((pixel - (size as f64 - 1.0) / 2.0) / a) as f32);
        }
    }
    Tensor::new(vec![1, ho, wo, 2], TensorData::F32(v)).unwrap()
}

/// GridSample (bilinear; `zeros` and `border` padding, either `align_corners`), which
/// ONNX Runtime's training build cannot differentiate: the input's gradient and the
/// grid's against finite differences.
#[test]
fn grid_sample_matches_finite_differences() {
    let mut r = Rng::new(41);
    for padding in ["zeros", "border"] {
        for align in [0, 1] {
            let g = grid(&mut r, 3, 4, (5, 6), align == 1);
            let c = GradCheck::new(17)
                .param("X", r.tensor(D, &[1, 2, 5, 6], -1.0, 1.0))
                .param("G", g)
                .node(
                    "GridSample",
                    &["X", "G"],
                    &["Y"],
                    vec![
                        string_attr("padding_mode", padding),
                        int_attr("align_corners", align),
                    ],
                );
            let fine = Tol {
                step: 1e-3,
                rtol: 5e-3,
                atol: 5e-3,
            };
            check(
                &format!("GridSample {padding} align_corners {align}"),
                c,
                fine,
            );
        }
    }
}

/// LpPool (p 1, 2 and 3; strides and pads) and GlobalLpPool (p 1, 2, 3), inputs away
/// from 0 (where `|x|` bends).
#[test]
fn lp_pools_match_finite_differences() {
    let mut r = Rng::new(43);
    for p in [1, 2, 3] {
        let c = GradCheck::new(18)
            .param("X", r.away_from_zero(D, &[1, 2, 5, 6], 0.05))
            .node(
                "LpPool",
                &["X"],
                &["Y"],
                vec![
                    int_attr("p", p),
                    ints_attr("kernel_shape", &[3, 2]),
                    ints_attr("strides", &[2, 1]),
                    ints_attr("pads", &[1, 0, 1, 1]),
                ],
            );
        check(&format!("LpPool p {p}"), c, F32);
        let c = GradCheck::new(17)
            .param("X", r.away_from_zero(D, &[2, 3, 4, 3], 0.05))
            .node("GlobalLpPool", &["X"], &["Y"], vec![int_attr("p", p)]);
        check(&format!("GlobalLpPool p {p}"), c, F32);
    }
}

/// ReduceProd over inputs without zeros, with one zero in a group (its gradient is the
/// product of the others) and with two (all 0), at opset 17 (axes an attribute) and 18
/// (an input).
#[test]
fn reduce_prod_matches_finite_differences_with_zeros() {
    let mut r = Rng::new(47);
    let mut x = r.away_from_zero(DType::F64, &[3, 4], 0.3).to_f64_vec();
    x[5] = 0.0; // row 1: one zero
    x[8] = 0.0; // row 2: two zeros
    x[10] = 0.0;
    let x = Tensor::f64(vec![3, 4], x).unwrap();
    let c = GradCheck::new(17).param("X", x.clone()).node(
        "ReduceProd",
        &["X"],
        &["Y"],
        vec![ints_attr("axes", &[1]), int_attr("keepdims", 0)],
    );
    check("ReduceProd opset 17, axis 1", c, F64);
    let c = GradCheck::new(18)
        .param("X", x)
        .constant("A", ints(&[0]))
        .node("ReduceProd", &["X", "A"], &["Y"], vec![]);
    check("ReduceProd opset 18, axis 0", c, F64);
}

/// LRN with windows of 1, 3 and 5 channels and one wider than the channels (ONNX
/// Runtime's kernel takes odd sizes only).
#[test]
fn lrn_matches_finite_differences() {
    let mut r = Rng::new(53);
    for size in [1, 3, 5, 7] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &[2, 5, 3, 2], -2.0, 2.0))
            .node(
                "LRN",
                &["X"],
                &["Y"],
                vec![
                    int_attr("size", size),
                    pipetrain::graph::float_attr("alpha", 0.3),
                    pipetrain::graph::float_attr("beta", 0.75),
                    pipetrain::graph::float_attr("bias", 1.5),
                ],
            );
        check(&format!("LRN size {size}"), c, F32);
    }
}

/// MaxUnpool at indices a 2 x 2 MaxPool would give; Compress of a constant condition
/// along an axis, shorter than it, and of the flattened input; CenterCropPad cropping one
/// axis, padding another, leaving a third.
#[test]
fn unpooling_compressing_and_cropping_match_finite_differences() {
    let mut r = Rng::new(59);
    let mut picks = Vec::new();
    for plane in 0..2i64 {
        for (i, j) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            let (di, dj) = ((plane + i) % 2, (plane + j + 1) % 2);
            picks.push(plane * 16 + (2 * i + di) * 4 + 2 * j + dj);
        }
    }
    let c = GradCheck::new(17)
        .param("X", r.tensor(D, &[1, 2, 2, 2], -1.0, 1.0))
        .constant("I", Tensor::i64(vec![1, 2, 2, 2], picks).unwrap())
        .node(
            "MaxUnpool",
            &["X", "I"],
            &["Y"],
            vec![
                ints_attr("kernel_shape", &[2, 2]),
                ints_attr("strides", &[2, 2]),
            ],
        );
    check("MaxUnpool", c, F32);
    let keep = |v: &[bool]| Tensor::new(vec![v.len()], TensorData::Bool(v.to_vec())).unwrap();
    for (name, cond, axis) in [
        ("axis 0", keep(&[true, false, true]), Some(0)),
        (
            "axis 1, a shorter condition",
            keep(&[false, true, true]),
            Some(1),
        ),
        (
            "flattened",
            keep(&[true, false, false, true, true, false, true]),
            None,
        ),
    ] {
        let attrs = axis.map(|a| vec![int_attr("axis", a)]).unwrap_or_default();
        let c = GradCheck::new(17)
            .param("X", r.tensor(DType::F64, &[3, 4], -1.0, 1.0))
            .constant("C", cond)
            .node("Compress", &["X", "C"], &["Y"], attrs);
        check(&format!("Compress {name}"), c, F64);
    }
    for target in [[2, 7, 3], [5, 2, 3]] {
        let c = GradCheck::new(18)
            .param("X", r.tensor(DType::F64, &[4, 5, 3], -1.0, 1.0))
            .constant("S", ints(&target))
            .node("CenterCropPad", &["X", "S"], &["Y"], vec![]);
        check(&format!("CenterCropPad to {target:?}"), c, F64);
    }
}

/// Col2Im (`F.fold`): blocks that overlap (stride 1), and blocks spread by dilation,
/// stride and pads.
#[test]
fn col2im_matches_finite_differences() {
    let mut r = Rng::new(61);
    // image 5 x 4, block 2 x 3, stride 1: 4 x 2 = 8 blocks.
    let plain = GradCheck::new(18)
        .param("X", r.tensor(D, &[2, 2 * 6, 8], -1.0, 1.0))
        .constant("I", ints(&[5, 4]))
        .constant("B", ints(&[2, 3]))
        .node("Col2Im", &["X", "I", "B"], &["Y"], vec![]);
    check("Col2Im, overlapping blocks", plain, F32);
    // image 6 x 7, block 2 x 2, dilation 2, stride 2, pads 1: 3 x 4 = 12 blocks.
    let spread = GradCheck::new(18)
        .param("X", r.tensor(D, &[1, 3 * 4, 12], -1.0, 1.0))
        .constant("I", ints(&[6, 7]))
        .constant("B", ints(&[2, 2]))
        .node(
            "Col2Im",
            &["X", "I", "B"],
            &["Y"],
            vec![
                ints_attr("dilations", &[2, 2]),
                ints_attr("strides", &[2, 2]),
                ints_attr("pads", &[1, 1, 1, 1]),
            ],
        );
    check("Col2Im, dilated, strided, padded", spread, F32);
}

/// Det: the cofactors, batched, of a singular matrix (rank 2 of 3: the gradient is not
/// zero), of 1 x 1 and 2 x 2 matrices; above 16 x 16, det(X) inverse(X)^T through ONNX
/// Runtime's contrib `Inverse`, and refused without contrib ops.
#[test]
fn det_matches_finite_differences() {
    let mut r = Rng::new(59);
    for shape in [vec![2, 3, 3], vec![4, 1, 1], vec![2, 2], vec![2, 1, 5, 5]] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(D, &shape, -1.0, 1.0))
            .node("Det", &["X"], &["Y"], vec![]);
        check(&format!("Det {shape:?}"), c, F32);
    }
    // Row 2 = row 0 + row 1: det 0, cofactors not all 0.
    let mut x = r.tensor(D, &[3, 3], -1.0, 1.0).to_f64_vec();
    for j in 0..3 {
        x[6 + j] = x[j] + x[3 + j];
    }
    let singular = Tensor::f32(vec![3, 3], x.iter().map(|&v| v as f32).collect()).unwrap();
    let c = GradCheck::new(17)
        .param("X", singular)
        .node("Det", &["X"], &["Y"], vec![]);
    check("Det of a singular matrix", c, F32);
    // 17 x 17 near the identity (a determinant of moderate size).
    let n = 17;
    let mut big = r.tensor(D, &[n, n], -0.05, 0.05).to_f64_vec();
    for i in 0..n {
        big[i * n + i] += 1.0;
    }
    let big = Tensor::f32(vec![n, n], big.iter().map(|&v| v as f32).collect()).unwrap();
    let case = || {
        GradCheck::new(17)
            .param("X", big.clone())
            .node("Det", &["X"], &["Y"], vec![])
    };
    check("Det 17 x 17 by the inverse", case(), F32);
    let rt = crate::common::runtime();
    let err = case().without_contrib().run(&rt, F32).unwrap_err();
    assert!(err.contains("need an inverse"), "{err}");
}
