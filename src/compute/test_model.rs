//! Tests' one-node models of pipetrain's operators (the CUDA kernels' tests).

use crate::graph::custom_ops::DOMAIN;
use crate::graph::{untyped_value_info, value_info, ValueMeta};
use crate::onnx::proto::{GraphProto, ModelProto, NodeProto, OperatorSetIdProto};

/// A model of `nodes` (put in pipetrain's domain), opset 17, with typed `inputs` and
/// untyped `outputs`.
pub(crate) fn model(
    name: &str,
    mut nodes: Vec<NodeProto>,
    inputs: &[(&str, ValueMeta)],
    outputs: &[&str],
) -> ModelProto {
    for n in &mut nodes {
        n.domain = DOMAIN.into();
    }
    let mut model = standard_model(name, nodes, inputs, outputs);
    model.opset_import.push(OperatorSetIdProto {
        domain: DOMAIN.into(),
        version: 1,
    });
    model
}

/// A model of standard-op `nodes`, opset 17, with typed `inputs` and untyped `outputs`.
pub(crate) fn standard_model(
    name: &str,
    nodes: Vec<NodeProto>,
    inputs: &[(&str, ValueMeta)],
    outputs: &[&str],
) -> ModelProto {
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: name.into(),
            node: nodes,
            input: inputs.iter().map(|(n, m)| value_info(n, m)).collect(),
            output: outputs.iter().map(|o| untyped_value_info(o)).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Whether this machine has no GPU, saying so (a device test then skips; `gpu-check`
/// fails its kernels check on the word `skipped`).
#[cfg(feature = "cuda")]
pub(crate) fn no_gpu() -> bool {
    let none = super::cuda_devices().map_or(true, |d| d.names.is_empty());
    if none {
        eprintln!("skipped: no GPU");
    }
    none
}
