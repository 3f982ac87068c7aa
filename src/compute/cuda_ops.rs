//! pipetrain's operators on ONNX Runtime's CUDA provider: custom operators whose kernels
//! (`kernels/*.cu`, compiled by NVRTC on first use) run on the session's own compute
//! stream, for what the provider runs slowly or in no fixed order.
//!
//! - `RowsAdd` (`graph::custom_ops::ROWS_ADD`): an embedding gradient summed in index
//!   order, instead of the one-hot product (`graph::scatter_adds_as_products`, 2 x
//!   indices x rows x row length operations: GPT-2 small's 19 ms of a 174 ms step on an
//!   H200) or ONNX Runtime's atomic scatter (no fixed order).
//!
//! The formulas are also written in Rust (`graph::rows_add_reference`), which the tests
//! hold the kernels and ONNX Runtime's CPU `ScatterElements` to, bit for bit.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::{DynTensorValueType, TensorElementType};

use super::cuda_launch::{compile, launch_planned};
use super::kernels::{rows_add_scratch, RowsAddAt, ROWS_ADD_SOURCE};
use crate::graph::custom_ops::ROWS_ADD;

/// `RowsAdd` on the CUDA provider.
pub(crate) struct RowsAdd;

impl Operator for RowsAdd {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ROWS_ADD
    }

    fn execution_provider_type(&self) -> Option<&str> {
        Some("CUDAExecutionProvider")
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        super::fused::rows_add_inputs()
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let rows = super::fused::rows_attribute(kctx)?;
        let state: Mutex<Option<Loaded>> = Mutex::new(None);
        Ok(Box::new(move |ctx: &ComputeContext| {
            let mut state = state
                .lock()
                .map_err(|_| ort::Error::new("RowsAdd: a kernel call panicked before"))?;
            rows_add(ctx, rows, &mut state)
        }))
    }
}

/// What a `RowsAdd` kernel keeps from call to call: its functions and the chain scratch.
struct Loaded {
    ctx: Arc<CudaContext>,
    chain: CudaFunction,
    zero: CudaFunction,
    sum: CudaFunction,
    scratch: Option<CudaSlice<i32>>,
}

fn fail(what: &str) -> impl Fn(cudarc::driver::DriverError) -> ort::Error + '_ {
    move |e| ort::Error::new(format!("RowsAdd: {what}: {e}"))
}

