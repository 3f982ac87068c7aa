//! The scatter with addition that the gradients of lookups need, written so that ONNX
//! Runtime's CPU kernels add in the same order every run.
//!
//! `ScatterND(zeros, indices, updates, reduction = add)` is the plain form, but ONNX
//! Runtime's CPU kernel hands index slices to the thread pool and adds without atomics:
//! two slices that name the same row on two threads at once lose one addition. A BERT
//! token-type table, read at row 0 by all 1,024 tokens of a batch, got its gradient
//! 4-15% too small in two runs of three on two threads. `ScatterElements` over the table
//! seen as rows x row length, with each update element's row index spelled out, splits
//! its work so that no two threads write one element and adds each element's updates in
//! index order: the same sums every run, on any thread count.
//!
//! On a GPU both kernels add with atomics; `graph::deterministic` rewrites this form as
//! a one-hot product there.

use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{int_attr, string_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// A tensor of shape `dims` (type `t`), zero but for `updates` added at the rows that
/// `idx` names: `idx` holds `n` tuples of `k` non-negative int64 indices into the first
/// `k` axes of `dims` (any shape of `n * k` elements, tuples last), `updates` the `n`
/// slices of shape `dims[k..]` in the same order.
pub(super) fn add_rows(
    ctx: &mut RuleCtx,
    dims: &[usize],
    k: usize,
    (idx, n): (&str, usize),
    updates: &str,
    t: DType,
) -> Result<String> {
    let rows: usize = dims[..k].iter().product();
    let row_len: usize = dims[k..].iter().product();
    let tuples = ctx.e.reshape(idx, &[n, k]);
    // Tuples as row numbers of the table seen as [rows, row_len].
    let column = match k {
        1 => tuples,
        _ => {
            let strides: Vec<i64> = (0..k)
                .map(|j| dims[j + 1..k].iter().product::<usize>() as i64)
                .collect();
            let s = ctx.e.constant(Tensor::i64(vec![1, k], strides)?);
            let scaled = ctx.e.op("Mul", &[&tuples, &s], vec![]);
            let axis = ctx.e.ints(&[1]);
            ctx.e.op(
                "ReduceSum",
                &[&scaled, &axis],
                vec![int_attr("keepdims", 1)],
            )
        }
    };
    let wide = ctx.e.ints(&[n as i64, row_len as i64]);
    let at = ctx.e.op("Expand", &[&column, &wide], vec![]);
    let flat = ctx.e.reshape(updates, &[n, row_len]);
    let z = ctx.e.zeros(&[rows, row_len], t);
    let added = ctx.e.op(
        "ScatterElements",
        &[&z, &at, &flat],
        vec![int_attr("axis", 0), string_attr("reduction", "add")],
    );
    // A table of one index axis is `[rows, row_len]` already: a reshape to its own shape
    // would be a copy of the whole table where the gradient is a bound output.
    match (k, dims.len()) {
        (1, 2) => Ok(added),
        _ => Ok(ctx.e.reshape(&added, dims)),
    }
}
