//! A parameter's initial value as the model file gives it, not copied until a stage
//! takes its own parameters.
//!
//! A training graph knows every parameter of the model, but a pipeline rank trains only
//! its stages' share. Holding each initial value as a decoded [`Tensor`] made every rank
//! copy the whole model: 3.8 GB each for a 1-billion-parameter Llama, before a stage
//! existed. An [`InitValue`] keeps the initializer's raw bytes instead, shared with the
//! loaded model (`Bytes`: a memory-mapped external data file stays in the page cache,
//! one copy for every process of the machine). Graph building's probes read it in place,
//! and a stage copies out only the parameters it trains.

use crate::onnx::proto::TensorProto;
use crate::tensor::{proto_view, DType, Tensor, TensorView};
use crate::Result;

/// A parameter's initial value: raw little-endian bytes with their type and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct InitValue {
    proto: TensorProto,
}

impl InitValue {
    /// The value of initializer `t`: its bytes shared where they are raw and of the
    /// right length, else decoded once and held raw.
    ///
    /// # Errors
    /// `BadTensor` when `t` is not a tensor pipetrain reads.
    pub fn from_proto(t: TensorProto) -> Result<InitValue> {
        let proto = match proto_view(&t).is_some() {
            true => t,
            false => Tensor::from_proto(&t)?.to_proto(&t.name),
        };
        Ok(InitValue { proto })
    }

    /// The value of `t`, held raw.
    pub fn from_tensor(t: &Tensor) -> InitValue {
        InitValue {
            proto: t.to_proto(""),
        }
    }

    /// No value (a run's parameters once its stages hold them): type `dtype`, no elements.
    pub fn released(dtype: DType) -> InitValue {
        InitValue::from_tensor(&Tensor::zeros(dtype, vec![0]))
    }

    /// The elements in place, without a copy.
    pub fn view(&self) -> TensorView<'_> {
        proto_view(&self.proto).expect("an InitValue is held raw and aligned (from_proto)")
    }

    /// The float32 elements in place; `None` for another type.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self.view().data {
            crate::tensor::ViewData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Its element count.
    pub fn len(&self) -> usize {
        self.view().shape.iter().product()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A decoded copy.
    ///
    /// # Errors
    /// Never for a value made by this type's constructors.
    pub fn to_tensor(&self) -> Result<Tensor> {
        Tensor::from_proto(&self.proto)
    }

    /// As an initializer named `name`; its bytes are shared, not copied.
    pub fn to_proto(&self, name: &str) -> TensorProto {
        TensorProto {
            name: name.to_string(),
            ..self.proto.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_initializer_is_shared_and_a_typed_one_is_held_raw() {
        let t = Tensor::f32(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let raw = t.to_proto("w");
        let shared = InitValue::from_proto(raw.clone()).unwrap();
        assert_eq!(shared.proto.raw_data.as_ptr(), raw.raw_data.as_ptr());
        assert_eq!(shared.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        let typed = TensorProto {
            name: "w".into(),
            dims: vec![2, 2],
            data_type: DType::F32.onnx(),
            float_data: vec![1.0, 2.0, 3.0, 4.0],
            ..Default::default()
        };
        let held = InitValue::from_proto(typed).unwrap();
        assert_eq!(held.to_tensor().unwrap(), t);
        assert_eq!(held.to_proto("v").name, "v");
    }

    #[test]
    fn raw_bytes_of_the_wrong_length_are_refused() {
        let mut p = Tensor::f32(vec![2], vec![1.0, 2.0]).unwrap().to_proto("w");
        p.raw_data.truncate(7);
        let err = InitValue::from_proto(p).unwrap_err().to_string();
        assert!(err.contains("7 bytes"), "{err}");
    }
}