impl Loaded {
    fn new(device: usize) -> ort::Result<Loaded> {
        let ctx = CudaContext::new(device).map_err(fail("opening the device"))?;
        let ptx = compile(ROWS_ADD_SOURCE, "rows_add.cu")
            .map_err(|e| ort::Error::new(format!("RowsAdd: {e}")))?;
        let module = ctx.load_module(ptx).map_err(fail("loading the kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(fail("loading a kernel"));
        Ok(Loaded {
            chain: f("rows_chain")?,
            zero: f("rows_zero")?,
            sum: f("rows_sum")?,
            scratch: None,
            ctx,
        })
    }
}

/// One call: the chains, the zeroed table, the sums, on ONNX Runtime's stream.
fn rows_add(ctx: &ComputeContext, rows: i64, state: &mut Option<Loaded>) -> ort::Result<()> {
    let input = |i| {
        ctx.input(i)?
            .ok_or_else(|| ort::Error::new(format!("RowsAdd: no input {i}")))
    };
    let (indices, updates) = (input(0)?, input(1)?);
    let index_ref = indices.view().downcast::<DynTensorValueType>()?;
    let device = index_ref.memory_info().device_id() as usize;
    let update_ref = updates.view().downcast::<DynTensorValueType>()?;
    let n = indices.shape().iter().product::<i64>() as usize;
    let total = updates.shape().iter().product::<i64>() as usize;
    if n == 0 || total % n != 0 || rows <= 0 || n > i32::MAX as usize {
        return Err(ort::Error::new(format!(
            "RowsAdd: {n} indices, {total} update values, {rows} rows"
        )));
    }
    let row_len = total / n;
    let out = ctx
        .output(0, vec![rows, row_len as i64])?
        .ok_or_else(|| ort::Error::new("RowsAdd: no output"))?;
    let table = out.view().downcast::<DynTensorValueType>()?.data_ptr() as u64;
    let (idx, upd) = (index_ref.data_ptr() as u64, update_ref.data_ptr() as u64);
    if state.is_none() {
        *state = Some(Loaded::new(device)?);
    }
    let s = state.as_mut().expect("loaded above");
    let raw = ctx
        .stream()?
        .ok_or_else(|| ort::Error::new("RowsAdd: no CUDA stream"))?;
    // SAFETY: ONNX Runtime's compute stream of this session, alive through the call; all
    // work here is queued on it, in order with the session's other kernels.
    let stream = unsafe { s.ctx.wrap_borrowed_stream(raw.as_ptr().cast()) };
    let need = rows_add_scratch(n);
    if s.scratch.as_ref().is_none_or(|b| b.len() < need) {
        s.scratch = Some(
            stream
                .alloc_zeros::<i32>(need)
                .map_err(fail("allocating"))?,
        );
    }
    let (scratch, _sync) = s.scratch.as_ref().expect("made above").device_ptr(&stream);
    let at = RowsAddAt {
        indices: idx,
        updates: upd,
        table,
        scratch,
    };
    for l in super::kernels::rows_add(at, n, rows, row_len) {
        let f = match l.kernel {
            "rows_chain" => &s.chain,
            "rows_zero" => &s.zero,
            _ => &s.sum,
        };
        // SAFETY: the plan was made for these buffers: `indices` holds n values,
        // `updates` n x row_len, the table rows x row_len, the scratch what the plan
        // asks for.
        unsafe { launch_planned(&stream, f, &l) }.map_err(fail("launching"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{Device, GraphSession, Runtime, SessionOptions};
    use crate::graph::{int_attr, make_node, rows_add_reference, ValueMeta};
    use crate::onnx::proto::ModelProto;
    use crate::tensor::{DType, Tensor};

    /// A graph of one `RowsAdd`.
    fn rows_add_model(n: usize, width: usize, rows: i64) -> ModelProto {
        let attrs = vec![int_attr("rows", rows)];
        let node = make_node(ROWS_ADD, "rows_add", &["ids", "updates"], &["table"], attrs);
        let meta = |dtype, shape| ValueMeta { dtype, shape };
        let inputs = [
            ("ids", meta(DType::I64, vec![n])),
            ("updates", meta(DType::F32, vec![n, width])),
        ];
        crate::compute::test_model::model("rows_add", vec![node], &inputs, &["table"])
    }

    /// On a GPU (skipped without one): `RowsAdd` on ONNX Runtime's CUDA provider gives
    /// bitwise its Rust formula (so ONNX Runtime's CPU scatter, `tests/it/deterministic.rs`)
    /// on random updates, with repeated, negative and out-of-range indices; twice the same.
    #[test]
    fn on_a_gpu_rows_add_is_its_formula_bit_for_bit() {
        if crate::compute::test_model::no_gpu() {
            return;
        }
        let rt = Runtime::from_env().unwrap();
        let (n, width, rows) = (4096usize, 300usize, 1000i64);
        let mut seed = 5u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let ids: Vec<i64> = (0..n)
            .map(|i| {
                if i == 7 {
                    5000
                } else {
                    (next() % 900) as i64 - 3
                }
            })
            .collect();
        let updates: Vec<f32> = (0..n * width)
            .map(|_| (next() % 999_983) as f32 / 999_983.0 - 0.5)
            .collect();
        let opts = SessionOptions {
            device: Device::Cuda(0),
            ..SessionOptions::default()
        };
        let mut s =
            GraphSession::from_model(&rt, &rows_add_model(n, width, rows), &opts, "rows_add")
                .unwrap();
        let ids_t = Tensor::i64(vec![n], ids.clone()).unwrap();
        let upd_t = Tensor::f32(vec![n, width], updates.clone()).unwrap();
        let run = |s: &mut GraphSession| {
            s.run(&[("ids", &ids_t), ("updates", &upd_t)])
                .unwrap()
                .remove(0)
        };
        let (a, b) = (run(&mut s), run(&mut s));
        let want = rows_add_reference(&ids, &updates, rows as usize);
        assert_eq!(a.shape, vec![rows as usize, width]);
        let got = a.as_f32().unwrap();
        let same = got
            .iter()
            .zip(&want)
            .filter(|(x, y)| x.to_bits() == y.to_bits())
            .count();
        assert_eq!(
            same,
            want.len(),
            "{} of {} values differ",
            want.len() - same,
            want.len()
        );
        assert!(a.as_f32() == b.as_f32(), "a second run differs");
    }
}
