//! pipetrain's fused kernels on ONNX Runtime's CUDA provider (`kernels/fused.cu`),
//! chosen from a device-side profile of GPT-2 small's step on an H200 (Nsight Compute,
//! 2026-11-27, `benches/gpu/RESULTS.md`), where the standard-op forms were many passes
//! over the step's largest activations:
//!
//! - `TanhGelu` and `TanhGeluGrad` (`graph::fusion::fuse_tanh_gelu`): GPT-2's GELU, eight
//!   forward and about fifteen backward kernels over `[batch, seq, 4 d]`, ~10 ms a step;
//! - `SoftmaxGrad` (the autodiff's softmax backward with `OpChoice::cuda`): four kernels
//!   over the attention probabilities `[batch, heads, seq, seq]`, ~9 ms a step.
//!
//! Each runs on the session's compute stream. The CPU has the same operators
//! (`compute/fused`), which a graph built for a GPU needs for its shape measurement.
//! One NVRTC compile serves every node of a session (the module is shared by the
//! operators [`operators`] makes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction};
use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::{DynTensorValueType, TensorElementType};

use super::cuda_launch::{compile, launch_planned};
use super::kernels::{self, FUSED_SOURCE};
use crate::graph::custom_ops::{SOFTMAX_GRAD, TANH_GELU, TANH_GELU_GRAD};

/// Which kernel an operator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    TanhGelu,
    TanhGeluGrad,
    SoftmaxGrad,
}

impl Kind {
    fn op(self) -> &'static str {
        match self {
            Kind::TanhGelu => TANH_GELU,
            Kind::TanhGeluGrad => TANH_GELU_GRAD,
            Kind::SoftmaxGrad => SOFTMAX_GRAD,
        }
    }

    fn inputs(self) -> usize {
        if self == Kind::TanhGelu {
            1
        } else {
            2
        }
    }
}

/// The compiled module of one device, loaded on first use, with the kernels looked up
/// so far (a call finds its kernel here, not in the module).
pub(super) type Shared = Arc<Mutex<Option<Loaded>>>;

/// What [`Shared`] holds once loaded.
pub(super) struct Loaded {
    device: usize,
    ctx: Arc<CudaContext>,
    module: Arc<cudarc::driver::CudaModule>,
    functions: HashMap<&'static str, CudaFunction>,
}

/// An operator of this module on the CUDA provider.
pub(crate) struct CudaFused {
    kind: Kind,
    module: Shared,
}

/// The operators, sharing one compiled module (`module`, empty until first used).
pub(crate) fn operators(module: &Shared) -> [CudaFused; 3] {
    [Kind::TanhGelu, Kind::TanhGeluGrad, Kind::SoftmaxGrad].map(|kind| CudaFused {
        kind,
        module: module.clone(),
    })
}

impl Operator for CudaFused {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        self.kind.op()
    }

    fn execution_provider_type(&self) -> Option<&str> {
        Some("CUDAExecutionProvider")
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..self.kind.inputs()).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let (kind, module) = (self.kind, self.module.clone());
        let constants = match kind {
            Kind::SoftmaxGrad => (0.0, 0.0),
            _ => super::fused::tanh_gelu_constants(info, kind.op())?,
        };
        Ok(Box::new(move |ctx: &ComputeContext| {
            run(ctx, kind, constants, &module)
        }))
    }
}

/// The error of operator `op` where `what` failed with `e`.
pub(super) fn fail(op: &str, what: &str, e: impl std::fmt::Display) -> ort::Error {
    ort::Error::new(format!("{op}: {what}: {e}"))
}

/// The kernel `entry` (for operator `op`) of `fused.cu` on `device`, compiling and
/// loading the module there first.
pub(super) fn function(
    module: &Shared,
    device: usize,
    op: &str,
    entry: &'static str,
) -> ort::Result<(Arc<CudaContext>, CudaFunction)> {
    function_in(module, (FUSED_SOURCE, "fused.cu"), device, op, entry)
}

