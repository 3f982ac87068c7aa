//! Host tensors: a shape and a typed, contiguous, row-major buffer.
//!
//! These are what pipetrain owns (parameters, gradients, data batches, stashed
//! activations); they are lent to ONNX Runtime without copies when a session runs.

use crate::onnx::proto::{tensor_proto::DataType, TensorProto};
use crate::{Error, Result};

/// Named tensors: parameters, a micro-batch's data, or values in flight.
pub type TensorMap = std::collections::HashMap<String, Tensor>;

/// The element types pipetrain moves between its buffers and ONNX Runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Boolean (one byte each).
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// The ONNX `TensorProto.DataType` code.
    pub fn onnx(self) -> i32 {
        (match self {
            DType::F32 => DataType::Float,
            DType::F64 => DataType::Double,
            DType::I64 => DataType::Int64,
            DType::I32 => DataType::Int32,
            DType::Bool => DataType::Bool,
        }) as i32
    }

    /// The type for an ONNX `DataType` code, if pipetrain handles it.
    pub fn from_onnx(code: i32) -> Option<DType> {
        match DataType::try_from(code).ok()? {
            DataType::Float => Some(DType::F32),
            DataType::Double => Some(DType::F64),
            DataType::Int64 => Some(DType::I64),
            DataType::Int32 => Some(DType::I32),
            DataType::Bool => Some(DType::Bool),
            _ => None,
        }
    }

    /// Whether gradients flow through values of this type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }
}

/// A tensor's elements.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum TensorData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    Bool(Vec<bool>),
}

/// Borrowed elements of one type.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub enum ViewData<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    I64(&'a [i64]),
    I32(&'a [i32]),
    Bool(&'a [bool]),
}

/// A borrowed tensor: a shape and elements owned elsewhere (a slice of a flat parameter
/// buffer, or a [`Tensor`]). What ONNX Runtime is fed without copies.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The dimensions.
    pub shape: &'a [usize],
    /// The elements.
    pub data: ViewData<'a>,
}

impl TensorView<'_> {
    /// Its element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            ViewData::F32(_) => DType::F32,
            ViewData::F64(_) => DType::F64,
            ViewData::I64(_) => DType::I64,
            ViewData::I32(_) => DType::I32,
            ViewData::Bool(_) => DType::Bool,
        }
    }

    /// The bytes its elements take.
    pub fn bytes(&self) -> usize {
        match self.data {
            ViewData::F32(v) => std::mem::size_of_val(v),
            ViewData::F64(v) => std::mem::size_of_val(v),
            ViewData::I64(v) => std::mem::size_of_val(v),
            ViewData::I32(v) => std::mem::size_of_val(v),
            ViewData::Bool(v) => std::mem::size_of_val(v),
        }
    }
}

/// `t`'s raw bytes seen as its elements without a copy, where its type allows (not
/// `Bool`), its raw bytes are exactly its shape's and they are aligned for its type.
pub fn proto_view(t: &TensorProto) -> Option<TensorView<'_>> {
    let dtype = DType::from_onnx(t.data_type)?;
    let raw: &[u8] = &t.raw_data;
    let data = match dtype {
        DType::F32 => ViewData::F32(bytemuck::try_cast_slice(raw).ok()?),
        DType::F64 => ViewData::F64(bytemuck::try_cast_slice(raw).ok()?),
        DType::I64 => ViewData::I64(bytemuck::try_cast_slice(raw).ok()?),
        DType::I32 => ViewData::I32(bytemuck::try_cast_slice(raw).ok()?),
        DType::Bool => return None,
    };
    // The view borrows its shape: the proto's own dims, non-negative i64s read as usize
    // (the same bits on a 64-bit target).
    if t.dims.iter().any(|&d| d < 0) {
        return None;
    }
    let shape: &[usize] = bytemuck::try_cast_slice(&t.dims).ok()?;
    if shape.iter().product::<usize>() * dtype.size() != raw.len() {
        return None;
    }
    Some(TensorView { shape, data })
}

/// A host tensor: row-major elements and their shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// The dimensions.
    pub shape: Vec<usize>,
    /// The elements, `shape.iter().product()` of them.
    pub data: TensorData,
}

