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

    fn values(&self, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        let mut session = GraphSession::one_off(self, graph, &ONE_OFF, "folding static values")?;
        session.run(feeds)
    }
}

/// One-off runs (probes, folding): one thread, and unoptimized, so that no value is fused
/// away before it is measured.
const ONE_OFF: SessionOptions = SessionOptions {
    intra_threads: 1,
    inter_threads: 1,
    optimize: false,
    spin: false,
    profile: false,
    device: crate::compute::Device::Cpu,
};

/// Values exposed per probe run (see [`probe_values`]).
const PROBE_OUTPUTS: usize = 48;

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
    let mut names = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // Sequences are not tensors: they have no shape to measure.
    for n in graph
        .nodes
        .iter()
        .filter(|n| !crate::graph::makes_sequence(&n.op_type))
    {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if seen.insert(o.clone()) {
                names.push(o.clone());
            }
        }
    }
    // A few values at a time: every exposed value is held until the run ends, and all of
    // a training graph's values at once would be the process's peak memory (tiny_gpt:
    // 283 MiB that way). Each run recomputes the graph, a few milliseconds.
    for chunk in names.chunks(PROBE_OUTPUTS) {
        let mut probe = graph.clone();
        probe.outputs = chunk.iter().map(|o| untyped_value_info(o)).collect();
        let mut session = GraphSession::one_off(rt, &probe, &ONE_OFF, "the shape probe")?;
        let shapes = session.run_shapes(feeds)?;
        for (name, (dtype, shape)) in session.output_names().iter().zip(shapes) {
            metas.insert(name.clone(), ValueMeta { dtype, shape });
        }
    }
    Ok(metas)
}

fn meta_of(t: &Tensor) -> ValueMeta {
    ValueMeta {
        dtype: t.dtype(),
        shape: t.shape.clone(),
    }
}
