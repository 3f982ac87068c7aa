//! Mixed precision (`use_mixed_precision`, `use_bfloat16`): the matrix products of a
//! graph in float16 or bfloat16, everything else in float32, as PyTorch's autocast does
//! on a GPU.
//!
//! The pass runs on the graphs a session computes (forward and backward alike, after
//! autodiff): each product (`MatMul`, `Gemm`, `com.microsoft.FusedMatMul`, and on a GPU
//! `Conv` and `ConvTranspose`) reads its inputs through a `Cast` to the half type (one
//! per value, shared by its readers) and its output is cast back to float32. Parameters
//! stay float32 (the master weights the optimizer updates), and so does every other op:
//! LayerNormalization, Softmax, the loss and their gradients (PyTorch AMP's float32 list,
//! by leaving them alone). A backward product reads the float32 activation and casts it
//! again, where AMP would have kept the half copy: more memory, the same values.
//! Gradients of float16 products can underflow, so float16 runs scale the loss
//! dynamically unless `loss_scale` says otherwise; bfloat16 has float32's range.

use std::collections::HashMap;

use crate::graph::ir::{int_attr, make_node, Graph};
use crate::onnx::proto::tensor_proto::DataType;

/// The half-precision type of the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// IEEE float16 (`use_mixed_precision`).
    F16,
    /// bfloat16 (`use_mixed_precision` with `use_bfloat16`).
    BF16,
}

impl Half {
    fn code(self) -> i64 {
        (match self {
            Half::F16 => DataType::Float16,
            Half::BF16 => DataType::Bfloat16,
        }) as i64
    }

    fn suffix(self) -> &'static str {
        match self {
            Half::F16 => "f16",
            Half::BF16 => "bf16",
        }
    }
}

/// The products the pass casts: those ONNX Runtime has half kernels for on the CPU
/// (`MatMul`, `Gemm`, `FusedMatMul`), with convolutions too on a GPU.
pub fn products(gpu: bool) -> &'static [&'static str] {
    if gpu {
        &["MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose"]
    } else {
        &["MatMul", "Gemm", "FusedMatMul"]
    }
}

/// Casts the inputs of every node of `g` whose type is in `ops` to `half` and its first
/// output back to float32; returns how many nodes now compute in `half`.
pub fn autocast(g: &mut Graph, half: Half, ops: &[&str]) -> usize {
    let mut halves: HashMap<String, String> = HashMap::new();
    let mut nodes = Vec::with_capacity(g.nodes.len());
    let mut cast = 0;
    for mut n in std::mem::take(&mut g.nodes) {
        let product = ops.contains(&n.op_type.as_str())
            && (n.domain.is_empty() || n.op_type == "FusedMatMul")
            && !n.output.is_empty();
        if !product {
            nodes.push(n);
            continue;
        }
        for input in n.input.iter_mut().filter(|i| !i.is_empty()) {
            let name = halves.entry(input.clone()).or_insert_with(|| {
                let name = format!("{input}_as_{}", half.suffix());
                nodes.push(make_node(
                    "Cast",
                    &name,
                    &[input.as_str()],
                    &[&name],
                    vec![int_attr("to", half.code())],
                ));
                name
            });
            *input = name.clone();
        }
        let out = n.output[0].clone();
        let inner = format!("{out}_in_{}", half.suffix());
        n.output[0] = inner.clone();
        nodes.push(n);
        nodes.push(make_node(
            "Cast",
            &format!("{out}_to_f32"),
            &[&inner],
            &[&out],
            vec![int_attr("to", DataType::Float as i64)],
        ));
        cast += 1;
    }
    g.nodes = nodes;
    cast
}
