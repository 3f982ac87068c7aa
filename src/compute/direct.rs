//! Outputs that ONNX Runtime writes straight into a pipetrain buffer: a step's first
//! gradient contribution lands in the stage's accumulators, not in ONNX Runtime's own
//! memory first (which would then be copied over). ONNX Runtime's `Run` takes such
//! pre-allocated outputs; `ort` hands them over as values in a `RunOptions`.
//!
//! `ort` makes values over borrowed memory only for inputs (`TensorRefMut` cannot be
//! pre-allocated as an output), so the output values here are made with the C API's
//! `CreateTensorWithDataAsOrtValue` over the buffer's memory. They are kept between runs
//! for the buffer they were made for, and used only while that same buffer (same address
//! and length) is borrowed mutably by the run: memory that moved or was freed is never
//! written through them.

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use ort::memory::{Allocator, MemoryInfo};
use ort::session::{HasSelectedOutputs, OutputSelector, RunOptions};
use ort::sys::ONNXTensorElementDataType;
use ort::value::{DynTensorValueType, DynValue, ValueType};
use ort::AsPointer;

use crate::{Error, Result};

/// One float32 output written into a buffer: which output, where it starts, its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    /// The output's index in the session's outputs ([`super::GraphSession::output_names`]).
    pub output: usize,
    /// Offset of its first value in the buffer.
    pub offset: usize,
    /// Its shape (the values fill `offset..offset + product`).
    pub shape: &'a [usize],
}

impl Target<'_> {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Refuses a target (output `name`) whose values do not fit in a buffer of `len`.
    pub(super) fn check_fits(&self, len: usize, name: &str) -> Result<()> {
        match self.offset + self.len() <= len {
            true => Ok(()),
            false => Err(Error::BadTensor {
                name: name.into(),
                reason: format!(
                    "values {}..{} do not fit in a buffer of {len}",
                    self.offset,
                    self.offset + self.len(),
                ),
            }),
        }
    }
}

/// The run options that direct a session's outputs into one buffer, made once per
/// buffer and set of outputs.
pub(super) struct DirectOutputs {
    /// The buffer's address and length, and the targets' outputs and ranges.
    key: (usize, usize, Vec<(usize, usize, usize)>),
    pub(super) options: RunOptions<HasSelectedOutputs>,
}

