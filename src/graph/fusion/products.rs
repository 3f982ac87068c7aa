//! The float32 matrix products of a CPU training graph as pipetrain's `BlasMatMul`
//! (OpenBLAS or MKL, `compute/fused/product.rs`) where ONNX Runtime would run MLAS: `MatMul`,
//! `Gemm` and `com.microsoft.FusedMatMul` whose second operand is a matrix (a weight, or
//! the activations a weight gradient reads) and whose first is a matrix or a stack of
//! rows. Batched products (attention's, where not fused) keep ONNX Runtime's kernels.
//!
//! Runs on the whole training graph once its values are measured, when the process
//! has a BLAS (`compute::Runtime`) and fused kernels are on; mixed precision keeps the
//! standard products, which it casts (`graph::autocast`).

use super::super::custom_ops::{BLAS_MATMUL, DOMAIN};
use super::super::ir::{attr_f, attr_i, float_attr, int_attr, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::DType;

/// Rewrites each product of `g` that fits (see the module doc) and has at least
/// `smallest` multiply-adds (`.0` with a transposed first operand, a weight gradient;
/// `.1` any other: where the library beats ONNX Runtime's MLAS,
/// `Blas::smallest_products` in `compute/blas`) as `BlasMatMul`, with the same inputs,
/// output and meaning; imports pipetrain's domain when it rewrote any. Returns how many.
pub fn blas_products(g: &mut Graph, metas: &Metas, smallest: (usize, usize)) -> usize {
    let mut n = 0;
    for node in &mut g.nodes {
        if let Some(attrs) = fits(node, metas, smallest) {
            node.op_type = BLAS_MATMUL.into();
            node.domain = DOMAIN.into();
            node.attribute = attrs;
            n += 1;
        }
    }
    if n > 0 {
        g.import_domain(DOMAIN, 1);
    }
    n
}

/// `BlasMatMul`'s attributes for `n`, where it computes `n`.
fn fits(
    n: &NodeProto,
    metas: &Metas,
    (smallest_transposed, smallest_other): (usize, usize),
) -> Option<Vec<crate::onnx::proto::AttributeProto>> {
    let kind = match (n.domain.as_str(), n.op_type.as_str()) {
        ("", "MatMul") if n.input.len() == 2 => Kind::MatMul,
        ("", "Gemm") => Kind::Gemm,
        ("com.microsoft", "FusedMatMul") if n.input.len() == 2 => Kind::Fused,
        _ => return None,
    };
    let shape = |i: usize| {
        let v = n.input.get(i).filter(|v| !v.is_empty())?;
        let m = metas.get(v.as_str())?;
        (m.dtype == DType::F32 && m.shape.iter().all(|&d| d > 0)).then_some(&m.shape)
    };
    let flag = |name: &str| attr_i(n, name).unwrap_or(0) != 0;
    let (a, b) = (shape(0)?, shape(1)?);
    let (trans_a, trans_b) = match kind {
        Kind::MatMul => (false, false),
        _ => (flag("transA"), flag("transB")),
    };
    let batched = flag("transBatchA") || flag("transBatchB");
    let rows_ok = a.len() == 2 || (a.len() > 2 && !trans_a && kind != Kind::Gemm);
    if b.len() != 2 || !rows_ok || batched {
        return None;
    }
    let m: usize = match trans_a {
        true => a[1],
        false => a[..a.len() - 1].iter().product(),
    };
    let (k, cols) = if trans_b { (b[1], b[0]) } else { (b[0], b[1]) };
    if kind == Kind::Gemm && n.input.len() > 2 {
        let c: usize = shape(2)?.iter().product();
        if c != cols && c != m * cols {
            return None;
        }
    }
    let smallest = if trans_a {
        smallest_transposed
    } else {
        smallest_other
    };
    if m * k * cols < smallest {
        return None;
    }
    Some(vec![
        int_attr("transA", i64::from(trans_a)),
        int_attr("transB", i64::from(trans_b)),
        float_attr("alpha", attr_f(n, "alpha").unwrap_or(1.0)),
        float_attr("beta", attr_f(n, "beta").unwrap_or(1.0)),
    ])
}

/// The products rewritten.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    MatMul,
    Gemm,
    Fused,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::{make_node, ValueMeta};

    fn metas(shapes: &[(&str, &[usize])]) -> Metas {
        shapes
            .iter()
            .map(|(n, s)| {
                let meta = ValueMeta {
                    dtype: DType::F32,
                    shape: s.to_vec(),
                };
                (n.to_string(), meta)
            })
            .collect()
    }

    #[test]
    fn products_of_a_matrix_are_rewritten_and_batched_or_small_ones_kept() {
        let mut g = Graph::default();
        let attrs = vec![int_attr("transA", 1), float_attr("alpha", 0.5)];
        g.nodes = vec![
            make_node("MatMul", "rows", &["x", "w"], &["y"], vec![]),
            make_node("MatMul", "batched", &["q", "k"], &["s"], vec![]),
            make_node("Gemm", "grad", &["xt", "dy"], &["dw"], attrs),
            make_node("MatMul", "small", &["t", "u"], &["v"], vec![]),
            make_node("MatMul", "middle", &["h", "o"], &["z"], vec![]),
        ];
        let m = metas(&[
            ("x", &[4, 512, 768]),
            ("w", &[768, 3072]),
            ("q", &[4, 12, 128, 64]),
            ("k", &[4, 12, 64, 128]),
            ("xt", &[512, 768]),
            ("dy", &[512, 3072]),
            ("t", &[8, 16]),
            ("u", &[16, 8]),
            ("h", &[1024, 768]),
            ("o", &[768, 768]),
        ]);
        // BERT-base's projections (604 M multiply-adds) stay MLAS's under OpenBLAS's
        // sizes, and go to a library that beats MLAS from 2^29 (MKL).
        let mut mkl = g.clone();
        assert_eq!(blas_products(&mut g, &m, (1 << 26, 1 << 30)), 2);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(
            ops,
            [BLAS_MATMUL, "MatMul", BLAS_MATMUL, "MatMul", "MatMul"]
        );
        assert_eq!(blas_products(&mut mkl, &m, (1 << 26, 1 << 29)), 3);
        assert_eq!(mkl.nodes[4].op_type, BLAS_MATMUL);
        let grad = &g.nodes[2];
        assert_eq!(attr_i(grad, "transA"), Some(1));
        assert_eq!(attr_i(grad, "transB"), Some(0));
        assert_eq!(attr_f(grad, "alpha"), Some(0.5));
        assert!(g.opsets.iter().any(|o| o.domain == DOMAIN));
    }
}