impl Tensor {
    /// A tensor from a shape and elements.
    ///
    /// # Errors
    /// `BadTensor` when the element count does not match the shape.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Tensor> {
        let t = Tensor { shape, data };
        if t.len() != t.shape.iter().product::<usize>() {
            return Err(Error::BadTensor {
                name: "<tensor>".into(),
                reason: format!("{} elements for shape {:?}", t.len(), t.shape),
            });
        }
        Ok(t)
    }

    /// A float32 tensor.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::F32(data))
    }

    /// A float64 tensor.
    pub fn f64(shape: Vec<usize>, data: Vec<f64>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::F64(data))
    }

    /// An int64 tensor.
    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Result<Tensor> {
        Tensor::new(shape, TensorData::I64(data))
    }

    /// A tensor of zeros.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        let data = match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::F64 => TensorData::F64(vec![0.0; n]),
            DType::I64 => TensorData::I64(vec![0; n]),
            DType::I32 => TensorData::I32(vec![0; n]),
            DType::Bool => TensorData::Bool(vec![false; n]),
        };
        Tensor { shape, data }
    }

    /// A borrowed view of the whole tensor.
    pub fn view(&self) -> TensorView<'_> {
        let data = match &self.data {
            TensorData::F32(v) => ViewData::F32(v),
            TensorData::F64(v) => ViewData::F64(v),
            TensorData::I64(v) => ViewData::I64(v),
            TensorData::I32(v) => ViewData::I32(v),
            TensorData::Bool(v) => ViewData::Bool(v),
        };
        TensorView {
            shape: &self.shape,
            data,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::F64(_) => DType::F64,
            TensorData::I64(_) => DType::I64,
            TensorData::I32(_) => DType::I32,
            TensorData::Bool(_) => DType::Bool,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::F64(v) => v.len(),
            TensorData::I64(v) => v.len(),
            TensorData::I32(v) => v.len(),
            TensorData::Bool(v) => v.len(),
        }
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The float32 elements, if that is the type.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The float32 elements, mutably, if that is the type.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.data {
            TensorData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The float64 elements, if that is the type.
    pub fn as_f64(&self) -> Option<&[f64]> {
        match &self.data {
            TensorData::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The int64 elements, if that is the type.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Elements of a float or integer tensor as f64 (for checks and small constants).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::F64(v) => v.clone(),
            TensorData::I64(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }

    /// Elements of an integer tensor as i64 (shape and axes constants).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        match &self.data {
            TensorData::I64(v) => Some(v.clone()),
            TensorData::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            _ => None,
        }
    }

    /// The rows `rows` of the first axis, gathered into a new tensor (batching).
    ///
    /// # Errors
    /// `BadTensor` for a scalar or an index out of range.
    pub fn gather_rows(&self, rows: &[usize]) -> Result<Tensor> {
        let Some((&n, rest)) = self.shape.split_first() else {
            return Err(Error::BadTensor {
                name: "<tensor>".into(),
                reason: "cannot take rows of a scalar".into(),
            });
        };
        if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
            return Err(Error::BadTensor {
                name: "<tensor>".into(),
                reason: format!("row {bad} out of range for {n} rows"),
            });
        }
        let width: usize = rest.iter().product();
        // Row by row with `extend_from_slice` (a memcpy each): a flattening iterator
        // copies element by element, several times slower on image-sized rows.
        fn take<T: Copy>(v: &[T], rows: &[usize], width: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(rows.len() * width);
            for &r in rows {
                out.extend_from_slice(&v[r * width..(r + 1) * width]);
            }
            out
        }
        let data = match &self.data {
            TensorData::F32(v) => TensorData::F32(take(v, rows, width)),
            TensorData::F64(v) => TensorData::F64(take(v, rows, width)),
            TensorData::I64(v) => TensorData::I64(take(v, rows, width)),
            TensorData::I32(v) => TensorData::I32(take(v, rows, width)),
            TensorData::Bool(v) => TensorData::Bool(take(v, rows, width)),
        };
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        Ok(Tensor { shape, data })
    }

    /// Converts to an ONNX `TensorProto` (raw little-endian data).
    pub fn to_proto(&self, name: &str) -> TensorProto {
        fn raw<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            v.iter().flat_map(|&x| f(x)).collect()
        }
        let raw_data = match &self.data {
            TensorData::F32(v) => raw(v, f32::to_le_bytes),
            TensorData::F64(v) => raw(v, f64::to_le_bytes),
            TensorData::I64(v) => raw(v, i64::to_le_bytes),
            TensorData::I32(v) => raw(v, i32::to_le_bytes),
            TensorData::Bool(v) => v.iter().map(|&b| b as u8).collect(),
        };
        TensorProto {
            name: name.to_string(),
            dims: self.shape.iter().map(|&d| d as i64).collect(),
            data_type: self.dtype().onnx(),
            raw_data: raw_data.into(),
            ..Default::default()
        }
    }

    /// Reads an ONNX `TensorProto` (raw or typed fields; external data must already be
    /// loaded into `raw_data`).
    ///
    /// # Errors
    /// `BadTensor` for an unsupported type, negative dimensions or a size mismatch.
    pub fn from_proto(t: &TensorProto) -> Result<Tensor> {
        let bad = |reason: String| Error::BadTensor {
            name: t.name.clone(),
            reason,
        };
        let dtype = DType::from_onnx(t.data_type)
            .ok_or_else(|| bad(format!("unsupported element type code {}", t.data_type)))?;
        let shape = t
            .dims
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}"))))
            .collect::<Result<Vec<_>>>()?;
        let n: usize = shape.iter().product();
        fn from_raw<T, const N: usize>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            raw.chunks_exact(N)
                .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
                .collect()
        }
        let raw = &t.raw_data;
        let data = if !raw.is_empty() {
            let width = match dtype {
                DType::F32 | DType::I32 => 4,
                DType::F64 | DType::I64 => 8,
                DType::Bool => 1,
            };
            if raw.len() != n * width {
                return Err(bad(format!(
                    "raw data holds {} bytes, shape {:?} needs {}",
                    raw.len(),
                    shape,
                    n * width
                )));
            }
            match dtype {
                DType::F32 => TensorData::F32(from_raw(raw, f32::from_le_bytes)),
                DType::F64 => TensorData::F64(from_raw(raw, f64::from_le_bytes)),
                DType::I64 => TensorData::I64(from_raw(raw, i64::from_le_bytes)),
                DType::I32 => TensorData::I32(from_raw(raw, i32::from_le_bytes)),
                DType::Bool => TensorData::Bool(raw.iter().map(|&b| b != 0).collect()),
            }
        } else {
            match dtype {
                DType::F32 => TensorData::F32(t.float_data.clone()),
                DType::F64 => TensorData::F64(t.double_data.clone()),
                DType::I64 => TensorData::I64(t.int64_data.clone()),
                DType::I32 => TensorData::I32(t.int32_data.clone()),
                DType::Bool => TensorData::Bool(t.int32_data.iter().map(|&b| b != 0).collect()),
            }
        };
        let tensor = Tensor { shape, data };
        if tensor.len() != n {
            return Err(bad(format!(
                "{} elements stored, shape {:?} needs {n}",
                tensor.len(),
                tensor.shape
            )));
        }
        Ok(tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_round_trip_keeps_every_type() {
        let cases = [
            Tensor::f32(vec![2, 2], vec![1.0, -2.5, 3.25, 0.0]).unwrap(),
            Tensor::f64(vec![3], vec![1e-300, -0.5, 7.0]).unwrap(),
            Tensor::i64(vec![2], vec![i64::MIN, 42]).unwrap(),
            Tensor::new(vec![2], TensorData::Bool(vec![true, false])).unwrap(),
        ];
        for t in cases {
            assert_eq!(Tensor::from_proto(&t.to_proto("t")).unwrap(), t);
        }
    }

    #[test]
    fn raw_data_of_the_wrong_size_is_rejected() {
        let mut p = Tensor::f32(vec![2], vec![1.0, 2.0]).unwrap().to_proto("w");
        p.raw_data.truncate(p.raw_data.len() - 1);
        let err = Tensor::from_proto(&p).unwrap_err().to_string();
        assert!(err.contains("`w`") && err.contains("7 bytes"), "{err}");
    }

    #[test]
    fn gather_rows_takes_whole_rows() {
        let t = Tensor::i64(vec![3, 2], vec![0, 1, 10, 11, 20, 21]).unwrap();
        let g = t.gather_rows(&[2, 0]).unwrap();
        assert_eq!(g.shape, vec![2, 2]);
        assert_eq!(g.as_i64().unwrap(), &[20, 21, 0, 1]);
        assert!(t.gather_rows(&[3]).is_err());
    }
}
