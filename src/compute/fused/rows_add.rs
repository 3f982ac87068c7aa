//! `RowsAdd` on the CPU (`graph::custom_ops::ROWS_ADD`): an embedding's gradient, each
//! looked-up row's update added into a zeroed table in index order, as
//! `graph::rows_add_reference` writes it (float32).
//!
//! The same bits as the `ScatterElements(ConstantOfShape(zeros), indices, updates,
//! reduction = add)` it replaces (`graph::scatter_adds_as_rows_add`), which ONNX
//! Runtime's CPU kernel also adds in index order onto +0. But ONNX Runtime folds that
//! `ConstantOfShape` into a constant the size of the table when the session opens and
//! copies it into the output every step: GPT-2 small's 154 MB word table held twice
//! over. This kernel zeroes its output instead.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output};
use crate::graph::custom_ops::ROWS_ADD;

/// The `RowsAdd` operator on the CPU.
#[derive(Clone, Copy)]
pub(crate) struct RowsAdd;

impl Operator for RowsAdd {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ROWS_ADD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        inputs()
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let rows = rows_attribute(info)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let indices = input(ctx, ROWS_ADD, 0)?;
            let (_, indices) = indices.try_extract_tensor::<i64>()?;
            let updates = input(ctx, ROWS_ADD, 1)?;
            let (_, updates) = updates.try_extract_tensor::<f32>()?;
            let n = indices.len();
            if n == 0 || updates.len() % n != 0 {
                return Err(ort::Error::new(format!(
                    "RowsAdd: {n} indices and {} update values",
                    updates.len()
                )));
            }
            let row_len = updates.len() / n;
            let mut out = output(ctx, ROWS_ADD, 0, &[rows, row_len as i64])?;
            let (_, table) = out.try_extract_tensor_mut::<f32>()?;
            add_rows(indices, updates, rows as usize, table);
            Ok(())
        }))
    }
}

/// `RowsAdd`'s inputs (on the CPU and on CUDA): the indices and the update rows.
pub(crate) fn inputs() -> [OperatorInput; 2] {
    [
        OperatorInput::required(TensorElementType::Int64),
        OperatorInput::required(TensorElementType::Float32),
    ]
}

/// A `RowsAdd` node's `rows` attribute, the table's row count (positive).
pub(crate) fn rows_attribute(info: &KernelContext<'_>) -> ort::Result<i64> {
    info.get::<i64>("rows")
        .filter(|&r| r > 0)
        .ok_or_else(|| ort::Error::new("RowsAdd: attribute rows (a positive count) missing"))
}

/// `table` (`rows` x the updates' row length) zeroed, then each update row added to the
/// row its index names (below 0: from the end; out of range: left out), in index order.
fn add_rows(indices: &[i64], updates: &[f32], rows: usize, table: &mut [f32]) {
    table.fill(0.0);
    let row_len = updates.len() / indices.len().max(1);
    for (&v, u) in indices.iter().zip(updates.chunks(row_len.max(1))) {
        let v = if v < 0 { v + rows as i64 } else { v };
        if (0..rows as i64).contains(&v) {
            let row = &mut table[v as usize * row_len..(v as usize + 1) * row_len];
            row.iter_mut().zip(u).for_each(|(t, &x)| *t += x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_add_up_as_the_reference_writes_them() {
        let indices = [2, 0, 2, -1, 7, 1];
        let updates: Vec<f32> = (0..12).map(|i| 0.1 * i as f32 + 0.01).collect();
        let mut table = vec![9.0; 8];
        add_rows(&indices, &updates, 4, &mut table);
        let want = crate::graph::rows_add_reference(&indices, &updates, 4);
        assert_eq!(table, want);
        // Row 2 holds updates 0 and 2 in that order; index -1 is row 3; 7 is left out.
        assert_eq!(table[4..6], [0.01 + 0.41, 0.11 + 0.51]);
        assert_eq!(table[6..8], [0.61, 0.71]);
    }
}
