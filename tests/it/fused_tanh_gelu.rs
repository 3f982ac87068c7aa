//! GPT-2's tanh GELU as one kernel each way (`TanhGelu`, `TanhGeluGrad`), against finite
//! differences (the kernels a graph built for a GPU holds: `gpu_graphs.rs`).

use crate::common::gradcheck::{check, GradCheck, Rng, F32};
use pipetrain::tensor::{DType, Tensor};

/// GPT-2's tanh GELU, as Hugging Face's `gelu_new` exports it, against central finite
/// differences through the fused kernels (`TanhGelu`, `TanhGeluGrad`), x across the
/// curve and its flat tails.
#[test]
fn tanh_gelu_kernels_give_finite_differences() {
    let scalar = |v: f32| Tensor::f32(vec![], vec![v]).unwrap();
    let case = GradCheck::new(17)
        .param("X", Rng::new(23).tensor(DType::F32, &[3, 29], -4.0, 4.0))
        .constant("three", scalar(3.0))
        .constant("c", scalar(0.044715))
        .constant("k", scalar(0.797_884_6))
        .constant("one", scalar(1.0))
        .constant("half", scalar(0.5))
        .node("Mul", &["X", "half"], &["hx"], vec![])
        .node("Pow", &["X", "three"], &["cube"], vec![])
        .node("Mul", &["cube", "c"], &["small"], vec![])
        .node("Add", &["X", "small"], &["inner"], vec![])
        .node("Mul", &["inner", "k"], &["arg"], vec![])
        .node("Tanh", &["arg"], &["th"], vec![])
        .node("Add", &["th", "one"], &["gate"], vec![])
        .node("Mul", &["hx", "gate"], &["Y"], vec![]);
    check("tanh GELU float32, fused", case, F32);
}
