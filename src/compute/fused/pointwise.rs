//! The operator most fused kernels are: float32 inputs of one shape in, one output of that
//! shape out, computed block by block on ONNX Runtime's intra-op threads, in blocks of
//! whole rows (the last axis) or of any length. Each kernel is a [`Pointwise`] value
//! naming its computation on one block.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output, par_blocks};

/// Values per block unit where blocks need not be whole rows (whole cache lines).
const UNIT: usize = 64;

/// A fused kernel of this shape (see the module doc).
#[derive(Clone, Copy)]
pub(crate) struct Pointwise {
    pub name: &'static str,
    pub inputs: usize,
    /// Blocks of whole rows (the block function gets the row length); else of `UNIT`s.
    pub rows: bool,
    /// One block: the inputs' parts, the output's part, the row length.
    pub block: fn(&[&[f32]], &mut [f32], usize),
}

impl Operator for Pointwise {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        self.name
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..self.inputs).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        let op = *self;
        Ok(Box::new(move |ctx: &ComputeContext| op.compute(ctx)))
    }
}

impl Pointwise {
    fn compute(&self, ctx: &ComputeContext) -> ort::Result<()> {
        let values = (0..self.inputs)
            .map(|i| input(ctx, self.name, i))
            .collect::<ort::Result<Vec<_>>>()?;
        let mut shape = None;
        let mut data: Vec<&[f32]> = Vec::with_capacity(values.len());
        for v in &values {
            let (s, d) = v.try_extract_tensor::<f32>()?;
            shape.get_or_insert_with(|| s.to_vec());
            data.push(d);
        }
        let shape = shape.unwrap_or_default();
        let len = data.first().map_or(0, |d| d.len());
        let cols = match self.rows {
            true => shape.last().copied().unwrap_or(1).max(1) as usize,
            false => 1,
        };
        if data.iter().any(|d| d.len() != len) || len % cols != 0 {
            let lengths: Vec<usize> = data.iter().map(|d| d.len()).collect();
            return Err(ort::Error::new(format!(
                "{}: inputs of {lengths:?} values (equal lengths, whole rows of {cols})",
                self.name
            )));
        }
        let mut out = output(ctx, self.name, 0, &shape)?;
        let (_, out) = out.try_extract_tensor_mut::<f32>()?;
        let unit = if self.rows { cols } else { UNIT };
        par_blocks(ctx, out, unit, |at, out| {
            let parts: Vec<&[f32]> = data.iter().map(|d| &d[at..at + out.len()]).collect();
            (self.block)(&parts, out, cols);
        })
    }
}
