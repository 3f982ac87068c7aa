//! `LayerNormGrad` on ONNX Runtime's CUDA provider (`kernels/fused.cu`): `dY, X, scale,
//! mean, inv_std` in, `dX, dscale, dbias` out, as the CPU's (`compute/fused/layer_norm.rs`)
//! computes them. On an H200, GPT-2 small's LayerNorm backward in standard ops was about
//! a dozen kernels over `[4096, 768]` per LayerNorm, ~3 ms of the device's step
//! (Nsight Compute, 2026-11-27). Three launches, every sum in a fixed order: a block a
//! row for `dX` (`ln_grad_rows`), the column sums of chunks of rows (`ln_grad_cols`),
//! then of the chunks (`ln_grad_finish`).
//!
//! It was written after that lease, so the autodiff's LayerNorm rule emits it in a graph
//! for a GPU only with `runtime.cuda_kernels_untried` (`OpChoice::cuda_untried`) until a
//! GPU has run `on_a_gpu_layer_norm_grad_is_its_formula` below and measured GPT-2 with
//! it (`scripts/gpu-check.sh`). Its source and launch plan
//! (`compute::kernels::layer_norm_grad`) already run on the CPU in the emulator's tests,
//! against float64.

use std::sync::Mutex;

use cudarc::driver::{CudaSlice, DevicePtr};
use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::{DynTensorValueType, TensorElementType};

use super::cuda_fused::{fail, function, Shared};
use super::cuda_launch::launch_planned;
use super::kernels::{layer_norm_grad, layer_norm_grad_scratch, LayerNormGradAt};
use crate::graph::custom_ops::LAYER_NORM_GRAD;

/// `LayerNormGrad` on the CUDA provider.
pub(crate) struct CudaLayerNormGrad {
    pub module: Shared,
}

impl Operator for CudaLayerNormGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        LAYER_NORM_GRAD
    }

    fn execution_provider_type(&self) -> Option<&str> {
        Some("CUDAExecutionProvider")
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..5).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..3).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        let module = self.module.clone();
        let scratch: Mutex<Option<CudaSlice<f32>>> = Mutex::new(None);
        Ok(Box::new(move |ctx: &ComputeContext| {
            let mut scratch = scratch
                .lock()
                .map_err(|_| ort::Error::new("LayerNormGrad: a kernel call panicked before"))?;
            run(ctx, &module, &mut scratch)
        }))
    }
}

