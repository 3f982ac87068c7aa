//! How graph building learns shapes: from the caller, who runs the graph
//! ([`ShapeProbe`]).

use crate::graph::ir::{Graph, Metas};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Measures the element type and shape of every value of a graph run on example feeds.
///
/// Graph building needs concrete shapes (the backward graphs are built for the
/// micro-batch's), and takes them from the caller: `compute` implements this for
/// [`crate::compute::Runtime`] by running ONNX Runtime once with every value exposed;
/// a test can hand in shapes it knows. The graph layer itself runs nothing.
pub trait ShapeProbe {
    /// The type and shape of every input, initializer and node output of `graph` on
    /// `feeds`.
    ///
    /// # Errors
    /// When the graph cannot be measured (it does not run on the feeds).
    fn probe(&self, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Metas>;

    /// [`ShapeProbe::probe`], and the values of `fetch` (values of `graph`) from the
    /// same run where the probe can; by default, two runs.
    ///
    /// # Errors
    /// As [`ShapeProbe::probe`] and [`ShapeProbe::values`].
    fn probe_with_values(
        &self,
        graph: &Graph,
        feeds: &[(&str, &Tensor)],
        fetch: &[String],
    ) -> Result<(Metas, Vec<Tensor>)> {
        let metas = self.probe(graph, feeds)?;
        let mut only = graph.clone();
        only.outputs = fetch
            .iter()
            .map(|o| crate::graph::ir::untyped_value_info(o))
            .collect();
        Ok((metas, self.values(&only, feeds)?))
    }

    /// The values of `graph`'s outputs on `feeds` (static values to fold: shapes,
    /// masks, positions). A probe that only knows shapes cannot fold them.
    ///
    /// # Errors
    /// When the graph cannot be run on the feeds; by default, always.
    fn values(&self, graph: &Graph, _feeds: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        Err(Error::graph(format!(
            "this shape probe cannot compute the {} values computed from shapes alone",
            graph.outputs.len()
        )))
    }
}
