//! A stage's state kept on its device: the flat parameter, gradient and optimizer-state
//! buffers live in device memory, sessions read the parameters and write the gradients
//! there in place, and the update runs there ([`DeviceState`]). A step's host traffic is
//! then its data in and its loss and statistics out.
//!
//! The stage (`pipeline/stage.rs`) holds an `Option<Box<dyn DeviceState>>` and does not
//! know which device is behind it: [`open`] gives one for a stage on a GPU in builds with
//! `--features cuda` (`cuda_state.rs`), and none on the CPU, where the stage keeps its
//! buffers on the host as before.

use std::ops::Range;

use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};

use super::Device;
use crate::optim::ElementwiseStep;
use crate::Result;

/// `len` float32 values at `addr` in the memory of `device` (host memory for
/// [`Device::Cpu`]: a device state over host memory, `host_state.rs`).
///
/// Whoever hands one out keeps the memory allocated while sessions run with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// The device whose memory holds it.
    pub device: Device,
    /// The first value's device address.
    pub addr: usize,
    /// How many float32 values.
    pub len: usize,
}

impl DeviceSpan {
    /// The values `range` of this span.
    ///
    /// # Panics
    /// When `range` reaches past the span's end (a layout's range always fits).
    pub fn part(&self, range: Range<usize>) -> DeviceSpan {
        assert!(
            range.end <= self.len,
            "{range:?} past a span of {}",
            self.len
        );
        DeviceSpan {
            device: self.device,
            addr: self.addr + range.start * size_of::<f32>(),
            len: range.len(),
        }
    }

    /// ONNX Runtime's description of this memory.
    pub(crate) fn memory_info(&self) -> ort::Result<MemoryInfo<'static>> {
        memory_info(self.device)
    }
}

/// ONNX Runtime's description of `device`'s memory.
pub(crate) fn memory_info(device: Device) -> ort::Result<MemoryInfo<'static>> {
    let (kind, index) = match device {
        Device::Cpu => (AllocationDevice::CPU, 0),
        Device::Cuda(n) => (AllocationDevice::CUDA, n as i32),
    };
    MemoryInfo::new(kind, index, AllocatorType::Device, MemoryType::Default)
}

/// A stage's gradients in device memory, as a reduction across its data-parallel
/// replicas uses them (`compute/replicas.rs`). Every method returns once the device has
/// done it.
pub trait GradBuffer {
    /// The step's gradients (the accumulators), laid out as the stage's flat buffer.
    fn grads(&self) -> DeviceSpan;
    /// Writes over `range` of the gradients the sum of `range` of each of `sources` (on
    /// this state's device, each as long as the gradients; this state's own among
    /// them), added in their order.
    ///
    /// # Errors
    /// `Device` on a failed launch or copy.
    fn sum_grads(&mut self, sources: &[DeviceSpan], range: Range<usize>) -> Result<()>;
    /// Copies `range` of `source` (on this state's device) over the same range of the
    /// gradients.
    ///
    /// # Errors
    /// `Device` on a failed copy.
    fn copy_grads(&mut self, source: DeviceSpan, range: Range<usize>) -> Result<()>;
}

/// A stage's parameters, gradients and optimizer state in device memory, and what the
/// stage does with them. Every method returns once the device has done it.
pub trait DeviceState: GradBuffer + Send {
    /// The parameters, laid out as the stage's flat buffer.
    fn params(&self) -> DeviceSpan;
    /// A second gradient buffer for a later micro-batch's gradients, made on first use.
    ///
    /// # Errors
    /// `Device` when the device is out of memory.
    fn scratch(&mut self) -> Result<DeviceSpan>;
    /// For each range: the scratch buffer's values added to the gradients' (`true`) or
    /// copied over them (`false`).
    ///
    /// # Errors
    /// `Device` on a failed launch or copy.
    fn take_scratch(&mut self, ranges: &[(Range<usize>, bool)]) -> Result<()>;
    /// Zeroes the gradients in `range`.
    ///
    /// # Errors
    /// `Device` on a failed copy.
    fn zero_grads(&mut self, range: Range<usize>) -> Result<()>;
    /// Sets one gradient value (a test's injected overflow).
    ///
    /// # Errors
    /// `Device` on a failed copy.
    fn set_grad(&mut self, index: usize, value: f32) -> Result<()>;
    /// The gradients' sum of squares (not finite when a gradient is not), the same bits
    /// every run.
    ///
    /// # Errors
    /// `Device` on a failed launch or copy.
    fn grad_sum_sq(&mut self) -> Result<f64>;
    /// Applies one optimizer step with the gradients multiplied by `scale`.
    ///
    /// # Errors
    /// `Device` on a failed launch, or a rule whose state buffers this state lacks.
    fn apply(&mut self, step: &ElementwiseStep, scale: f32) -> Result<()>;
    /// Copies the parameters (`which = Params`), gradients or an optimizer state buffer
    /// to `host`.
    ///
    /// # Errors
    /// `Device` on a failed copy or a length that is not the buffer's.
    fn download(&self, which: Buffer, host: &mut [f32]) -> Result<()>;
    /// Copies `host` into a buffer.
    ///
    /// # Errors
    /// As [`DeviceState::download`].
    fn upload(&mut self, which: Buffer, host: &[f32]) -> Result<()>;
}

/// One of a [`DeviceState`]'s buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// The parameters.
    Params,
    /// The gradients.
    Grads,
    /// Optimizer state buffer `k` (in [`crate::optim::Optimizer::state`]'s order).
    State(usize),
}

/// The device state of a stage on `device` with `params` and optimizer state buffers of
/// `state` values each, uploaded; `None` on the CPU.
///
/// # Errors
/// `Device` when the device's memory or its kernels' compilation fails, or on a GPU in a
/// build without `--features cuda`.
pub fn open(
    device: Device,
    params: &[f32],
    state: &[&[f32]],
) -> Result<Option<Box<dyn DeviceState>>> {
    let Device::Cuda(index) = device else {
        return Ok(None);
    };
    #[cfg(feature = "cuda")]
    {
        let s = super::cuda_state::CudaState::new(index, params, state)?;
        Ok(Some(Box::new(s)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (params, state);
        Err(crate::Error::Device {
            device: format!("cuda:{index}"),
            reason: "this build has no CUDA path; build pipetrain with `--features cuda`".into(),
        })
    }
}
