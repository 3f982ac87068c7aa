//! Conv, MaxPool, AveragePool and GlobalAveragePool gradients against central finite
//! differences. ONNX Runtime has double kernels for MaxPool (with Indices) and
//! ScatterElements, so MaxPool is checked in float64 within 1e-4; it has none for Conv,
//! ConvTranspose, AveragePool or GlobalAveragePool, so those are checked in float32 with
//! the tolerance justified in `common/gradcheck.rs` (these ops are linear, so the finite
//! difference has no truncation error, only rounding).

use crate::common;

use crate::common::gradcheck::{GradCheck, Rng, Tol, F32, F64};
use pipetrain::graph::{int_attr, ints_attr, string_attr};
use pipetrain::onnx::proto::AttributeProto;
use pipetrain::tensor::{DType, Tensor};

fn check(name: &str, case: GradCheck, tol: Tol) {
    let rt = common::runtime();
    match case.run(&rt, tol) {
        Ok(worst) => eprintln!("{name}: worst error {worst:.3} of tolerance"),
        Err(e) => panic!("{name}: {e}"),
    }
}

/// The elements of a tensor of `shape`: distinct values 0.1 apart in random order, so
/// that MaxPool has no ties and a 1e-6 step never changes a window's maximum.
fn distinct(r: &mut Rng, shape: &[usize]) -> Vec<f64> {
    let n: usize = shape.iter().product();
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * 0.1 - n as f64 * 0.05).collect();
    for i in (1..n).rev() {
        let j = (r.next() * (i + 1) as f64) as usize;
        v.swap(i, j.min(i));
    }
    v
}

/// A Conv check in float32: X and W (and B when `bias`) are all checked.
fn conv_case(
    r: &mut Rng,
    sx: &[usize],
    sw: &[usize],
    bias: bool,
    attrs: Vec<AttributeProto>,
) -> GradCheck {
    const T: DType = DType::F32;
    let mut c = GradCheck::new(17)
        .param("X", r.tensor(T, sx, -1.0, 1.0))
        .param("W", r.tensor(T, sw, -1.0, 1.0));
    let inputs: &[&str] = if bias {
        c = c.param("B", r.tensor(T, &[sw[0]], -1.0, 1.0));
        &["X", "W", "B"]
    } else {
        &["X", "W"]
    };
    c.node("Conv", inputs, &["Y"], attrs)
}

#[test]
fn conv_2d_group_1_with_bias() {
    let mut r = Rng::new(11);
    let c = conv_case(
        &mut r,
        &[2, 3, 5, 5],
        &[4, 3, 3, 3],
        true,
        vec![ints_attr("pads", &[1, 1, 1, 1])],
    );
    check("Conv 2-D pads 1", c, F32);
}

#[test]
fn conv_stride_pads_dilation() {
    let mut r = Rng::new(12);
    // Axis 0: (8 + 1 + 2 - 3) = 8, stride 2 -> 5 outputs, no leftover; axis 1: (7 + 0 + 1
    // - 3) = 5, stride 2 -> 3 outputs, one leftover column (output_padding and the dW crop).
    let c = conv_case(
        &mut r,
        &[2, 2, 8, 7],
        &[3, 2, 2, 3],
        true,
        vec![
            ints_attr("strides", &[2, 2]),
            ints_attr("pads", &[1, 0, 2, 1]),
            ints_attr("dilations", &[2, 1]),
        ],
    );
    check("Conv stride 2, asymmetric pads, dilation 2", c, F32);
}

#[test]
fn conv_depthwise_and_grouped() {
    let mut r = Rng::new(13);
    // Depthwise with channel multiplier 2: group = C = 4, 8 output channels.
    let c = conv_case(
        &mut r,
        &[2, 4, 5, 5],
        &[8, 1, 3, 3],
        true,
        vec![
            int_attr("group", 4),
            ints_attr("strides", &[2, 2]),
            ints_attr("pads", &[1, 1, 1, 1]),
        ],
    );
    check("Conv depthwise (group 4, multiplier 2)", c, F32);
    let c = conv_case(
        &mut r,
        &[2, 6, 5, 4],
        &[4, 3, 2, 2],
        false,
        vec![int_attr("group", 2), ints_attr("dilations", &[2, 1])],
    );
    // group != channels per group, so a mix-up of the two in the dW layout shows.
    check("Conv group 2 of 3 channels, dilation 2", c, F32);
}

#[test]
fn conv_1d() {
    let mut r = Rng::new(14);
    let c = conv_case(
        &mut r,
        &[2, 3, 10],
        &[2, 3, 3],
        true,
        vec![
            ints_attr("strides", &[2]),
            ints_attr("dilations", &[2]),
            ints_attr("pads", &[1, 2]),
        ],
    );
    check("Conv 1-D stride 2, dilation 2, pads [1, 2]", c, F32);
}

