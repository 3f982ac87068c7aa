//! The graph IR: an ONNX graph held as plain vectors, with the lookups the training
//! passes need (producers, constants, attributes) and the per-value metadata (element
//! type and concrete shape) that a [`crate::graph::ShapeProbe`] measures.

use std::collections::HashMap;

use crate::onnx::proto::{
    attribute_proto::AttributeType, tensor_shape_proto, type_proto, AttributeProto, GraphProto,
    ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto,
    ValueInfoProto,
};
use crate::onnx::{default_opset, MAX_IR_VERSION};
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// The default-domain opsets whose operator semantics pipetrain's passes know.
pub const SUPPORTED_OPSETS: std::ops::RangeInclusive<i64> = 13..=21;

/// Element type and concrete shape of one value, as measured on an example batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl ValueMeta {
    /// A float32 value of `shape`.
    pub fn f32(shape: &[usize]) -> ValueMeta {
        ValueMeta {
            dtype: DType::F32,
            shape: shape.to_vec(),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Dimensions as i64 (for shape constants).
    pub fn dims_i64(&self) -> Vec<i64> {
        self.shape.iter().map(|&d| d as i64).collect()
    }
}

/// Metadata of every value of a graph, by name.
pub type Metas = HashMap<String, ValueMeta>;

/// An ONNX graph as plain vectors.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    /// Graph name.
    pub name: String,
    /// Nodes in topological order.
    pub nodes: Vec<NodeProto>,
    /// Graph inputs (feeds).
    pub inputs: Vec<ValueInfoProto>,
    /// Graph outputs.
    pub outputs: Vec<ValueInfoProto>,
    /// Constant tensors baked into the graph.
    pub initializers: Vec<TensorProto>,
    /// Imported operator sets.
    pub opsets: Vec<OperatorSetIdProto>,
    /// IR version to write.
    pub ir_version: i64,
}

/// The most elements of a float initializer [`Graph::constants`] decodes.
pub const LARGEST_FLOAT_CONSTANT: u64 = 1 << 16;

impl Graph {
    /// The graph of a model, checking that its default opset is one pipetrain handles.
    ///
    /// # Errors
    /// `UnsupportedOpset` for a default-domain opset outside [`SUPPORTED_OPSETS`];
    /// `NotOnnx`-like `InvalidGraph` when the model has no graph.
    pub fn from_model(model: &ModelProto) -> Result<Graph> {
        let version = default_opset(model).unwrap_or(0);
        if !SUPPORTED_OPSETS.contains(&version) {
            return Err(Error::UnsupportedOpset {
                domain: String::new(),
                version,
                supported: format!(
                    "opsets {} to {} of the default domain",
                    SUPPORTED_OPSETS.start(),
                    SUPPORTED_OPSETS.end()
                ),
            });
        }
        let g = model
            .graph
            .as_ref()
            .ok_or_else(|| Error::graph("the model has no graph"))?;
        let init_names: std::collections::HashSet<&str> =
            g.initializer.iter().map(|t| t.name.as_str()).collect();
        Ok(Graph {
            name: g.name.clone(),
            nodes: g.node.clone(),
            // Older exporters list initializers among the inputs too; they are not feeds.
            inputs: g
                .input
                .iter()
                .filter(|v| !init_names.contains(v.name.as_str()))
                .cloned()
                .collect(),
            outputs: g.output.clone(),
            initializers: g.initializer.clone(),
            opsets: model.opset_import.clone(),
            ir_version: model.ir_version.min(MAX_IR_VERSION),
        })
    }