/// One call on ONNX Runtime's stream.
fn run(
    ctx: &ComputeContext,
    module: &Shared,
    scratch: &mut Option<CudaSlice<f32>>,
) -> ort::Result<()> {
    const OP: &str = LAYER_NORM_GRAD;
    let values = (0..5)
        .map(|i| {
            ctx.input(i)?
                .ok_or_else(|| ort::Error::new(format!("{OP}: no input {i}")))
        })
        .collect::<ort::Result<Vec<_>>>()?;
    let len = |i: usize| values[i].shape().iter().product::<i64>().max(0) as usize;
    let (n, cols, rows) = (len(1), len(2), len(3));
    if cols == 0 || len(0) != n || rows * cols != n || len(4) != rows {
        return Err(ort::Error::new(format!(
            "{OP}: X of {n} values, dY {}, scale {cols}, statistics {rows} and {}",
            len(0),
            len(4)
        )));
    }
    let mut ptrs = Vec::with_capacity(8);
    let mut device = 0;
    for v in &values {
        let t = v.view().downcast::<DynTensorValueType>()?;
        device = t.memory_info().device_id() as usize;
        ptrs.push(t.data_ptr() as u64);
    }
    let (x_shape, scale_shape) = (values[1].shape().to_vec(), values[2].shape().to_vec());
    let out = |i: usize, shape: &[i64]| -> ort::Result<u64> {
        let v = ctx
            .output(i, shape.to_vec())?
            .ok_or_else(|| ort::Error::new(format!("{OP}: no output {i}")))?;
        Ok(v.view().downcast::<DynTensorValueType>()?.data_ptr() as u64)
    };
    let (dx, ds, db) = (
        out(0, &x_shape)?,
        out(1, &scale_shape)?,
        out(2, &scale_shape)?,
    );
    let [dy, x, scale, mean, inv] = [ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4]];
    let raw = ctx
        .stream()?
        .ok_or_else(|| ort::Error::new(format!("{OP}: no CUDA stream")))?;
    let (cuda, _) = function(module, device, OP, "ln_grad_rows")?;
    // SAFETY: ONNX Runtime's compute stream of this session, alive through the call; the
    // kernels are queued on it, in order with the session's other kernels.
    let stream = unsafe { cuda.wrap_borrowed_stream(raw.as_ptr().cast()) };
    let need = layer_norm_grad_scratch(rows, cols);
    if scratch.as_ref().is_none_or(|s| s.len() < need) {
        *scratch = Some(
            stream
                .alloc_zeros::<f32>(need)
                .map_err(|e| fail(OP, "allocating", e))?,
        );
    }
    let (base, _sync) = scratch.as_ref().expect("made above").device_ptr(&stream);
    let at = LayerNormGradAt {
        dy,
        x,
        scale,
        mean,
        inv,
        dx,
        dscale: ds,
        dbias: db,
        scratch: base,
    };
    for l in layer_norm_grad(at, rows, cols) {
        let (_, f) = function(module, device, OP, l.kernel)?;
        // SAFETY: the plan was made for these buffers: dY, X and dX hold rows x cols
        // values, scale, dscale and dbias cols, the statistics rows (checked above), the
        // scratch what the plan asks for.
        unsafe { launch_planned(&stream, &f, &l) }.map_err(|e| fail(OP, "launching", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::compute::{Device, GraphSession, Runtime, SessionOptions};
    use crate::graph::custom_ops::LAYER_NORM_GRAD;
    use crate::graph::{make_node, ValueMeta};
    use crate::onnx::proto::ModelProto;
    use crate::tensor::{DType, Tensor};

    /// One `LayerNormGrad` over `[rows, cols]`.
    fn model(rows: usize, cols: usize) -> ModelProto {
        let inputs = ["dy", "x", "scale", "mean", "inv"];
        let outputs = ["dx", "ds", "db"];
        let node = make_node(LAYER_NORM_GRAD, "ln_grad", &inputs, &outputs, vec![]);
        let meta = |shape| ValueMeta {
            dtype: DType::F32,
            shape,
        };
        let (full, row, col) = (vec![rows, cols], vec![rows, 1], vec![cols]);
        let shapes = [&full, &full, &col, &row, &row];
        let inputs: Vec<(&str, ValueMeta)> = inputs
            .iter()
            .zip(shapes)
            .map(|(n, s)| (*n, meta(s.clone())))
            .collect();
        crate::compute::test_model::model("ln_grad", vec![node], &inputs, &outputs)
    }

    /// On a GPU (skipped without one): the CUDA kernel gives the CPU kernel's `dX`,
    /// `dscale` and `dbias` (that one is held to the standard-op graph in
    /// `tests/it/fused_kernels.rs`) within float32 reordering, on rows longer than a
    /// block and more rows than chunks, and the same bits twice.
    #[test]
    fn on_a_gpu_layer_norm_grad_is_its_formula() {
        if crate::compute::test_model::no_gpu() {
            return;
        }
        let (rows, cols) = (1000usize, 700usize);
        let mut s = 17u64;
        let mut uniform = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut v = |n: usize, lo: f32, width: f32| -> Vec<f32> {
            (0..n).map(|_| lo + width * (uniform() + 0.5)).collect()
        };
        let (dy, x, scale) = (
            v(rows * cols, -1.0, 2.0),
            v(rows * cols, -3.0, 6.0),
            v(cols, 0.5, 1.0),
        );
        let (mean, inv) = (v(rows, -0.2, 0.4), v(rows, 0.5, 1.5));
        let t = |shape: Vec<usize>, data: &Vec<f32>| Tensor::f32(shape, data.clone()).unwrap();
        let feeds = [
            ("dy", t(vec![rows, cols], &dy)),
            ("x", t(vec![rows, cols], &x)),
            ("scale", t(vec![cols], &scale)),
            ("mean", t(vec![rows, 1], &mean)),
            ("inv", t(vec![rows, 1], &inv)),
        ];
        let feeds: Vec<(&str, &Tensor)> = feeds.iter().map(|(n, t)| (*n, t)).collect();
        let rt = Runtime::from_env().unwrap();
        let run = |device| {
            let opts = SessionOptions {
                device,
                ..SessionOptions::default()
            };
            let mut s = GraphSession::from_model(&rt, &model(rows, cols), &opts, "ln").unwrap();
            s.run(&feeds).unwrap()
        };
        let (cpu, gpu, again) = (run(Device::Cpu), run(Device::Cuda(0)), run(Device::Cuda(0)));
        for (k, tol) in [(0, 2e-5), (1, 2e-5), (2, 2e-5)] {
            let (a, b) = (cpu[k].as_f32().unwrap(), gpu[k].as_f32().unwrap());
            let scale = a.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let worst = a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(worst <= tol * scale, "output {k}: {worst} of {scale}");
            assert!(
                gpu[k].as_f32() == again[k].as_f32(),
                "output {k}: a second run differs"
            );
        }
    }
}
