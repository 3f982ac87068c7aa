//! Gradients that sum in the same order every run on a GPU.
//!
//! The gradient of a `Gather` (an embedding lookup) adds each looked-up row's gradient
//! into the table's: pipetrain writes it as `ScatterElements(zeros[rows, row length],
//! row indices, updates, axis = 0, reduction = add)` (`autodiff::rules::rows_add`),
//! which ONNX Runtime's CPU kernel adds in index order on any thread count. Its CUDA
//! kernel adds with atomics, so rows looked up several times (a token that repeats in
//! the batch) sum in whatever order the threads happen to run, and two runs of the same
//! steps part within a few steps. On a GPU each such scatter is written instead as a
//! product with the one-hot matrix of the indices (`Gemm`, cuBLAS), whose sums have a
//! fixed order: `dW[v] = sum over i of (indices[i] == v) * updates[i]`. Adding the exact
//! zeros of the other rows changes no value. The one-hot matrix holds one value per
//! index and table row (GPT-2 small, batch 4 x 1024: 4096 x 50257 float32, 823 MB), and
//! the product costs 2 x indices x rows x row length operations.
//!
//! With pipetrain's CUDA kernels (`runtime.fused_kernels` on a GPU build) each such
//! scatter becomes one `RowsAdd` instead (`graph::custom_ops::ROWS_ADD`,
//! `compute/cuda_ops.rs`): each row's updates summed in index order, as the CPU's
//! scatter adds them, with no one-hot matrix.

use crate::graph::custom_ops::{DOMAIN, ROWS_ADD};
use crate::graph::ir::{attr_i, attr_s, int_attr, make_node, tensor_attr, Graph};
use crate::onnx::proto::{AttributeProto, NodeProto};
use crate::tensor::{DType, Tensor};

/// Rewrites every embedding-gradient scatter of `g` (a `ScatterElements` on axis 0 with
/// `reduction = add` into a `ConstantOfShape` of zeros of rank 2, its indices one
/// column `Expand`ed to the updates' shape) as a one-hot product; returns how many.
pub fn scatter_adds_as_products(g: &mut Graph) -> usize {
    rewrite(g, |p, scatter| Some(p.nodes(scatter)))
}

/// Rewrites every float32 embedding-gradient scatter of `g` (as
/// [`scatter_adds_as_products`] finds them) as one `RowsAdd` of pipetrain's domain,
/// imported when any is written; float64 tables keep their scatter. Returns how many.
pub fn scatter_adds_as_rows_add(g: &mut Graph) -> usize {
    let n = rewrite(g, |p, scatter| {
        (p.dtype == DType::F32).then(|| {
            let out = &scatter.output[0];
            let mut node = make_node(
                ROWS_ADD,
                &format!("{out}_rows_add"),
                &[&p.indices, &scatter.input[2]],
                &[out],
                vec![int_attr("rows", p.dims[0])],
            );
            node.domain = DOMAIN.into();
            vec![node]
        })
    });
    if n > 0 {
        g.import_domain(DOMAIN, 1);
    }
    n
}

/// `RowsAdd` in Rust, the formula its CUDA kernel computes: the table `[rows, row
/// length]` (`updates` holds one row per index), row v the updates whose index is v
/// (below 0: counted from the end; out of range: left out) added in index order to +0.
pub fn rows_add_reference(indices: &[i64], updates: &[f32], rows: usize) -> Vec<f32> {
    let row_len = updates.len() / indices.len().max(1);
    let mut table = vec![0f32; rows * row_len];
    for (i, &v) in indices.iter().enumerate() {
        let v = if v < 0 { v + rows as i64 } else { v };
        if (0..rows as i64).contains(&v) {
            let (v, u) = (v as usize, &updates[i * row_len..(i + 1) * row_len]);
            for (t, &x) in table[v * row_len..(v + 1) * row_len].iter_mut().zip(u) {
                *t += x;
            }
        }
    }
    table
}

/// Replaces each scatter that [`plan`] takes by the nodes `with` makes of it (none: the
/// scatter stays); returns how many were replaced.
fn rewrite(g: &mut Graph, with: impl Fn(&Plan, &NodeProto) -> Option<Vec<NodeProto>>) -> usize {
    let mut rewritten = 0;
    let mut i = 0;
    while i < g.nodes.len() {
        match plan(g, i).and_then(|p| with(&p, &g.nodes[i])) {
            Some(nodes) => {
                let n = nodes.len();
                g.nodes.splice(i..=i, nodes);
                i += n;
                rewritten += 1;
            }
            None => i += 1,
        }
    }
    rewritten
}

