//! `Accumulate(acc, g)`: `acc + g`, elementwise, float32, on the CPU; the last node of
//! each gradient in a stage's accumulating graph (`graph::accumulating`), whose output
//! the stage binds to the memory it feeds as `acc` (`compute::session`).
//!
//! Not ONNX's `Add`: ONNX Runtime fuses an `Add` into the product before it (`MatMul +
//! Add` as one `Gemm`, which adds `acc` inside the product and rounds otherwise), and a
//! step's gradients would then depend on which micro-batch ran through which session.
//! This kernel adds exactly as the accumulation it replaces did (`a += g`), so a run's
//! bits do not change.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output, par_blocks};
use crate::graph::custom_ops::ACCUMULATE;

/// The `Accumulate` operator.
#[derive(Clone, Copy)]
pub(crate) struct Accumulate;

impl Operator for Accumulate {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ACCUMULATE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..2).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(move |ctx: &ComputeContext| {
            let op = ACCUMULATE;
            let g = input(ctx, op, 1)?;
            let (shape, g) = g.try_extract_tensor::<f32>()?;
            let acc = input(ctx, op, 0)?;
            // Only its address is kept: no reference to it lives while `out` is written.
            let acc_ptr = acc.try_extract_tensor::<f32>()?.1.as_ptr();
            let mut out = output(ctx, op, 0, shape)?;
            let (_, out) = out.try_extract_tensor_mut::<f32>()?;
            if std::ptr::eq(acc_ptr, out.as_ptr()) {
                // The output is the accumulator itself: read it only through `out`.
                return par_blocks(ctx, out, 1, |at, out| {
                    for (o, &x) in out.iter_mut().zip(&g[at..]) {
                        *o += x;
                    }
                });
            }
            let (_, acc) = acc.try_extract_tensor::<f32>()?;
            if acc.len() != g.len() {
                return Err(ort::Error::new(format!(
                    "{op}: acc and g of different lengths"
                )));
            }
            par_blocks(ctx, out, 1, |at, out| {
                let (acc, g) = (&acc[at..at + out.len()], &g[at..at + out.len()]);
                for ((o, &a), &x) in out.iter_mut().zip(acc).zip(g) {
                    *o = a + x;
                }
            })
        }))
    }
}
