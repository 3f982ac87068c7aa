//! The graph builder the built-in models share: nodes named after what they compute,
//! trained weights as initializers, and everything untrained (shapes, masks, scalars)
//! as `Constant` nodes.
//!
//! That split is what makes the models trainable as they are: pipetrain trains every
//! floating-point initializer of a model, so a float constant stored as an initializer
//! (a causal mask, GELU's 0.044715) would be "learned" too.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};

use crate::graph::{make_node, tensor_attr};
use crate::onnx::proto::{
    tensor_shape_proto::{dimension::Value as DimValue, Dimension},
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use crate::tensor::{DType, Tensor, TensorData};
use crate::{Error, Result};

/// The default-domain opset the models are written in.
pub const OPSET: i64 = 17;

/// The IR version the models are written in (ONNX Runtime 1.31 reads up to 13).
pub const IR_VERSION: i64 = 8;

/// The name of the dynamic batch dimension.
pub const BATCH_DIM: &str = "batch";

/// Elements one model may hold in its initializers: protobuf caps a message, so one ONNX
/// file, at 2 GiB, and float32 takes 4 bytes.
pub const MAX_PARAMS: u64 = (1 << 31) / 4;

/// How a weight's initial values are drawn.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Init {
    /// N(0, std^2).
    Normal(f64),
    /// U(-bound, bound).
    Uniform(f64),
    /// Every element equal.
    Const(f32),
}

/// A graph input or output dimension.
#[derive(Debug, Clone)]
pub(crate) enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A symbolic size (`dim_param`).
    Named(String),
}

impl Dim {
    /// `batch` when `None`, else the fixed size.
    pub(crate) fn batch(batch: Option<usize>) -> Dim {
        batch.map_or_else(|| Dim::Named(BATCH_DIM.into()), Dim::Fixed)
    }

    /// This dimension times `k` (`batch*k` when symbolic).
    pub(crate) fn times(&self, k: usize) -> Dim {
        match self {
            Dim::Fixed(n) => Dim::Fixed(n * k),
            Dim::Named(s) => Dim::Named(format!("{s}*{k}")),
        }
    }
}

/// Builds one model: nodes in order, weights drawn from one seeded stream in the order
/// they are declared (so a seed gives the same weights on every machine).
pub(crate) struct Builder {
    nodes: Vec<NodeProto>,
    weights: Vec<TensorProto>,
    rng: ChaCha8Rng,
}

impl Builder {
    /// A builder drawing weights from `seed`.
    pub(crate) fn new(seed: u64) -> Builder {
        Builder {
            nodes: Vec::new(),
            weights: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Adds a node `name` with one output, also called `name`; returns it.
    pub(crate) fn op(
        &mut self,
        op_type: &str,
        name: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> String {
        self.nodes
            .push(make_node(op_type, name, inputs, &[name], attrs));
        name.to_string()
    }

    /// Adds a node `name` with `n` outputs `name.0`, `name.1`, ...; returns them.
    pub(crate) fn op_n(
        &mut self,
        op_type: &str,
        name: &str,
        inputs: &[&str],
        n: usize,
        attrs: Vec<AttributeProto>,
    ) -> Vec<String> {
        let outs: Vec<String> = (0..n).map(|i| format!("{name}.{i}")).collect();
        let refs: Vec<&str> = outs.iter().map(String::as_str).collect();
        self.nodes
            .push(make_node(op_type, name, inputs, &refs, attrs));
        outs
    }

    /// Adds a trained float32 weight `name` of `shape`, drawn as `init`; returns its name.
    pub(crate) fn weight(&mut self, name: &str, shape: &[usize], init: Init) -> Result<String> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = match init {
            Init::Const(v) => vec![v; n],
            Init::Normal(std) => {
                let d = Normal::new(0.0, std).map_err(|e| bad_init(name, e))?;
                (0..n).map(|_| d.sample(&mut self.rng) as f32).collect()
            }
            Init::Uniform(bound) => {
                let d = Uniform::new_inclusive(-bound, bound).map_err(|e| bad_init(name, e))?;
                (0..n).map(|_| self.rng.sample(d) as f32).collect()
            }
        };
        let t = Tensor::f32(shape.to_vec(), data)?;
        self.weights.push(t.to_proto(name));
        Ok(name.to_string())
    }

    /// Adds an untrained constant `name` (a `Constant` node); returns its name.
    pub(crate) fn constant(&mut self, name: &str, value: Tensor) -> String {
        let attr = tensor_attr("value", value.to_proto(name));
        self.op("Constant", name, &[], vec![attr])
    }

    /// A 1-D int64 constant (shapes, split sizes).
    pub(crate) fn ints(&mut self, name: &str, values: &[i64]) -> String {
        let t = Tensor {
            shape: vec![values.len()],
            data: TensorData::I64(values.to_vec()),
        };
        self.constant(name, t)
    }

    /// A float32 scalar constant.
    pub(crate) fn scalar(&mut self, name: &str, value: f32) -> String {
        let t = Tensor {
            shape: vec![],
            data: TensorData::F32(vec![value]),
        };
        self.constant(name, t)
    }

    /// The model: opset [`OPSET`], IR version [`IR_VERSION`], the given feeds and outputs.
    pub(crate) fn finish(
        self,
        name: &str,
        inputs: Vec<ValueInfoProto>,
        outputs: Vec<ValueInfoProto>,
    ) -> ModelProto {
        ModelProto {
            ir_version: IR_VERSION,
            producer_name: "pipetrain".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: OPSET,
            }],
            graph: Some(GraphProto {
                name: name.into(),
                node: self.nodes,
                input: inputs,
                output: outputs,
                initializer: self.weights,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

fn bad_init(name: &str, e: impl std::fmt::Display) -> Error {
    Error::BadTensor {
        name: name.into(),
        reason: format!("cannot draw initial values: {e}"),
    }
}

/// A graph input or output of element type `dtype` and dimensions `dims`.
pub(crate) fn tensor_info(name: &str, dtype: DType, dims: &[Dim]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Dim::Fixed(n) => DimValue::DimValue(*n as i64),
                Dim::Named(s) => DimValue::DimParam(s.clone()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: dtype.onnx(),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Checks one rule of a model or data configuration: `Config` naming `field` when `ok`
/// is false.
pub(crate) fn rule(ok: bool, path: &Path, field: &str, rule: impl Into<String>) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            rule: rule.into(),
        })
    }
}

/// Checks that each `(field, value)` is at least 1.
pub(crate) fn at_least_one(path: &Path, fields: &[(&str, usize)]) -> Result<()> {
    for &(field, v) in fields {
        rule(v >= 1, path, field, format!("must be at least 1 (got {v})"))?;
    }
    Ok(())
}

/// Checks a parameter count computed without overflow (`None` when it overflowed)
/// against [`MAX_PARAMS`]; `field` names the configuration.
pub(crate) fn param_limit(path: &Path, field: &str, count: Option<u64>) -> Result<()> {
    let ok = count.is_some_and(|n| n <= MAX_PARAMS);
    let got = count.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
    rule(
        ok,
        path,
        field,
        format!(
            "the model would hold {got} parameters; one ONNX file holds at most {MAX_PARAMS} \
             float32 parameters (2 GiB)"
        ),
    )
}

/// Sum of products of `dims` lists, without overflow.
pub(crate) fn count_params(shapes: &[&[usize]]) -> Option<u64> {
    shapes.iter().try_fold(0u64, |acc, s| {
        let n = s.iter().try_fold(1u64, |p, &d| p.checked_mul(d as u64))?;
        acc.checked_add(n)
    })
}