/// What a rewrite of one scatter needs: the table's shape and type, and the indices
/// before their `Expand` (one column).
struct Plan {
    dims: Vec<i64>,
    dtype: DType,
    indices: String,
}

fn plan(g: &Graph, i: usize) -> Option<Plan> {
    let n = &g.nodes[i];
    if n.op_type != "ScatterElements"
        || attr_s(n, "reduction").as_deref() != Some("add")
        || attr_i(n, "axis").unwrap_or(0) != 0
    {
        return None;
    }
    let makes = |m: &NodeProto, name: &str| m.output.first().is_some_and(|o| o == name);
    let producer = |name: &str| g.nodes[..i].iter().rev().find(|m| makes(m, name));
    let zeros = producer(&n.input[0]).filter(|m| m.op_type == "ConstantOfShape")?;
    let consts = |name: &str| {
        g.nodes[..i]
            .iter()
            .rev()
            .find(|m| m.op_type == "Constant" && makes(m, name))
            .and_then(crate::graph::ir::constant_value)
            .or_else(|| g.initializer(name).and_then(|t| Tensor::from_proto(t).ok()))
    };
    let dims = consts(&zeros.input[0])?.to_i64_vec()?;
    let value = zeros
        .attribute
        .iter()
        .find(|a| a.name == "value")
        .and_then(|a| a.t.as_ref())
        .and_then(|t| Tensor::from_proto(t).ok());
    let dtype = value.as_ref().map_or(DType::F32, Tensor::dtype);
    if value.is_some_and(|v| v.to_f64_vec().iter().any(|&x| x != 0.0))
        || dims.is_empty()
        || !matches!(dtype, DType::F32 | DType::F64)
    {
        return None;
    }
    let expand = producer(&n.input[1]).filter(|m| m.op_type == "Expand")?;
    (dims.len() == 2).then(|| Plan {
        dims,
        dtype,
        indices: expand.input[0].clone(),
    })
}

impl Plan {
    /// The nodes that replace `scatter`, its output's name kept.
    fn nodes(&self, scatter: &NodeProto) -> Vec<NodeProto> {
        let out = &scatter.output[0];
        let v = |s: &str| format!("{out}_onehot_{s}");
        let constant = |name: &str, t: Tensor| {
            let name = v(name);
            make_node(
                "Constant",
                &name,
                &[],
                &[&name],
                vec![tensor_attr("value", t.to_proto("value"))],
            )
        };
        let node = |op: &str, name: &str, ins: &[&str], attrs: Vec<AttributeProto>| {
            let name = v(name);
            make_node(op, &name, ins, &[&name], attrs)
        };
        let shape = |d: &[i64]| Tensor::i64(vec![d.len()], d.to_vec()).expect("a 1-D shape");
        let rows = self.dims[0];
        let row_len: i64 = self.dims[1..].iter().product();
        let table = Tensor::i64(vec![1, rows as usize], (0..rows).collect()).expect("one row");
        vec![
            constant("column_shape", shape(&[-1, 1])),
            node(
                "Reshape",
                "column",
                &[&self.indices, &v("column_shape")],
                vec![],
            ),
            constant("rows", table),
            node("Equal", "hit", &[&v("column"), &v("rows")], vec![]),
            node(
                "Cast",
                "matrix",
                &[&v("hit")],
                vec![int_attr("to", self.dtype.onnx() as i64)],
            ),
            constant("updates_shape", shape(&[-1, row_len])),
            node(
                "Reshape",
                "updates",
                &[&scatter.input[2], &v("updates_shape")],
                vec![],
            ),
            node(
                "Gemm",
                "product",
                &[&v("matrix"), &v("updates")],
                vec![int_attr("transA", 1)],
            ),
            constant("table_shape", shape(&self.dims)),
            make_node(
                "Reshape",
                &v("table"),
                &[&v("product"), &v("table_shape")],
                &[out],
                vec![],
            ),
        ]
    }
}
