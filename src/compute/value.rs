//! A value a stage hands between its graphs and to other stages: a host tensor, or an
//! ONNX Runtime value left in the memory of the device that computed it
//! ([`DeviceValue`]): a micro-batch's activation, the gradient sent back for it, or what
//! the backward reads from the stash. A stage that keeps its state on its device leaves
//! those there (`session/bound.rs`), so they go from one session to the next, and from one
//! stage to the next on that device, without a trip through the host. Whatever reads one
//! on the host copies it there ([`Value::to_host`]): the wire to another process, a stage
//! that computes on the host.

use std::borrow::Cow;

use ort::value::{DynTensorValueType, DynValue, TensorElementType, ValueType};

use super::Device;
use crate::tensor::{DType, Tensor, TensorData};
use crate::{Error, Result};

/// A tensor on the host or in a device's memory.
#[derive(Debug)]
pub enum Value {
    /// Host memory.
    Host(Tensor),
    /// Where ONNX Runtime computed it.
    Device(DeviceValue),
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::Host(t)
    }
}

impl Value {
    /// The host tensor, where this is one.
    ///
    /// # Errors
    /// `BadTensor` for a value in device memory (named `name`): a reader that wants it on
    /// the host takes [`Value::to_host`].
    pub fn host(&self, name: &str) -> Result<&Tensor> {
        match self {
            Value::Host(t) => Ok(t),
            Value::Device(d) => Err(Error::BadTensor {
                name: name.into(),
                reason: format!("held in the memory of {}, read as a host tensor", d.device),
            }),
        }
    }

    /// The values on the host: the tensor itself, or a copy of the device's.
    ///
    /// # Errors
    /// `Device` when the copy fails.
    pub fn to_host(&self, name: &str) -> Result<Cow<'_, Tensor>> {
        match self {
            Value::Host(t) => Ok(Cow::Borrowed(t)),
            Value::Device(d) => d.to_host(name).map(Cow::Owned),
        }
    }

    /// Its first element as a float64, read on the host (a loss, a count); `None` when
    /// it has none or cannot be read.
    pub fn first_f64(&self) -> Option<f64> {
        let t = self.to_host("a scalar").ok()?;
        t.to_f64_vec().first().copied()
    }

    /// Its dimensions.
    pub fn shape(&self) -> &[usize] {
        match self {
            Value::Host(t) => &t.shape,
            Value::Device(d) => &d.shape,
        }
    }

    /// The bytes its elements take.
    pub fn bytes(&self) -> usize {
        match self {
            Value::Host(t) => t.view().bytes(),
            Value::Device(d) => d.shape.iter().product::<usize>() * d.dtype.size(),
        }
    }
}

/// An output ONNX Runtime left in a device's memory. It holds that memory (ONNX Runtime's
/// arena of the session that made it) until dropped; the run that made it has finished
/// on the device before it is handed out.
#[derive(Debug)]
pub struct DeviceValue {
    value: DynValue,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
}

impl DeviceValue {
    /// Output `name`, as a run left it on `device`.
    ///
    /// # Errors
    /// `BadTensor` when it is no tensor, or of a type stages do not hand on.
    pub(crate) fn new(value: DynValue, name: &str, device: Device) -> Result<DeviceValue> {
        let bad = |reason: String| Error::BadTensor {
            name: name.into(),
            reason,
        };
        let ValueType::Tensor { ty, shape, .. } = value.dtype() else {
            return Err(bad("output is not a tensor".into()));
        };
        let dtype = dtype_of(*ty).ok_or_else(|| bad(format!("element type {ty:?}")))?;
        let shape = shape.iter().map(|&d| d as usize).collect();
        Ok(DeviceValue {
            value,
            shape,
            dtype,
            device,
        })
    }

    /// ONNX Runtime's value, to bind as a later run's input.
    pub(crate) fn ort(&self) -> &DynValue {
        &self.value
    }

    /// The device whose memory holds it.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A copy on the host.
    ///
    /// # Errors
    /// `Device` when the copy fails.
    pub fn to_host(&self, name: &str) -> Result<Tensor> {
        match self.device {
            Device::Cpu => super::session::to_host(&self.value, name),
            Device::Cuda(index) => self.download(index, name),
        }
    }

    /// The device's values copied into a host tensor.
    fn download(&self, index: usize, name: &str) -> Result<Tensor> {
        let addr = (self.value.view())
            .downcast::<DynTensorValueType>()
            .map_err(Error::ort(format!("reading `{name}`")))?
            .data_ptr() as usize;
        let n: usize = self.shape.iter().product();
        let mut read = |bytes: &mut [u8]| copy_to_host(index, addr, bytes);
        let data = match self.dtype {
            DType::F32 => TensorData::F32(read_as(n, &mut read)?),
            DType::F64 => TensorData::F64(read_as(n, &mut read)?),
            DType::I64 => TensorData::I64(read_as(n, &mut read)?),
            DType::I32 => TensorData::I32(read_as(n, &mut read)?),
            DType::Bool => {
                let bytes: Vec<u8> = read_as(n, &mut read)?;
                TensorData::Bool(bytes.into_iter().map(|b| b != 0).collect())
            }
        };
        Tensor::new(self.shape.clone(), data)
    }
}

/// `n` values of `T` read into a new vector by `read`.
fn read_as<T: bytemuck::Pod + Default>(
    n: usize,
    read: &mut impl FnMut(&mut [u8]) -> Result<()>,
) -> Result<Vec<T>> {
    let mut v = vec![T::default(); n];
    read(bytemuck::cast_slice_mut(&mut v))?;
    Ok(v)
}

#[cfg(feature = "cuda")]
fn copy_to_host(index: usize, addr: usize, bytes: &mut [u8]) -> Result<()> {
    super::cuda::copy_to_host(index, addr, bytes).map_err(|reason| Error::Device {
        device: format!("cuda:{index}"),
        reason,
    })
}

#[cfg(not(feature = "cuda"))]
fn copy_to_host(index: usize, _addr: usize, _bytes: &mut [u8]) -> Result<()> {
    Err(Error::Device {
        device: format!("cuda:{index}"),
        reason: "this build has no CUDA path; build pipetrain with `--features cuda`".into(),
    })
}

/// The tensor type of ONNX Runtime's element type, where stages hand that type on.
fn dtype_of(ty: TensorElementType) -> Option<DType> {
    Some(match ty {
        TensorElementType::Float32 => DType::F32,
        TensorElementType::Float64 => DType::F64,
        TensorElementType::Int64 => DType::I64,
        TensorElementType::Int32 => DType::I32,
        TensorElementType::Bool => DType::Bool,
        _ => return None,
    })
}