/// The kernel `entry` (for operator `op`) of `source` (named as NVRTC names it) on
/// `device`, compiling and loading the module there first.
pub(super) fn function_in(
    module: &Shared,
    (source, name): (&str, &str),
    device: usize,
    op: &str,
    entry: &'static str,
) -> ort::Result<(Arc<CudaContext>, CudaFunction)> {
    let mut m = module
        .lock()
        .map_err(|_| ort::Error::new(format!("{op}: a kernel call panicked before")))?;
    if m.as_ref().is_none_or(|l| l.device != device) {
        let ctx = CudaContext::new(device).map_err(|e| fail(op, "opening the device", e))?;
        let ptx = compile(source, name).map_err(|e| fail(op, "compiling", e))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| fail(op, "loading the kernels", e))?;
        let functions = HashMap::new();
        *m = Some(Loaded {
            device,
            ctx,
            module,
            functions,
        });
    }
    let l = m.as_mut().expect("loaded above");
    let f = match l.functions.get(entry) {
        Some(f) => f.clone(),
        None => {
            let f = l
                .module
                .load_function(entry)
                .map_err(|e| fail(op, "loading a kernel", e))?;
            l.functions.insert(entry, f.clone());
            f
        }
    };
    Ok((l.ctx.clone(), f))
}

/// One call on ONNX Runtime's stream: the output of the inputs' shape.
fn run(
    ctx: &ComputeContext,
    kind: Kind,
    (scale, coef): (f32, f32),
    module: &Shared,
) -> ort::Result<()> {
    let op = kind.op();
    let values = (0..kind.inputs())
        .map(|i| {
            ctx.input(i)?
                .ok_or_else(|| ort::Error::new(format!("{op}: no input {i}")))
        })
        .collect::<ort::Result<Vec<_>>>()?;
    let shape = values[0].shape().to_vec();
    if values.iter().any(|v| v.shape().to_vec() != shape) {
        return Err(ort::Error::new(format!("{op}: inputs of different shapes")));
    }
    let mut ptrs = Vec::with_capacity(values.len() + 1);
    let mut device = 0;
    for v in &values {
        let t = v.view().downcast::<DynTensorValueType>()?;
        device = t.memory_info().device_id() as usize;
        ptrs.push(t.data_ptr() as u64);
    }
    let out = ctx
        .output(0, shape.clone())?
        .ok_or_else(|| ort::Error::new(format!("{op}: no output")))?;
    ptrs.push(out.view().downcast::<DynTensorValueType>()?.data_ptr() as u64);
    let n: usize = shape.iter().map(|&d| d.max(0) as usize).product();
    if n == 0 {
        return Ok(());
    }
    let plan = match kind {
        Kind::TanhGelu => kernels::tanh_gelu(ptrs[0], ptrs[1], n, (scale, coef)),
        Kind::TanhGeluGrad => kernels::tanh_gelu_grad(ptrs[0], ptrs[1], ptrs[2], n, (scale, coef)),
        Kind::SoftmaxGrad => {
            let m = shape.last().copied().unwrap_or(1).max(1) as usize;
            kernels::softmax_grad(ptrs[0], ptrs[1], ptrs[2], n, m)
        }
    };
    let (cuda, f) = function(module, device, op, plan.kernel)?;
    let raw = ctx
        .stream()?
        .ok_or_else(|| ort::Error::new(format!("{op}: no CUDA stream")))?;
    // SAFETY: ONNX Runtime's compute stream of this session, alive through the call; the
    // kernel is queued on it, in order with the session's other kernels.
    let stream = unsafe { cuda.wrap_borrowed_stream(raw.as_ptr().cast()) };
    // SAFETY: the plan was made for these buffers: the inputs and the output hold n
    // values each (checked above: one shape).
    unsafe { launch_planned(&stream, &f, &plan) }.map_err(|e| fail(op, "launching", e))
}

#[cfg(test)]
mod tests {
    use crate::compute::{Device, GraphSession, Runtime, SessionOptions};
    use crate::graph::custom_ops::{SOFTMAX_GRAD, TANH_GELU, TANH_GELU_GRAD};
    use crate::graph::{float_attr, make_node, tanh_gelu, tanh_gelu_slope, ValueMeta};
    use crate::onnx::proto::ModelProto;
    use crate::tensor::{DType, Tensor};

    const SCALE: f32 = 0.797_884_6;
    const COEF: f32 = 0.044_715;

