//! A graph's large initializers lent to ONNX Runtime as feeds, for the one-off runs of
//! graph building (shape probes, folding static values).
//!
//! A session made from a model holding its weights copies them twice: into the encoded
//! model bytes, and into ONNX Runtime's own tensors as it loads them. For GPT-2 small that
//! is 0.5 GB each, on top of the model pipetrain holds, at every probe. Lifted, a large
//! initializer becomes a graph input and its bytes are fed as a borrowed view: the session's
//! model is the graph's structure and small constants only, and the weights are never
//! copied. (One-off sessions are not optimized, so nothing is lost by weights not being
//! constants there.)

use crate::graph::{value_info, Graph, ValueMeta};
use crate::onnx::proto::TensorProto;
use crate::tensor::{DType, TensorView};

/// Initializers of at least this many bytes are lifted.
const LIFT_BYTES: usize = 64 * 1024;

/// `graph` without its large initializers, which are inputs instead, and their values as
/// views of the initializers' bytes.
pub(crate) struct Lifted<'g> {
    /// The graph to make the session from.
    pub graph: Graph,
    /// The lifted initializers, by name: feed them with the run's own feeds.
    pub feeds: Vec<(&'g str, TensorView<'g>)>,
}

impl<'g> Lifted<'g> {
    /// Lifts the large initializers of `g` that can be viewed in place (raw float32 or
    /// int64 data, aligned); the others stay initializers.
    pub fn new(g: &'g Graph) -> Lifted<'g> {
        let mut graph = Graph {
            name: g.name.clone(),
            nodes: g.nodes.clone(),
            inputs: g.inputs.clone(),
            outputs: g.outputs.clone(),
            initializers: Vec::new(),
            opsets: g.opsets.clone(),
            ir_version: g.ir_version,
        };
        let mut feeds = Vec::new();
        for t in &g.initializers {
            match view(t) {
                Some((view, meta)) if t.raw_data.len() >= LIFT_BYTES => {
                    graph.inputs.push(value_info(&t.name, &meta));
                    feeds.push((t.name.as_str(), view));
                }
                _ => graph.initializers.push(t.clone()),
            }
        }
        Lifted { graph, feeds }
    }
}

/// `t`'s raw bytes seen as its elements without a copy ([`crate::tensor::proto_view`]),
/// with its type and shape.
pub(crate) fn view(t: &TensorProto) -> Option<(TensorView<'_>, ValueMeta)> {
    let view = crate::tensor::proto_view(t)?;
    let dtype = DType::from_onnx(t.data_type)?;
    let meta = ValueMeta {
        dtype,
        shape: view.shape.to_vec(),
    };
    Some((view, meta))
}
