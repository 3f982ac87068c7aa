//! GridSample (`torch.nn.functional.grid_sample`), which ONNX Runtime's training build
//! cannot differentiate, against finite differences (float32: ONNX Runtime has no
//! float64 kernel for it).

use crate::common::gradcheck::{check, GradCheck, Rng, Tol};
use pipetrain::graph::{int_attr, string_attr};
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
