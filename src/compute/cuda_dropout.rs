//! `KeyedDropout` on ONNX Runtime's CUDA provider (`kernels/fused.cu`): the CPU kernel's
//! draw (`compute/fused/dropout.rs`) computed per element on the device, the same bits,
//! so a run on a GPU repeats and resumes with the same masks, and draws what a run on
//! the CPU draws. The ratio and the key are read on the device (four values and one).

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::DynTensorValueType;

use super::cuda_fused::{fail, function, Shared};
use super::cuda_launch::launch_planned;
use super::kernels::{keyed_dropout, KeyedDropoutAt};
use crate::graph::custom_ops::KEYED_DROPOUT;

/// The operator, sharing the fused kernels' module.
pub(crate) struct CudaKeyedDropout {
    pub(super) module: Shared,
}

impl Operator for CudaKeyedDropout {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        KEYED_DROPOUT
    }

    fn execution_provider_type(&self) -> Option<&str> {
        Some("CUDAExecutionProvider")
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        super::fused::keyed_dropout_inputs()
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        super::fused::keyed_dropout_outputs()
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let salt = info.get::<i64>("salt").unwrap_or(0);
        let module = self.module.clone();
        Ok(Box::new(move |ctx: &ComputeContext| {
            run(ctx, salt, &module)
        }))
    }
}

/// The device address of input `i`, its shape and its device.
fn input(ctx: &ComputeContext, i: usize) -> ort::Result<(u64, Vec<i64>, usize)> {
    let v = ctx
        .input(i)?
        .ok_or_else(|| ort::Error::new(format!("{KEYED_DROPOUT}: no input {i}")))?;
    let t = v.view().downcast::<DynTensorValueType>()?;
    let device = t.memory_info().device_id() as usize;
    Ok((t.data_ptr() as u64, v.shape().to_vec(), device))
}

fn run(ctx: &ComputeContext, salt: i64, module: &Shared) -> ort::Result<()> {
    let op = KEYED_DROPOUT;
    let (x, shape, device) = input(ctx, 0)?;
    let (ratio, _, _) = input(ctx, 1)?;
    let (key, key_shape, _) = input(ctx, 2)?;
    if key_shape.iter().product::<i64>() != 4 {
        return Err(ort::Error::new(format!(
            "{op}: a key of shape {key_shape:?}, not 4 values"
        )));
    }
    let y = ctx
        .output(0, shape.clone())?
        .ok_or_else(|| ort::Error::new(format!("{op}: no output")))?;
    let y = y.view().downcast::<DynTensorValueType>()?.data_ptr() as u64;
    let mask = match ctx.output(1, shape.clone())? {
        Some(m) => m.view().downcast::<DynTensorValueType>()?.data_ptr() as u64,
        None => 0,
    };
    let n: usize = shape.iter().map(|&d| d.max(0) as usize).product();
    if n == 0 {
        return Ok(());
    }
    let plan = keyed_dropout(
        KeyedDropoutAt {
            x,
            ratio,
            key,
            y,
            mask,
        },
        n,
        salt,
    );
    let (cuda, f) = function(module, device, op, plan.kernel)?;
    let raw = ctx
        .stream()?
        .ok_or_else(|| ort::Error::new(format!("{op}: no CUDA stream")))?;
    // SAFETY: ONNX Runtime's compute stream of this session, alive through the call.
    let stream = unsafe { cuda.wrap_borrowed_stream(raw.as_ptr().cast()) };
    // SAFETY: the plan was made for these buffers: x, y and the mask (or null) hold n
    // values, the ratio one and the key four (checked above).
    unsafe { launch_planned(&stream, &f, &plan) }.map_err(|e| fail(op, "launching", e))
}

#[cfg(test)]
mod tests {
    use crate::compute::{Device, GraphSession, Runtime, SessionOptions};
    use crate::graph::custom_ops::KEYED_DROPOUT;
    use crate::graph::{int_attr, make_node, ValueMeta, DROPOUT_KEY};
    use crate::tensor::{DType, Tensor};

    /// `y` and `mask` of one `KeyedDropout` over `[rows, 1000]` on `device`.
    fn run(device: Device, rows: usize, key: &[i64]) -> (Vec<u32>, Vec<f64>) {
        let node = make_node(
            KEYED_DROPOUT,
            "d",
            &["x", "ratio", DROPOUT_KEY],
            &["y", "mask"],
            vec![int_attr("salt", 12345)],
        );
        let inputs = [
            ("x", ValueMeta::f32(&[rows, 1000])),
            ("ratio", ValueMeta::f32(&[])),
            (
                DROPOUT_KEY,
                ValueMeta {
                    dtype: DType::I64,
                    shape: vec![4],
                },
            ),
        ];
        let model = crate::compute::test_model::model("keyed", vec![node], &inputs, &["y", "mask"]);
        let rt = Runtime::from_env().unwrap();
        let opts = SessionOptions {
            device,
            ..SessionOptions::default()
        };
        let mut session = GraphSession::from_model(&rt, &model, &opts, "keyed").unwrap();
        let n = rows * 1000;
        let x = Tensor::f32(
            vec![rows, 1000],
            (0..n).map(|i| (i as f32 * 0.37).sin()).collect(),
        )
        .unwrap();
        let ratio = Tensor::f32(vec![], vec![0.1]).unwrap();
        let key = Tensor::i64(vec![4], key.to_vec()).unwrap();
        let out = session
            .run(&[("x", &x), ("ratio", &ratio), (DROPOUT_KEY, &key)])
            .unwrap();
        let y = out[0]
            .as_f32()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        (y, out[1].to_f64_vec())
    }

    /// On a GPU (skipped without one): the device's values and mask are the CPU kernel's,
    /// bit for bit, over more elements than one grid pass; another key draws another mask.
    #[test]
    fn on_a_gpu_keyed_dropout_draws_the_cpu_s_masks() {
        if crate::compute::test_model::no_gpu() {
            return;
        }
        let key = [3, 7, 1, 2];
        let cpu = run(Device::Cpu, 20_000, &key);
        let gpu = run(Device::Cuda(0), 20_000, &key);
        assert!(cpu.0 == gpu.0, "the values differ");
        assert!(cpu.1 == gpu.1, "the masks differ");
        assert!(run(Device::Cuda(0), 20_000, &[3, 7, 1, 3]).1 != gpu.1);
    }
}
