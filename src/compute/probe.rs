//! Measuring every value's element type and shape by running the graph once.
//!
//! ONNX Runtime's own shape inference is the most complete one available; rather than
//! re-implement it for every operator, pipetrain runs the forward graph on one example
//! batch with ONNX Runtime's profiler on, which records every node's output shapes. The
//! backward graphs are then built for those concrete shapes (the micro-batch shape is
//! fixed during training).

use crate::compute::lifted::Lifted;
use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::{untyped_value_info, Graph, Metas, ShapeProbe, ValueMeta};
use crate::tensor::{DType, Tensor, TensorView};
use crate::Result;

/// Graph building measures shapes by running ONNX Runtime.
impl ShapeProbe for Runtime {
    fn probe(&self, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Metas> {
        probe_values(self, graph, feeds)
    }

    fn probe_with_values(
        &self,
        graph: &Graph,
        feeds: &[(&str, &Tensor)],
        fetch: &[String],
    ) -> Result<(Metas, Vec<Tensor>)> {
        measure(self, graph, feeds, fetch)
    }

    fn values(&self, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        let lifted = Lifted::new(graph);
        let mut session = GraphSession::one_off(
            self,
            &lifted.graph,
            &all_cores(),
            "folding static values",
            None,
        )?;
        session.run_views(&views(feeds, &lifted))
    }
}

/// One-off runs (probes, folding): unoptimized, so that no value is fused away before it
/// is measured; one thread, but for the runs that compute a whole forward
/// ([`all_cores`]).
const ONE_OFF: SessionOptions = SessionOptions {
    intra_threads: 1,
    inter_threads: 1,
    optimize: false,
    spin: false,
    profile: false,
    device: crate::compute::Device::Cpu,
    deterministic: true,
    mixed_precision: None,
    state_on_device: false,
    device_path_on_host: false,
    cuda_kernels: false,
    cuda_graph: false,
};

/// [`ONE_OFF`] on every core: for runs that compute a whole forward.
fn all_cores() -> SessionOptions {
    SessionOptions {
        intra_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        ..ONE_OFF
    }
}

/// Values exposed per probe run where the profile gave no shape (see [`probe_values`]).
const PROBE_OUTPUTS: usize = 48;

/// The type and shape of every input, initializer and node output of `graph` when run on
/// `feeds`.
///
/// One run, profiled: ONNX Runtime's profile records each node's output types and shapes,
/// and values are freed as the run goes, so memory stays that of a plain forward. Values
/// the profile leaves out (a node whose outputs it lists differently from the graph, an
/// element type pipetrain has no name for) are measured the slow way: a few at a time
/// exposed as graph outputs, each such run recomputing the graph (before the profile,
/// every value went that way: GPT-2 small's graph build was quadratic in its layers).
///
/// # Errors
/// `Ort` when the graph does not run on the feeds.
pub fn probe_values(rt: &Runtime, graph: &Graph, feeds: &[(&str, &Tensor)]) -> Result<Metas> {
    Ok(measure(rt, graph, feeds, &[])?.0)
}

/// [`probe_values`], and the values of `fetch` from the profiled run.
fn measure(
    rt: &Runtime,
    graph: &Graph,
    feeds: &[(&str, &Tensor)],
    fetch: &[String],
) -> Result<(Metas, Vec<Tensor>)> {
    let mut metas = Metas::new();
    for (name, t) in feeds {
        metas.insert(name.to_string(), meta_of(t));
    }
    for t in &graph.initializers {
        let (Some(dtype), Ok(shape)) = (
            DType::from_onnx(t.data_type),
            t.dims
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<Vec<_>, _>>(),
        ) else {
            continue;
        };
        metas.insert(t.name.clone(), ValueMeta { dtype, shape });
    }
    let lifted = Lifted::new(graph);
    let (graph, feeds) = (&lifted.graph, views(feeds, &lifted));
    // ONNX Runtime turns `Constant` nodes into initializers (no kernel, no profile event).
    for n in graph.nodes.iter().filter(|n| n.op_type == "Constant") {
        let value = n.attribute.iter().find(|a| a.name == "value");
        if let (Some(t), Some(out)) = (value.and_then(|a| a.t.as_ref()), n.output.first()) {
            if let Ok(v) = Tensor::from_proto(t) {
                metas.insert(out.clone(), meta_of(&v));
            }
        }
    }
    let fetched = profiled_shapes(rt, graph, &feeds, fetch, &mut metas)?;
    same_shape_outputs(graph, &mut metas);
    let mut names = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // Sequences are not tensors: they have no shape to measure.
    for n in graph
        .nodes
        .iter()
        .filter(|n| !crate::graph::makes_sequence(&n.op_type))
    {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if !metas.contains_key(o) && seen.insert(o.clone()) {
                names.push(o.clone());
            }
        }
    }
    tracing::debug!(
        "shape probe: {} of {} node outputs left to measure after the profile (such as {:?})",
        names.len(),
        graph.nodes.iter().map(|n| n.output.len()).sum::<usize>(),
        names.iter().take(3).collect::<Vec<_>>()
    );
    // A few values at a time: every exposed value is held until the run ends, and all of
    // a training graph's values at once would be the process's peak memory.
    for chunk in names.chunks(PROBE_OUTPUTS) {
        let mut probe = graph.clone();
        probe.outputs = chunk.iter().map(|o| untyped_value_info(o)).collect();
        let mut session = GraphSession::one_off(rt, &probe, &ONE_OFF, "the shape probe", None)?;
        let shapes = session.run_shapes(&feeds)?;
        for (name, (dtype, shape)) in session.output_names().iter().zip(shapes) {
            metas.insert(name.clone(), ValueMeta { dtype, shape });
        }
    }
    Ok((metas, fetched))
}