impl DirectOutputs {
    /// Whether these options were made for `buf` and `targets`.
    pub(super) fn fits(&self, buf: &[f32], targets: &[Target<'_>]) -> bool {
        self.fits_at(buf.as_ptr() as usize, buf.len(), targets)
    }

    /// Whether these options were made for the buffer of `len` values at `addr` (host or
    /// device memory) and `targets`.
    pub(super) fn fits_at(&self, addr: usize, len: usize, targets: &[Target<'_>]) -> bool {
        self.key.0 == addr
            && self.key.1 == len
            && self.key.2.len() == targets.len()
            && self
                .key
                .2
                .iter()
                .zip(targets)
                .all(|(&key, t)| key == (t.output, t.offset, t.len()))
    }

    /// Options whose pre-allocated outputs are `targets`' ranges of `buf` (`outputs`
    /// names the session's outputs); every other output is still returned as ONNX
    /// Runtime made it.
    ///
    /// # Errors
    /// `BadTensor` when a target is no output or does not fit in `buf`; `Ort` when ONNX
    /// Runtime refuses a value.
    pub(super) fn new(
        buf: &mut [f32],
        targets: &[Target<'_>],
        outputs: &[String],
        label: &str,
    ) -> Result<Self> {
        let (addr, len) = (buf.as_mut_ptr() as usize, buf.len());
        // SAFETY: the values are `buf`'s, written only while it is borrowed by a run.
        unsafe { Self::at(addr, len, &MemoryInfo::default(), targets, outputs, label) }
    }

    /// [`DirectOutputs::new`] for the buffer of `len` float32 values at `addr` in the
    /// memory `info` describes (a device's).
    ///
    /// # Safety
    /// `addr..addr + 4 len` must stay the caller's, in `info`'s memory, for as long as
    /// runs use these options ([`DirectOutputs::fits_at`] is asked before each).
    pub(super) unsafe fn at(
        addr: usize,
        len: usize,
        info: &MemoryInfo,
        targets: &[Target<'_>],
        outputs: &[String],
        label: &str,
    ) -> Result<Self> {
        let ctx = || format!("directing the outputs of {label}");
        let mut selector = OutputSelector::default();
        for t in targets {
            let name = outputs.get(t.output).ok_or_else(|| Error::BadTensor {
                name: format!("output {}", t.output),
                reason: format!("{label} has {} outputs", outputs.len()),
            })?;
            t.check_fits(len, name)?;
            let data = (addr + t.offset * size_of::<f32>()) as *mut f32;
            selector = selector.preallocate(name, over(info, data, t.shape, label)?);
        }
        let options = RunOptions::new()
            .map_err(Error::ort(ctx()))?
            .with_outputs(selector);
        Ok(DirectOutputs {
            key: (
                addr,
                len,
                targets
                    .iter()
                    .map(|t| (t.output, t.offset, t.len()))
                    .collect(),
            ),
            options,
        })
    }
}

/// A float32 tensor value over `shape.product()` values at `data`, which ONNX Runtime
/// neither copies nor frees.
pub(super) fn over(
    info: &MemoryInfo,
    data: *mut f32,
    shape: &[usize],
    label: &str,
) -> Result<DynValue> {
    let bytes = shape.iter().product::<usize>() * size_of::<f32>();
    let float = ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    // SAFETY: as this function's own contract: `data` is `bytes` bytes of the caller's.
    unsafe { over_bytes(info, data.cast(), bytes, (shape, float), label) }
}

/// A tensor value of element type `ty` and `shape` over the `bytes` bytes at `data`, in
/// the memory `info` describes, which ONNX Runtime neither copies nor frees.
///
/// # Safety
/// `data` must hold `bytes` bytes of that type, `shape`'s count of them, for as long as
/// the value is used, and be written through it only where the caller lends it to be.
pub(super) unsafe fn over_bytes(
    info: &MemoryInfo,
    data: *mut c_void,
    bytes: usize,
    (shape, ty): (&[usize], ONNXTensorElementDataType),
    label: &str,
) -> Result<DynValue> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let api = ort::api();
    let mut value: *mut ort::sys::OrtValue = ptr::null_mut();
    // SAFETY: `data` points at `bytes` bytes of the caller's buffer (this function's
    // contract); the value only describes them.
    let status = unsafe {
        (api.CreateTensorWithDataAsOrtValue)(
            info.ptr(),
            data,
            bytes,
            dims.as_ptr(),
            dims.len(),
            ty,
            &mut value,
        )
    };
    let ctx = || format!("lending a buffer to {label}");
    // SAFETY: a status ONNX Runtime just returned, read and released once.
    unsafe { ort::Error::result_from_status(status) }.map_err(Error::ort(ctx()))?;
    let value = NonNull::new(value)
        .ok_or_else(|| ort::Error::new("no value was made"))
        .map_err(Error::ort(ctx()))?;
    // SAFETY: a fresh tensor value; releasing it leaves the data alone (ONNX Runtime
    // does not own memory given to `CreateTensorWithDataAsOrtValue`).
    Ok(unsafe { DynValue::from_ptr(value, Some(&Allocator::default())) })
}

/// Checks a directed output: its shape, and that its values are in `buf` (ONNX Runtime
/// writes into the memory it was given; should it ever hand back memory of its own
/// instead, the values are copied over).
pub(super) fn in_place(
    value: &DynValue,
    name: &str,
    t: &Target<'_>,
    buf: &mut [f32],
    label: &str,
) -> Result<()> {
    let ctx = || format!("running {label}");
    let ValueType::Tensor { shape, .. } = value.dtype() else {
        return Err(Error::BadTensor {
            name: name.into(),
            reason: "output is not a tensor".into(),
        });
    };
    if !shape
        .iter()
        .map(|&d| d as usize)
        .eq(t.shape.iter().copied())
    {
        return Err(Error::BadTensor {
            name: name.into(),
            reason: format!("shape {shape:?}, {:?} expected", t.shape),
        });
    }
    let tensor = value
        .view()
        .downcast::<DynTensorValueType>()
        .map_err(Error::ort(ctx()))?;
    if tensor.data_ptr() != buf[t.offset..].as_ptr().cast() {
        let (_, values) = value
            .try_extract_tensor::<f32>()
            .map_err(Error::ort(ctx()))?;
        buf[t.offset..t.offset + values.len()].copy_from_slice(values);
    }
    Ok(())
}

/// The range of `buf` that `t` names, lent to ONNX Runtime as an input of the run that
/// writes output `t` into the same range.
///
/// Only the accumulating graphs' `Accumulate(acc, g)` reads it (`graph::accumulating`),
/// and that output is bound to this memory: its kernel (`compute/fused/accumulate.rs`)
/// sees the two are one buffer and adds `g` into it through the output alone. No
/// reference to the range is held on the Rust side while ONNX Runtime runs: the value
/// is made from a raw pointer.
pub(super) fn accumulator<'a>(
    buf: &mut [f32],
    t: &Target<'_>,
) -> ort::Result<ort::session::SessionInputValue<'a>> {
    let len: usize = t.shape.iter().product();
    let range = buf.get_mut(t.offset..t.offset + len).ok_or_else(|| {
        ort::Error::new(format!("accumulator at {} is past the buffer", t.offset))
    })?;
    let info = ort::memory::MemoryInfo::new(
        ort::memory::AllocationDevice::CPU,
        0,
        ort::memory::AllocatorType::Device,
        ort::memory::MemoryType::Default,
    )?;
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    // SAFETY: the pointer is `len` float32s of `buf`, which outlives the run (the caller
    // holds it mutably until the run's outputs are read); see above for the aliasing.
    let value = unsafe {
        ort::value::TensorRefMut::<f32>::from_raw(info, range.as_mut_ptr().cast(), shape.into())?
    };
    Ok(value.into())
}