#[test]
fn conv_without_bias_and_auto_pad() {
    let mut r = Rng::new(15);
    let c = conv_case(&mut r, &[1, 2, 4, 4], &[3, 2, 2, 2], false, vec![]);
    check("Conv without bias", c, F32);
    for mode in ["SAME_UPPER", "SAME_LOWER", "VALID"] {
        // 7 with stride 2 and kernel 2: SAME pads 1 in total, on one side only.
        let c = conv_case(
            &mut r,
            &[1, 2, 7, 6],
            &[2, 2, 2, 3],
            true,
            vec![string_attr("auto_pad", mode), ints_attr("strides", &[2, 2])],
        );
        check(&format!("Conv auto_pad={mode} stride 2"), c, F32);
    }
}

#[test]
fn conv_weight_only() {
    // X a constant: only dW and dB are built.
    let mut r = Rng::new(16);
    let c = GradCheck::new(17)
        .constant("X", r.tensor(DType::F32, &[2, 2, 5, 5], -1.0, 1.0))
        .param("W", r.tensor(DType::F32, &[3, 2, 3, 3], -1.0, 1.0))
        .param("B", r.tensor(DType::F32, &[3], -1.0, 1.0))
        .node(
            "Conv",
            &["X", "W", "B"],
            &["Y"],
            vec![ints_attr("strides", &[2, 2])],
        );
    check("Conv dW and dB only", c, F32);
}

fn max_pool(opset: i64, x: Tensor, attrs: Vec<AttributeProto>) -> GradCheck {
    GradCheck::new(opset)
        .param("X", x)
        .node("MaxPool", &["X"], &["Y"], attrs)
}

#[test]
fn max_pool_overlapping_windows() {
    let mut r = Rng::new(21);
    // Batch 2 and 2 channels check that Indices address the whole flattened X.
    let mut x = distinct(&mut r, &[2, 2, 5, 5]);
    // X[1, 0, 2, 2] (flat 62, one of the elements the check perturbs) is the centre of all
    // four 3x3 windows of stride 2: as their common maximum it receives four gradients.
    x[62] = 100.0;
    let x = Tensor::f64(vec![2, 2, 5, 5], x).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[3, 3]),
        ints_attr("strides", &[2, 2]),
    ];
    check("MaxPool kernel 3 stride 2", max_pool(17, x, attrs), F64);
}

#[test]
fn max_pool_pads_dilation_ceil_mode_and_1d() {
    let mut r = Rng::new(22);
    let x = Tensor::f64(vec![1, 2, 6, 5], distinct(&mut r, &[1, 2, 6, 5])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[3, 2]),
        ints_attr("strides", &[1, 2]),
        ints_attr("pads", &[1, 0, 1, 1]),
    ];
    check("MaxPool kernel [3, 2], pads", max_pool(17, x, attrs), F64);
    let x = Tensor::f64(vec![2, 1, 6, 6], distinct(&mut r, &[2, 1, 6, 6])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 2]),
        ints_attr("dilations", &[2, 2]),
        ints_attr("strides", &[2, 1]),
        int_attr("ceil_mode", 1),
    ];
    check("MaxPool dilation 2, ceil_mode", max_pool(17, x, attrs), F64);
    let x = Tensor::f64(vec![2, 3, 9], distinct(&mut r, &[2, 3, 9])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[3]),
        ints_attr("strides", &[2]),
        ints_attr("pads", &[1, 1]),
    ];
    check("MaxPool 1-D", max_pool(17, x, attrs), F64);
}

#[test]
fn max_pool_before_opset_16() {
    let mut r = Rng::new(23);
    // Disjoint windows: a plain ScatterElements (no reduction before opset 16) is exact.
    let x = Tensor::f64(vec![2, 2, 4, 6], distinct(&mut r, &[2, 2, 4, 6])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 3]),
        ints_attr("strides", &[2, 3]),
    ];
    check(
        "MaxPool opset 13, disjoint windows",
        max_pool(13, x, attrs),
        F64,
    );
    // Overlapping windows would need reduction=add: refused, naming why.
    let x = Tensor::f64(vec![1, 1, 5, 5], distinct(&mut r, &[1, 1, 5, 5])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[3, 3]),
        ints_attr("strides", &[2, 2]),
    ];
    let err = max_pool(13, x, attrs)
        .run(&common::runtime(), F64)
        .unwrap_err();
    assert!(err.contains("opset 16"), "{err}");
}

