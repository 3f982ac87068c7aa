//! `Attention`, `PackedAttention` and their backward on ONNX Runtime's CUDA provider:
//! the plan of `compute::kernels::attention` (the products on cuBLAS, reading and writing
//! the tensors where they lie; `attention.cu`'s row kernels between them), all on the
//! session's compute stream.
//!
//! In the standard-op graph GPT-2's attention is, per layer, the transposes of Q, K and V,
//! the two batched products, the scale, the causal `Where` and the softmax, and about
//! twice as many kernels in the backward, several of them passes over the probabilities
//! `[B, H, T, T]` (on an H200, 16 ms of the products and ~6 ms of element-wise passes
//! over them in GPT-2 small's 96 ms step; `benches/gpu/RESULTS.md`). Here the forward is
//! two products a batch entry and one row kernel, the backward four products and one row
//! kernel. With `lse = 1` (`runtime.flash_attention`) it is `flash.rs`'s plan
//! instead: one kernel forward, four backward, and no `[B, H, T, S]` probabilities kept
//! or computed in global memory.
//!
//! Only for graphs built with `runtime.cuda_kernels_untried` (a GPU run; an additive mask
//! is read with its broadcast strides, a causal one is the kernel's own), until a lent GPU has run it (the device tests, `cuda_attention/tests.rs`)
//! and measured GPT-2 with it (`scripts/gpu-check.sh`). Its plan runs on the CPU in the
//! emulator's tests, against float64.

use std::sync::Mutex;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::{DynTensorValueType, TensorElementType};

use super::cuda_blas::{gemm, handle, Handle};
use super::cuda_fused::{fail, function_in, Shared};
use super::cuda_launch::launch_planned;
use super::fused::{attention_mask_strides, attention_views, AttentionAttributes, View};
use super::kernels::{
    self, AttentionAt, AttentionGradAt, FlashGradAt, Mat, Step, ATTENTION_SOURCE,
};
use crate::graph::custom_ops::{
    ATTENTION, ATTENTION_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD,
};

/// One of the four operators on the CUDA provider.
pub(crate) struct CudaAttention {
    pub backward: bool,
    pub packed: bool,
    /// `attention.cu`, compiled once for every node of the session.
    pub module: Shared,
}

impl CudaAttention {
    /// The four, sharing `module`.
    pub(crate) fn all(module: &Shared) -> [CudaAttention; 4] {
        [(false, false), (false, true), (true, false), (true, true)].map(|(packed, backward)| {
            CudaAttention {
                backward,
                packed,
                module: module.clone(),
            }
        })
    }

    fn parts(&self) -> usize {
        if self.packed {
            1
        } else {
            3
        }
    }
}

impl Operator for CudaAttention {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        match (self.packed, self.backward) {
            (false, false) => ATTENTION,
            (false, true) => ATTENTION_GRAD,
            (true, false) => PACKED_ATTENTION,
            (true, true) => PACKED_ATTENTION_GRAD,
        }
    }

    fn execution_provider_type(&self) -> Option<&str> {
        Some("CUDAExecutionProvider")
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let f32 = TensorElementType::Float32;
        // As the CPU operator's (`compute/fused/attention`): with `lse`, the backward's
        // `O` and mask are its optional inputs.
        let (required, optional) = match self.backward {
            true => (self.parts() + 2, 2),
            false => (self.parts(), 1),
        };
        let required = (0..required).map(move |_| OperatorInput::required(f32));
        required.chain((0..optional).map(move |_| OperatorInput::optional(f32)))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        let n = if self.backward { self.parts() } else { 2 };
        (0..n).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let op = Call {
            name: self.name().to_string(),
            attrs: AttentionAttributes::of(info, self.name())?,
            parts: self.parts(),
            backward: self.backward,
            module: self.module.clone(),
        };
        let state: Mutex<State> = Mutex::new(State::default());
        Ok(Box::new(move |ctx: &ComputeContext| {
            let mut state = state.lock().map_err(|_| {
                ort::Error::new(format!("{}: a kernel call panicked before", op.name))
            })?;
            op.run(ctx, &mut state)
        }))
    }
}

/// What a node's kernel knows from its attributes.
struct Call {
    name: String,
    attrs: AttentionAttributes,
    parts: usize,
    backward: bool,
    module: Shared,
}

/// What a node's kernel keeps from call to call: its cuBLAS handle and the backward's
/// scratch.
#[derive(Default)]
struct State {
    blas: Option<Handle>,
    scratch: Option<CudaSlice<f32>>,
}

