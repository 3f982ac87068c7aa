//! The gradients of the upsampling operators of decoders, U-Nets, FPNs and YOLO heads
//! (ConvTranspose, Resize), against central finite differences in float32 (ONNX Runtime
//! has no double kernel for either; the tolerance of `common/gradcheck.rs`).

use crate::common::gradcheck::{check, ints, GradCheck, Rng, F32};
use pipetrain::graph::{float_attr, int_attr, ints_attr, string_attr};
use pipetrain::tensor::{DType, Tensor};

/// A ConvTranspose case: name, X's shape, W's shape, attributes.
type ConvCase = (
    &'static str,
    Vec<usize>,
    Vec<usize>,
    Vec<pipetrain::onnx::proto::AttributeProto>,
);

/// ConvTranspose (decoders' and U-Nets' upsampling): strides, pads, output_padding,
/// dilations and groups, in float32 (ONNX Runtime has no double kernel).
#[test]
fn conv_transpose() {
    let mut r = Rng::new(31);
    const S: DType = DType::F32;
    // (X, W, attributes)
    let cases: Vec<ConvCase> = vec![
        ("plain 2-D", vec![2, 3, 4, 4], vec![3, 2, 3, 3], vec![]),
        (
            "stride 2, pads, output_padding",
            vec![1, 2, 3, 3],
            vec![2, 3, 3, 3],
            vec![
                ints_attr("strides", &[2, 2]),
                ints_attr("pads", &[1, 0, 1, 1]),
                ints_attr("output_padding", &[1, 0]),
            ],
        ),
        (
            "groups and dilations",
            vec![2, 4, 3, 3],
            vec![4, 1, 2, 2],
            vec![int_attr("group", 2), ints_attr("dilations", &[2, 1])],
        ),
        (
            "1-D, stride 3",
            vec![2, 2, 5],
            vec![2, 3, 2],
            vec![ints_attr("strides", &[3])],
        ),
    ];
    for (name, sx, sw, attrs) in cases {
        let cout = sw[1]
            * attrs
                .iter()
                .find(|a| a.name == "group")
                .map_or(1, |a| a.i as usize);
        let c = GradCheck::new(17)
            .param("X", r.tensor(S, &sx, -1.0, 1.0))
            .param("W", r.tensor(S, &sw, -1.0, 1.0))
            .param("B", r.tensor(S, &[cout], -0.5, 0.5))
            .node("ConvTranspose", &["X", "W", "B"], &["Y"], attrs);
        check(&format!("ConvTranspose {name}"), c, F32);
    }
}

/// Resize (U-Net, FPN and YOLO upsampling): nearest with integer and fractional scales,
/// linear (half_pixel, align_corners), cubic, by scales or by sizes, and downsampling; in
/// float32 (ONNX Runtime has no double Resize).
#[test]
fn resize_modes() {
    let mut r = Rng::new(32);
    let nearest = |m: &str| {
        vec![
            string_attr("mode", "nearest"),
            string_attr("nearest_mode", m),
        ]
    };
    let linear = |c: &str| {
        vec![
            string_attr("mode", "linear"),
            string_attr("coordinate_transformation_mode", c),
        ]
    };
    let scales = |v: &[f32]| Tensor::f32(vec![v.len()], v.to_vec()).unwrap();
    let cases = [
        (
            "nearest x2",
            nearest("floor"),
            Some(scales(&[1.0, 1.0, 2.0, 2.0])),
            None,
        ),
        (
            "nearest x1.5",
            nearest("round_prefer_floor"),
            Some(scales(&[1.0, 1.0, 1.5, 1.5])),
            None,
        ),
        (
            "linear half_pixel x2",
            linear("half_pixel"),
            Some(scales(&[1.0, 1.0, 2.0, 2.0])),
            None,
        ),
        (
            "linear align_corners to 7x5",
            linear("align_corners"),
            None,
            Some(ints(&[2, 3, 7, 5])),
        ),
        (
            "linear down to 2x3",
            linear("pytorch_half_pixel"),
            None,
            Some(ints(&[2, 3, 2, 3])),
        ),
        (
            "cubic x2",
            vec![string_attr("mode", "cubic")],
            Some(scales(&[1.0, 1.0, 2.0, 2.0])),
            None,
        ),
    ];
    for (name, attrs, scales, sizes) in cases {
        let x = r.tensor(DType::F32, &[2, 3, 4, 4], -1.0, 1.0);
        let mut c = GradCheck::new(17).param("X", x);
        let inputs: Vec<&str> = match (&scales, &sizes) {
            (Some(s), _) => {
                c = c.constant("scales", s.clone());
                vec!["X", "", "scales"]
            }
            (_, Some(s)) => {
                c = c.constant("sizes", s.clone());
                vec!["X", "", "", "sizes"]
            }
            _ => unreachable!(),
        };
        let c = c.node("Resize", &inputs, &["Y"], attrs);
        check(&format!("Resize {name}"), c, F32);
    }
}

/// The Resize forms that remained: `axes` (opset 18; scales and sizes for the listed
/// axes only) and `tf_crop_and_resize` (a region of the input, normalized, with an
/// extrapolation value outside it), by scales and by sizes.
#[test]
fn resize_by_axes_and_crop_and_resize() {
    let mut r = Rng::new(33);
    let f32s = |v: &[f32]| Tensor::f32(vec![v.len()], v.to_vec()).unwrap();
    let linear = |extra: Vec<pipetrain::onnx::proto::AttributeProto>| {
        let mut a = vec![string_attr("mode", "linear")];
        a.extend(extra);
        a
    };
    let mut x = || r.tensor(DType::F32, &[2, 3, 4, 5], -1.0, 1.0);
    let (a, b) = (x(), x());
    let c = GradCheck::new(18)
        .param("X", a)
        .constant("scales", f32s(&[1.5, 2.0]))
        .node(
            "Resize",
            &["X", "", "scales"],
            &["Y"],
            linear(vec![ints_attr("axes", &[3, 2])]),
        );
    check("Resize axes [3, 2] by scales", c, F32);
    let c = GradCheck::new(18)
        .param("X", b)
        .constant("sizes", ints(&[7]))
        .node(
            "Resize",
            &["X", "", "", "sizes"],
            &["Y"],
            vec![string_attr("mode", "nearest"), ints_attr("axes", &[-1])],
        );
    check("Resize axes [-1] by sizes, nearest", c, F32);
    let crop = |extra: f32| {
        linear(vec![
            string_attr("coordinate_transformation_mode", "tf_crop_and_resize"),
            float_attr("extrapolation_value", extra),
        ])
    };
    let (a, b) = (x(), x());
    let c = GradCheck::new(17)
        .param("X", a)
        .constant("roi", f32s(&[0.0, 0.0, 0.2, -0.1, 1.0, 1.0, 0.9, 1.2]))
        .constant("sizes", ints(&[2, 3, 6, 6]))
        .node("Resize", &["X", "roi", "", "sizes"], &["Y"], crop(0.5));
    check("Resize tf_crop_and_resize, a region past the edge", c, F32);
    let c = GradCheck::new(18)
        .param("X", b)
        .constant("roi", f32s(&[0.25, 0.1, 0.75, 0.8]))
        .constant("scales", f32s(&[1.5, 1.2]))
        .node("Resize", &["X", "roi", "scales"], &["Y"], {
            let mut a = crop(0.0);
            a.push(ints_attr("axes", &[2, 3]));
            a
        });
    check("Resize tf_crop_and_resize with axes, by scales", c, F32);
}