#[test]
fn max_pool_column_major_indices_refused() {
    let mut r = Rng::new(24);
    let x = Tensor::f64(vec![1, 1, 4, 4], distinct(&mut r, &[1, 1, 4, 4])).unwrap();
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 2]),
        int_attr("storage_order", 1),
    ];
    let err = max_pool(17, x, attrs)
        .run(&common::runtime(), F64)
        .unwrap_err();
    assert!(err.contains("storage_order"), "{err}");
}

fn avg_pool(opset: i64, r: &mut Rng, sx: &[usize], attrs: Vec<AttributeProto>) -> GradCheck {
    GradCheck::new(opset)
        .param("X", r.tensor(DType::F32, sx, -1.0, 1.0))
        .node("AveragePool", &["X"], &["Y"], attrs)
}

#[test]
fn average_pool_pads_and_count_include_pad() {
    let mut r = Rng::new(31);
    for include in [0, 1] {
        // Kernel 3, stride 2, pads 1: border windows have 2 real rows/columns of 3.
        let attrs = vec![
            ints_attr("kernel_shape", &[3, 3]),
            ints_attr("strides", &[2, 2]),
            ints_attr("pads", &[1, 1, 1, 1]),
            int_attr("count_include_pad", include),
        ];
        let c = avg_pool(17, &mut r, &[2, 2, 5, 6], attrs);
        check(
            &format!("AveragePool 3/2 pads 1 count_include_pad={include}"),
            c,
            F32,
        );
        // Asymmetric kernel, stride and pads, with a leftover row for output_padding.
        let attrs = vec![
            ints_attr("kernel_shape", &[2, 3]),
            ints_attr("strides", &[3, 1]),
            ints_attr("pads", &[0, 2, 1, 1]),
            int_attr("count_include_pad", include),
        ];
        let c = avg_pool(17, &mut r, &[1, 3, 7, 4], attrs);
        check(
            &format!("AveragePool [2, 3]/[3, 1] count_include_pad={include}"),
            c,
            F32,
        );
    }
}

#[test]
fn average_pool_1d_same_and_dilation() {
    let mut r = Rng::new(32);
    let attrs = vec![
        ints_attr("kernel_shape", &[4]),
        ints_attr("strides", &[3]),
        ints_attr("pads", &[2, 1]),
    ];
    check(
        "AveragePool 1-D",
        avg_pool(17, &mut r, &[2, 2, 11], attrs),
        F32,
    );
    for mode in ["SAME_UPPER", "SAME_LOWER"] {
        let attrs = vec![
            string_attr("auto_pad", mode),
            ints_attr("kernel_shape", &[2, 3]),
            ints_attr("strides", &[2, 2]),
        ];
        let c = avg_pool(17, &mut r, &[1, 2, 5, 6], attrs);
        check(&format!("AveragePool auto_pad={mode}"), c, F32);
    }
    for include in [0, 1] {
        // dilations arrived in opset 19.
        let attrs = vec![
            ints_attr("kernel_shape", &[2, 2]),
            ints_attr("dilations", &[2, 1]),
            ints_attr("pads", &[1, 1, 1, 0]),
            int_attr("count_include_pad", include),
        ];
        let c = avg_pool(19, &mut r, &[1, 2, 5, 4], attrs);
        check(
            &format!("AveragePool dilation 2 count_include_pad={include}"),
            c,
            F32,
        );
    }
}

#[test]
fn global_average_pool() {
    let mut r = Rng::new(41);
    for sx in [&[2, 3, 4, 5][..], &[2, 2, 7][..]] {
        let c = GradCheck::new(17)
            .param("X", r.tensor(DType::F32, sx, -1.0, 1.0))
            .node("GlobalAveragePool", &["X"], &["Y"], vec![]);
        check(&format!("GlobalAveragePool {sx:?}"), c, F32);
    }
}

#[test]
fn average_pool_ceil_mode() {
    let mut r = Rng::new(33);
    // 6 with kernel 2, stride 2: ceil_mode adds no window, so it is plain floor mode.
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 2]),
        ints_attr("strides", &[2, 2]),
        int_attr("ceil_mode", 1),
    ];
    let c = avg_pool(17, &mut r, &[1, 2, 6, 4], attrs);
    check("AveragePool ceil_mode=1 without a partial window", c, F32);
    // 5: ceil_mode adds a partial window, whose divisor rule is not handled: refused.
    let attrs = vec![
        ints_attr("kernel_shape", &[2, 2]),
        ints_attr("strides", &[2, 2]),
        int_attr("ceil_mode", 1),
    ];
    let err = avg_pool(17, &mut r, &[1, 1, 5, 4], attrs)
        .run(&common::runtime(), F32)
        .unwrap_err();
    assert!(err.contains("ceil_mode"), "{err}");
}
