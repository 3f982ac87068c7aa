//! Measuring every value's element type and shape by running the graph once.
//!
//! ONNX Runtime's own shape inference is the most complete one available; rather than
//! re-implement it for every operator, pipetrain exposes every intermediate value as a
//! graph output and runs the forward graph on one example batch. The backward graphs are
//! then built for those concrete shapes (the micro-batch shape is fixed during training).

use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::{untyped_value_info, Graph, Metas, ShapeProbe, ValueMeta};
use crate::tensor::Tensor;
use crate::Result;

/// Graph building measures shapes by running ONNX Runtime.
impl ShapeProbe for Runtime {
    fn probe(&self, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Metas> {
        probe_values(self, graph, feeds)
    }
}

/// The type and shape of every input, initializer and node output of `graph` when run on
/// `feeds`.
///
/// # Errors
/// `Ort` when the graph does not run on the feeds.
pub fn probe_values(rt: &Runtime, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Metas> {
    let mut metas = Metas::new();
    for (name, t) in feeds {
        metas.insert(name.to_string(), meta_of(t));
    }
    for t in &graph.initializers {
        if let Ok(v) = Tensor::from_proto(t) {
            metas.insert(t.name.clone(), meta_of(&v));
        }
    }
    let mut probe = graph.clone();
    probe.outputs.clear();
    let mut seen = std::collections::HashSet::new();
    for n in &graph.nodes {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if seen.insert(o.clone()) {
                probe.outputs.push(untyped_value_info(o));
            }
        }
    }
    // Unoptimized, so that no value is fused away before it is measured.
    let opts = SessionOptions {
        intra_threads: 1,
        inter_threads: 1,
        optimize: false,
        spin: false,
        profile: false,
    };
    let mut session = GraphSession::new(rt, &probe, &opts, "the shape probe")?;
    let values = session.run(feeds)?;
    for (name, v) in session.output_names().iter().zip(values) {
        metas.insert(name.clone(), meta_of(&v));
    }
    Ok(metas)
}

fn meta_of(t: &Tensor) -> ValueMeta {
    ValueMeta {
        dtype: t.dtype(),
        shape: t.shape.clone(),
    }
}