    /// One node of each kernel: `TanhGelu(x)`, `TanhGeluGrad(dy, x)`, `SoftmaxGrad(dy, y)`.
    fn model(rows: usize, m: usize) -> ModelProto {
        let attrs = || vec![float_attr("scale", SCALE), float_attr("coef", COEF)];
        let nodes = vec![
            make_node(TANH_GELU, "g", &["x"], &["g"], attrs()),
            make_node(TANH_GELU_GRAD, "dg", &["dy", "x"], &["dg"], attrs()),
            make_node(SOFTMAX_GRAD, "ds", &["dy", "y"], &["ds"], vec![]),
        ];
        let meta = ValueMeta {
            dtype: DType::F32,
            shape: vec![rows, m],
        };
        let inputs = ["x", "dy", "y"].map(|v| (v, meta.clone()));
        crate::compute::test_model::model("fused", nodes, &inputs, &["g", "dg", "ds"])
    }

    /// Runs the three kernels on `device` over fresh random inputs (x across GELU's
    /// curve, y rows of a softmax) and holds each to its formula: the GELU's float32
    /// formula in Rust (CUDA's `tanhf` is within 2 ulp of it, which the backward's
    /// `1 - t^2` scales by up to ~30 at |x| = 6), softmax's in float64; returns the
    /// outputs.
    fn check(device: Device, rows: usize, m: usize, seed: u64) -> Vec<Tensor> {
        let mut s = seed;
        let mut uniform = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        let n = rows * m;
        let x: Vec<f32> = (0..n).map(|_| uniform() * 12.0 - 6.0).collect();
        let dy: Vec<f32> = (0..n).map(|_| uniform() * 2.0 - 1.0).collect();
        let mut y: Vec<f32> = (0..n).map(|_| (uniform() * 4.0).exp()).collect();
        for row in y.chunks_mut(m) {
            let sum: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= sum);
        }
        let rt = Runtime::from_env().unwrap();
        let opts = SessionOptions {
            device,
            ..SessionOptions::default()
        };
        let mut session = GraphSession::from_model(&rt, &model(rows, m), &opts, "fused").unwrap();
        let t = |v: &Vec<f32>| Tensor::f32(vec![rows, m], v.clone()).unwrap();
        let (xt, dyt, yt) = (t(&x), t(&dy), t(&y));
        let out = session
            .run(&[("x", &xt), ("dy", &dyt), ("y", &yt)])
            .unwrap();
        let got = |k: usize| out[k].as_f32().unwrap().to_vec();
        let (g, dg, ds) = (got(0), got(1), got(2));
        for i in 0..n {
            let (want_g, want_dg) = (
                tanh_gelu(x[i], SCALE, COEF),
                dy[i] * tanh_gelu_slope(x[i], SCALE, COEF),
            );
            assert!(
                (g[i] - want_g).abs() <= 2e-6 * want_g.abs().max(1.0),
                "TanhGelu({}) {} not {want_g}",
                x[i],
                g[i]
            );
            assert!(
                (dg[i] - want_dg).abs() <= 1e-5 * want_dg.abs().max(1.0),
                "TanhGeluGrad at {}: {} not {want_dg}",
                x[i],
                dg[i]
            );
        }
        for (r, ((d, a), b)) in ds.chunks(m).zip(dy.chunks(m)).zip(y.chunks(m)).enumerate() {
            let sum: f64 = a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum();
            for j in 0..m {
                let want = b[j] as f64 * (a[j] as f64 - sum);
                let err = (d[j] as f64 - want).abs();
                assert!(
                    err <= 2e-6 * b[j] as f64 + 1e-9,
                    "SoftmaxGrad row {r} [{j}]: {} not {want}",
                    d[j]
                );
            }
        }
        out
    }

    /// On the CPU (the kernels a GPU graph's shape measurement runs), with the CUDA
    /// operators registered beside them under the same names.
    #[test]
    fn on_the_cpu_the_fused_kernels_are_their_formulas() {
        check(Device::Cpu, 300, 1000, 3);
    }

    /// On a GPU (skipped without one): each kernel is its formula, on rows longer than a
    /// block and not a multiple of it, and a second run gives the same bits.
    #[test]
    fn on_a_gpu_the_fused_kernels_are_their_formulas_and_repeat() {
        if crate::compute::test_model::no_gpu() {
            return;
        }
        let a = check(Device::Cuda(0), 3000, 1000, 9);
        let b = check(Device::Cuda(0), 3000, 1000, 9);
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.as_f32() == b.as_f32()),
            "a second run differs"
        );
    }
}