/// Enters the outputs of `Cast` and `Identity` nodes the profile left out, from their
/// inputs: each keeps its input's shape (ONNX Runtime records no kernel for a `Cast` to
/// the type its input already has, and each one left out cost a run of the whole graph
/// the slow way: 4.7 s of a 1-billion-parameter Llama's 14 s graph build).
fn same_shape_outputs(graph: &Graph, metas: &mut Metas) {
    for n in &graph.nodes {
        let (Some(x), Some(y)) = (n.input.first(), n.output.first()) else {
            continue;
        };
        if metas.contains_key(y) || !n.domain.is_empty() {
            continue;
        }
        let Some(input) = metas.get(x) else {
            continue;
        };
        let dtype = match n.op_type.as_str() {
            "Identity" => Some(input.dtype),
            "Cast" => crate::graph::attr_i(n, "to").and_then(|t| DType::from_onnx(t as i32)),
            _ => None,
        };
        if let Some(dtype) = dtype {
            let shape = input.shape.clone();
            metas.insert(y.clone(), ValueMeta { dtype, shape });
        }
    }
}

/// Runs `graph` once with ONNX Runtime's profiler on, its nodes renamed by index, and
/// enters each node's output types and shapes from the profile into `metas`.
fn profiled_shapes(
    rt: &Runtime,
    graph: &Graph,
    feeds: &[(&str, TensorView<'_>)],
    fetch: &[String],
    metas: &mut Metas,
) -> Result<Vec<Tensor>> {
    let mut probe = graph.clone();
    for (i, n) in probe.nodes.iter_mut().enumerate() {
        n.name = format!("{NODE_PREFIX}{i}");
    }
    fetch_shapes_only(&mut probe);
    probe
        .outputs
        .extend(fetch.iter().map(|o| untyped_value_info(o)));
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let to = std::env::temp_dir().join(format!(
        "pipetrain-probe-{}-{:?}-{stamp}",
        std::process::id(),
        std::thread::current().id()
    ));
    let profiled = profiled_run(rt, &probe, feeds, fetch.is_empty(), &to);
    // The profile files go whether the run worked or not (they are ours, in the temp
    // folder): ONNX Runtime writes one even for a session it failed to create.
    remove_profiles(&to);
    let (values, text) = profiled?;
    // The fetched values are the run's last outputs.
    let fetched = values[values.len() - fetch.len()..].to_vec();
    // An unreadable profile leaves every value to the slow way.
    let events: Option<serde_json::Value> = text.ok().and_then(|t| serde_json::from_str(&t).ok());
    for (node, shapes) in events.iter().flat_map(node_output_shapes) {
        let Some(n) = graph.nodes.get(node) else {
            continue;
        };
        let outputs: Vec<&String> = n.output.iter().filter(|o| !o.is_empty()).collect();
        if outputs.len() == shapes.len() && !crate::graph::makes_sequence(&n.op_type) {
            for (name, meta) in outputs.into_iter().zip(shapes) {
                metas.insert(name.clone(), meta);
            }
        }
    }
    Ok(fetched)
}

/// Runs `probe` once in a session profiling to `to` (its outputs' shapes only, where
/// `shapes_only`): its values and the profile's text.
fn profiled_run(
    rt: &Runtime,
    probe: &Graph,
    feeds: &[(&str, TensorView<'_>)],
    shapes_only: bool,
    to: &std::path::Path,
) -> Result<(Vec<Tensor>, std::io::Result<String>)> {
    let mut session = GraphSession::one_off(rt, probe, &all_cores(), "the shape probe", Some(to))?;
    let ran = match shapes_only {
        true => session.run_shapes(feeds).map(|_| Vec::new()),
        false => session.run_views(feeds),
    };
    let file = session.end_profiling()?;
    Ok((ran?, std::fs::read_to_string(file)))
}

/// Removes every profile ONNX Runtime wrote for the prefix `to` (`<to>_<time>.json`).
fn remove_profiles(to: &std::path::Path) {
    let (Some(dir), Some(prefix)) = (to.parent(), to.file_name()) else {
        return;
    };
    let prefix = format!("{}_", prefix.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&*prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Makes `probe` fetch the shape of each output a node computes rather than the value.
///
/// ONNX Runtime holds a fetched value until the run ends, and frees the others after
/// their last reader. A training graph's outputs are every parameter's gradient: fetched,
/// they were the model's size again at the probe (3.8 GB for a 1-billion-parameter
/// Llama). The profile records each node's outputs either way.
fn fetch_shapes_only(probe: &mut Graph) {
    let fetched: std::collections::HashMap<String, usize> = probe
        .outputs
        .iter()
        .enumerate()
        .map(|(k, o)| (o.name.clone(), k))
        .collect();
    // Each `Shape` right after the node computing its value, so that ONNX Runtime's
    // order (the graph's, where it can) frees the value there, not at the run's end.
    for n in std::mem::take(&mut probe.nodes) {
        let outs = match crate::graph::makes_sequence(&n.op_type) {
            true => Vec::new(),
            false => n
                .output
                .iter()
                .filter_map(|o| fetched.get(o))
                .copied()
                .collect(),
        };
        probe.nodes.push(n);
        for k in outs {
            let shape = format!("{NODE_PREFIX}shape_of_{k}");
            let value = std::mem::replace(&mut probe.outputs[k], untyped_value_info(&shape));
            probe.nodes.push(crate::onnx::proto::NodeProto {
                op_type: "Shape".into(),
                name: shape.clone(),
                input: vec![value.name],
                output: vec![shape],
                ..Default::default()
            });
        }
    }
}

/// The probe's node names: this and the node's index.
const NODE_PREFIX: &str = "pipetrain_probe_";

/// From a profile (ONNX Runtime's Chrome-trace JSON array), each node event's node index
/// and output types and shapes; `None` for events of another kind, or naming a type
/// pipetrain does not compute in.
fn node_output_shapes(
    events: &serde_json::Value,
) -> impl Iterator<Item = (usize, Vec<ValueMeta>)> + '_ {
    events.as_array().into_iter().flatten().filter_map(|e| {
        let name = e.get("name")?.as_str()?;
        let index = name
            .strip_prefix(NODE_PREFIX)?
            .strip_suffix("_kernel_time")?
            .parse()
            .ok()?;
        let outputs = e.get("args")?.get("output_type_shape")?.as_array()?;
        let metas = outputs
            .iter()
            .map(|o| {
                let (ty, dims) = o.as_object()?.iter().next()?;
                let dtype = match ty.as_str() {
                    "float" => DType::F32,
                    "double" => DType::F64,
                    "int64" => DType::I64,
                    "int32" => DType::I32,
                    "bool" => DType::Bool,
                    _ => return None,
                };
                let shape = dims
                    .as_array()?
                    .iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()?;
                Some(ValueMeta { dtype, shape })
            })
            .collect::<Option<Vec<_>>>()?;
        Some((index, metas))
    })
}

/// The run's feeds and the lifted initializers, as views.
fn views<'a>(
    feeds: &'a [(&'a str, &'a Tensor)],
    lifted: &'a Lifted<'a>,
) -> Vec<(&'a str, TensorView<'a>)> {
    feeds
        .iter()
        .map(|(n, t)| (*n, t.view()))
        .chain(lifted.feeds.iter().copied())
        .collect()
}

fn meta_of(t: &Tensor) -> ValueMeta {
    ValueMeta {
        dtype: t.dtype(),
        shape: t.shape.clone(),
    }
}