/// An input tensor: its address, shape and device.
fn input(ctx: &ComputeContext, i: usize, op: &str) -> ort::Result<(u64, Vec<i64>, usize)> {
    let v = ctx
        .input(i)?
        .ok_or_else(|| ort::Error::new(format!("{op}: no input {i}")))?;
    let t = v.view().downcast::<DynTensorValueType>()?;
    let device = t.memory_info().device_id() as usize;
    Ok((t.data_ptr() as u64, v.shape().to_vec(), device))
}

/// Output `i` of `shape`: its address.
fn output(ctx: &ComputeContext, i: usize, shape: Vec<i64>, op: &str) -> ort::Result<u64> {
    let v = ctx
        .output(i, shape)?
        .ok_or_else(|| ort::Error::new(format!("{op}: no output {i}")))?;
    Ok(v.view().downcast::<DynTensorValueType>()?.data_ptr() as u64)
}

/// An input tensor's address and shape.
type Input = (u64, Vec<i64>);

impl Call {
    fn run(&self, ctx: &ComputeContext, state: &mut State) -> ort::Result<()> {
        let op = self.name.as_str();
        let first = usize::from(self.backward);
        let inputs = (first..first + self.parts)
            .map(|i| input(ctx, i, op))
            .collect::<ort::Result<Vec<_>>>()?;
        let device = inputs[0].2;
        let tensors: Vec<Input> = inputs
            .into_iter()
            .map(|(at, shape, _)| (at, shape))
            .collect();
        let raw = ctx
            .stream()?
            .ok_or_else(|| ort::Error::new(format!("{op}: no CUDA stream")))?;
        let source = (ATTENTION_SOURCE, "attention.cu");
        let (cuda, _) = function_in(&self.module, source, device, op, "attn_softmax")?;
        // SAFETY: ONNX Runtime's compute stream of this session, alive through the call;
        // everything here is queued on it, in order with the session's other kernels.
        let stream = unsafe { cuda.wrap_borrowed_stream(raw.as_ptr().cast()) };
        let plan = match self.backward {
            true => self.backward_plan(ctx, &tensors, &stream, state)?,
            false => self.forward_plan(ctx, &tensors)?,
        };
        let plan = plan.map_err(|e| ort::Error::new(format!("{op}: {e}")))?;
        self.execute(&plan, &stream, device, state)
    }

    /// The views of q, kt, v and of O (its stored shape too), and where they are, the
    /// output (or its gradient) at `o` and the probabilities at `p`.
    fn layout(
        &self,
        tensors: &[Input],
        (o, p): (u64, u64),
    ) -> ort::Result<(AttentionAt, [View; 3])> {
        let part = |i: usize| &tensors[i.min(self.parts - 1)];
        let shapes = [0, 1, 2].map(|i| part(i).1.as_slice());
        let views = attention_views(&self.name, &self.attrs, shapes)?;
        let [q, kt, v] = &views;
        let [b, h, t, _] = q.dims;
        let o_view = View::made([b, h, t, v.dims[3]], self.attrs.out).1;
        let x = AttentionAt {
            batch: b,
            heads: h,
            q: Mat::of(q, part(0).0),
            kt: Mat::of(kt, part(1).0),
            v: Mat::of(v, part(2).0),
            o: Mat::of(&o_view, o),
            p,
            mask: None,
        };
        Ok((x, views))
    }

    /// The forward: O and P made as outputs, and the plan that fills them.
    fn forward_plan(
        &self,
        ctx: &ComputeContext,
        tensors: &[Input],
    ) -> ort::Result<Result<Vec<Step>, String>> {
        let op = self.name.as_str();
        let (shape, _) = self.layout(tensors, (0, 0))?;
        let (b, h, t, s, e) = (
            shape.batch,
            shape.heads,
            shape.q.rows,
            shape.kt.cols,
            shape.v.cols,
        );
        let (o_shape, _) = View::made([b, h, t, e], self.attrs.out);
        let o = output(ctx, 0, o_shape, op)?;
        let p = output(ctx, 1, self.attrs.kept([b, h, t, s]), op)?;
        let (mut x, _) = self.layout(tensors, (o, p))?;
        x.mask = self.mask(ctx, self.parts, [b, h, t, s])?;
        let (scale, causal) = (self.attrs.scale, self.attrs.causal);
        Ok(match self.attrs.lse {
            true => kernels::flash_attention(&x, scale, causal),
            false => kernels::attention(&x, scale, causal),
        })
    }