    /// The model holding this graph.
    pub fn to_model(&self) -> ModelProto {
        ModelProto {
            ir_version: self.ir_version.clamp(8, MAX_IR_VERSION),
            producer_name: "pipetrain".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            opset_import: self.opsets.clone(),
            graph: Some(GraphProto {
                name: self.name.clone(),
                node: self.nodes.clone(),
                input: self.inputs.clone(),
                output: self.outputs.clone(),
                initializer: self.initializers.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The default-domain opset version.
    pub fn opset(&self) -> i64 {
        self.opsets
            .iter()
            .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map_or(0, |o| o.version)
    }

    /// Adds an operator-set import unless the domain is already imported.
    pub fn import_domain(&mut self, domain: &str, version: i64) {
        if !self.opsets.iter().any(|o| o.domain == domain) {
            self.opsets.push(OperatorSetIdProto {
                domain: domain.into(),
                version,
            });
        }
    }

    /// Index of the node producing each value.
    pub fn producers(&self) -> HashMap<&str, usize> {
        let mut map = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                map.insert(o.as_str(), i);
            }
        }
        map
    }

    /// Indices of the nodes consuming each value.
    pub fn consumers(&self) -> HashMap<&str, Vec<usize>> {
        let mut map: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for inp in n.input.iter().filter(|i| !i.is_empty()) {
                map.entry(inp.as_str()).or_default().push(i);
            }
        }
        map
    }

    /// The initializer of that name.
    pub fn initializer(&self, name: &str) -> Option<&TensorProto> {
        self.initializers.iter().find(|t| t.name == name)
    }

    /// Constant values: initializers and outputs of `Constant` nodes, decoded.
    ///
    /// Float initializers of more than [`LARGEST_FLOAT_CONSTANT`] elements are left out:
    /// the rewrites that read constants read shapes, axes, scalars and masks, and
    /// decoding every weight copied the whole model at each of the seven calls that
    /// building a training graph makes (3.8 GB each for a 1-billion-parameter model).
    pub fn constants(&self) -> HashMap<String, Tensor> {
        let mut map = HashMap::new();
        let is_large_float = |t: &TensorProto| {
            let float = crate::tensor::DType::from_onnx(t.data_type).is_some_and(|d| d.is_float());
            let len = t.dims.iter().map(|&d| d.max(0) as u64).product::<u64>();
            float && len > LARGEST_FLOAT_CONSTANT
        };
        for t in self.initializers.iter().filter(|t| !is_large_float(t)) {
            if let Ok(v) = Tensor::from_proto(t) {
                map.insert(t.name.clone(), v);
            }
        }
        for n in self.nodes.iter().filter(|n| n.op_type == "Constant") {
            if let Some(v) = constant_value(n) {
                map.insert(n.output[0].clone(), v);
            }
        }
        map
    }

    /// Whether `name` is a value of the graph (input, initializer or node output).
    pub fn has_value(&self, name: &str) -> bool {
        self.inputs.iter().any(|v| v.name == name)
            || self.initializers.iter().any(|t| t.name == name)
            || self
                .nodes
                .iter()
                .any(|n| n.output.iter().any(|o| o == name))
    }

    /// A short list of value names, for "did you mean" hints in errors.
    pub fn value_names_hint(&self) -> String {
        let outs: Vec<&str> = self.outputs.iter().map(|v| v.name.as_str()).collect();
        format!("; graph outputs are {outs:?}")
    }
}

/// `axis` (negative from the end) as an index into `rank` axes; `None` out of range.
pub fn axis_index(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    usize::try_from(a).ok().filter(|&a| a < rank)
}

/// A node's display name: its name, or its first output when unnamed.
pub fn node_label(n: &NodeProto) -> String {
    if !n.name.is_empty() {
        n.name.clone()
    } else {
        n.output.first().cloned().unwrap_or_default()
    }
}

/// The integer attribute `name`.
pub fn attr_i(n: &NodeProto, name: &str) -> Option<i64> {
    n.attribute.iter().find(|a| a.name == name).map(|a| a.i)
}

/// The float attribute `name`.
pub fn attr_f(n: &NodeProto, name: &str) -> Option<f32> {
    n.attribute.iter().find(|a| a.name == name).map(|a| a.f)
}

/// The integer-list attribute `name`.
pub fn attr_ints(n: &NodeProto, name: &str) -> Option<Vec<i64>> {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map(|a| a.ints.clone())
}

/// The string attribute `name`.
pub fn attr_s(n: &NodeProto, name: &str) -> Option<String> {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// An integer attribute.
pub fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Int as i32,
        i: v,
        ..Default::default()
    }
}

/// A float attribute.
pub fn float_attr(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Float as i32,
        f: v,
        ..Default::default()
    }
}

/// An integer-list attribute.
pub fn ints_attr(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Ints as i32,
        ints: v.to_vec(),
        ..Default::default()
    }
}

/// A string attribute.
pub fn string_attr(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::String as i32,
        s: v.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// A list-of-strings attribute (an RNN's `activations`).
pub fn strings_attr(name: &str, v: &[&str]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Strings as i32,
        strings: v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        ..Default::default()
    }
}

/// The list-of-strings attribute `name`.
pub fn attr_strings(n: &NodeProto, name: &str) -> Option<Vec<String>> {
    n.attribute.iter().find(|a| a.name == name).map(|a| {
        a.strings
            .iter()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    })
}

/// A tensor attribute.
pub fn tensor_attr(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Tensor as i32,
        t: Some(t),
        ..Default::default()
    }
}

/// A node.
pub fn make_node(
    op_type: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        op_type: op_type.into(),
        name: name.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute,
        ..Default::default()
    }
}

/// The value of a `Constant` node, whichever attribute holds it (`value`, or the
/// `value_int(s)` and `value_float(s)` that the dynamo exporter writes).
pub fn constant_value(n: &NodeProto) -> Option<Tensor> {
    let a = n.attribute.first()?;
    match a.name.as_str() {
        "value" => Tensor::from_proto(a.t.as_ref()?).ok(),
        "value_int" => Tensor::i64(vec![], vec![a.i]).ok(),
        "value_ints" => Tensor::i64(vec![a.ints.len()], a.ints.clone()).ok(),
        "value_float" => Tensor::f32(vec![], vec![a.f]).ok(),
        "value_floats" => Tensor::f32(vec![a.floats.len()], a.floats.clone()).ok(),
        _ => None,
    }
}

/// A graph input or output of a known type and shape.
pub fn value_info(name: &str, meta: &ValueMeta) -> ValueInfoProto {
    let dims = meta
        .shape
        .iter()
        .map(|&d| tensor_shape_proto::Dimension {
            value: Some(tensor_shape_proto::dimension::Value::DimValue(d as i64)),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: meta.dtype.onnx(),
                shape: Some(TensorShapeProto { dim: dims }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A graph output with no declared type (ONNX Runtime infers it).
pub fn untyped_value_info(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        ..Default::default()
    }
}

/// The element type and static dimensions a value info declares (`None` for symbolic).
pub fn declared_type(v: &ValueInfoProto) -> Option<(i32, Vec<Option<i64>>)> {
    let Some(type_proto::Value::TensorType(t)) = v.r#type.as_ref()?.value.as_ref() else {
        return None;
    };
    let dims = t
        .shape
        .as_ref()
        .map(|s| {
            s.dim
                .iter()
                .map(|d| match d.value {
                    Some(tensor_shape_proto::dimension::Value::DimValue(v)) => Some(v),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Some((t.elem_type, dims))
}