    /// The additive mask at input `i` where there is one: where, and its strides over
    /// the scores `[b, h, t, s]`.
    fn mask(
        &self,
        ctx: &ComputeContext,
        i: usize,
        [b, h, t, s]: [usize; 4],
    ) -> ort::Result<Option<(u64, [usize; 4])>> {
        let op = self.name.as_str();
        if ctx.num_inputs()? <= i || ctx.input(i)?.is_none() {
            return Ok(None);
        }
        let (at, mask_shape, _) = input(ctx, i, op)?;
        let strides = attention_mask_strides(&mask_shape, [b, h, t, s]).ok_or_else(|| {
            ort::Error::new(format!(
                "{op}: a mask of shape {mask_shape:?} for scores [{b}, {h}, {t}, {s}]"
            ))
        })?;
        Ok(Some((at, strides)))
    }

    /// The backward: the gradients made as outputs (each its input's shape), the scratch
    /// grown to size, and the plan that fills them.
    fn backward_plan(
        &self,
        ctx: &ComputeContext,
        tensors: &[Input],
        stream: &std::sync::Arc<CudaStream>,
        state: &mut State,
    ) -> ort::Result<Result<Vec<Step>, String>> {
        let op = self.name.as_str();
        let (d_o, p) = (input(ctx, 0, op)?.0, input(ctx, self.parts + 1, op)?.0);
        let (mut x, [q, kt, v]) = self.layout(tensors, (d_o, p))?;
        let need = match self.attrs.lse {
            true => kernels::flash_grad_scratch(&x),
            false => kernels::attention_grad_scratch(&x),
        };
        if state.scratch.as_ref().is_none_or(|b| b.len() < need) {
            let fresh = stream.alloc_zeros::<f32>(need.max(1));
            state.scratch = Some(fresh.map_err(|e| fail(op, "allocating", e))?);
        }
        let scratch = state.scratch.as_ref().expect("made above");
        let (scratch, _sync) = scratch.device_ptr(stream);
        let outs = (0..self.parts)
            .map(|i| output(ctx, i, tensors[i].1.clone(), op))
            .collect::<ort::Result<Vec<_>>>()?;
        let out = |i: usize| outs[i.min(self.parts - 1)];
        let zero = self.uncovered(&tensors[0].1).map(|n| (outs[0], n));
        if self.attrs.lse {
            let (b, h, t, s) = (x.batch, x.heads, x.q.rows, x.kt.cols);
            x.mask = self.mask(ctx, self.parts + 3, [b, h, t, s])?;
            let o = input(ctx, self.parts + 2, op)?.0;
            let g = FlashGradAt {
                out: Mat {
                    at: o + (x.o.at - d_o),
                    ..x.o
                },
                dq: Mat::of(&q, out(0)),
                dkt: Mat::of(&kt, out(1)),
                dv: Mat::of(&v, out(2)),
                zero,
                delta: scratch,
            };
            let (scale, causal) = (self.attrs.scale, self.attrs.causal);
            return Ok(kernels::flash_attention_grad(&x, &g, scale, causal));
        }
        let g = AttentionGradAt {
            dq: Mat::of(&q, out(0)),
            dkt: Mat::of(&kt, out(1)),
            dv: Mat::of(&v, out(2)),
            zero,
            scratch,
        };
        Ok(kernels::attention_grad(&x, &g, self.attrs.scale))
    }

    /// Where the packed gradient has values no part covers: all of them, to zero.
    fn uncovered(&self, shape: &[i64]) -> Option<usize> {
        let (hd, offsets) = self.attrs.packed?;
        let w = shape.last().copied().unwrap_or(0).max(0) as usize;
        let part = hd[0] * hd[1];
        let mut starts = offsets;
        starts.sort_unstable();
        let covered = starts == [0, part, 2 * part] && w == 3 * part;
        (!covered).then(|| shape.iter().map(|&d| d.max(0) as usize).product())
    }

    /// Queues `plan` on `stream`.
    fn execute(
        &self,
        plan: &[Step],
        stream: &std::sync::Arc<CudaStream>,
        device: usize,
        state: &mut State,
    ) -> ort::Result<()> {
        let op = self.name.as_str();
        for step in plan {
            match step {
                Step::Kernel(l) => {
                    let source = (ATTENTION_SOURCE, "attention.cu");
                    let (_, f) = function_in(&self.module, source, device, op, l.kernel)?;
                    // SAFETY: the plan was made for this call's tensors and scratch.
                    unsafe { launch_planned(stream, &f, l) }
                        .map_err(|e| fail(op, "launching", e))?;
                }
                Step::Gemm(g) => {
                    let handle = handle(&mut state.blas, stream, op)?;
                    // SAFETY: the plan's matrices lie in this call's tensors and scratch,
                    // on this stream.
                    unsafe { gemm(handle, g) }
                        .map_err(|e| fail(op, "cublasSgemmStridedBatched", e))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
