//! One ONNX Runtime session per graph, fed from pipetrain-owned buffers.

use std::borrow::Cow;

use ort::session::{RunOptions, Session, SessionInputValue};
use ort::value::{TensorElementType, ValueType};

use super::direct::DirectOutputs;
use super::open::{open, Extras, SessionOptions};
use super::shard_ops::ShardLink;
use crate::compute::{Device, Runtime};
use crate::graph::Graph;
use crate::onnx::proto::ModelProto;
use crate::tensor::{DType, Tensor, TensorView};
use crate::{Error, Result};

mod bound;
mod device;
mod replay;
mod run;

pub use bound::BoundInputs;
pub(crate) use run::to_host;
use run::{produced, view};

/// A graph ready to run: an ONNX Runtime session and the order of its inputs and outputs.
pub struct GraphSession {
    /// Declared before `stream`: ONNX Runtime's session goes first.
    session: Session,
    label: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    /// Run options directing outputs into a caller's buffer, kept for that buffer.
    direct: Option<DirectOutputs>,
    /// Where the float32 outputs it returns are copied (`None`: new buffers).
    pool: Option<super::HostPool>,
    /// Run options that hand the CPU arena's unused regions back after each run
    /// ([`GraphSession::shrink_arena_after_runs`]; `None`: the arena keeps them).
    shrink: Option<RunOptions>,
    /// The fixed homes of a session recorded as a CUDA graph (`SessionOptions::cuda_graph`).
    replay: Option<Box<replay::Replay>>,
    /// The CUDA stream ONNX Runtime computes on, for a session on a GPU.
    #[cfg(feature = "cuda")]
    stream: Option<super::cuda::DeviceStream>,
}

impl std::fmt::Debug for GraphSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphSession")
            .field("label", &self.label)
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish()
    }
}

impl GraphSession {
    /// Creates a session for `graph`; `label` names it in errors ("stage 1 backward").
    ///
    /// # Errors
    /// `Ort` when ONNX Runtime rejects the graph (the message names the node).
    pub fn new(
        rt: &Runtime,
        graph: &Graph,
        opts: &SessionOptions,
        label: &str,
    ) -> Result<GraphSession> {
        GraphSession::from_model(rt, &graph.to_model(), opts, label)
    }

    /// [`GraphSession::new`] for a tensor shard: the shard collectives of `graph` sum
    /// through `link` (without one, a graph's collectives sum over a group of one).
    ///
    /// # Errors
    /// As [`GraphSession::new`].
    pub fn for_shard(
        rt: &Runtime,
        graph: &Graph,
        opts: &SessionOptions,
        label: &str,
        link: Option<&ShardLink>,
    ) -> Result<GraphSession> {
        GraphSession::build(
            rt,
            &graph.to_model(),
            opts,
            label,
            Extras {
                link,
                ..Extras::USUAL
            },
        )
    }

    /// Creates a session for a model as it is (an exported model, say).
    ///
    /// # Errors
    /// `Ort` when ONNX Runtime rejects the model.
    pub fn from_model(
        rt: &Runtime,
        model: &ModelProto,
        opts: &SessionOptions,
        label: &str,
    ) -> Result<GraphSession> {
        GraphSession::build(rt, model, opts, label, Extras::USUAL)
    }

    /// A session whose memory goes back to the system as soon as a run ends (no arena):
    /// for one-off runs such as the shape probe, whose values would otherwise stay in an
    /// arena (and the process's resident memory) for the rest of the run. With
    /// `profile_to`, it records ONNX Runtime's profile (every node's output types and
    /// shapes among it) to `<profile_to>_<time>.json`, found by
    /// [`GraphSession::end_profiling`].
    pub(crate) fn one_off(
        rt: &Runtime,
        graph: &Graph,
        opts: &SessionOptions,
        label: &str,
        profile_to: Option<&std::path::Path>,
    ) -> Result<GraphSession> {
        let extras = Extras {
            arena: false,
            profile_to,
            ..Extras::USUAL
        };
        GraphSession::build(rt, &graph.to_model(), opts, label, extras)
    }

    fn build(
        rt: &Runtime,
        model: &ModelProto,
        opts: &SessionOptions,
        label: &str,
        extras: Extras<'_>,
    ) -> Result<GraphSession> {
        let fixed = rewritten(model, opts)?;
        let model = fixed.as_ref().unwrap_or(model);
        if opts.cuda_graph {
            replay::check_replayable(model, label)?;
        }
        let (session, _stream) = open(rt, model, opts, label, extras)?;
        #[cfg(feature = "cuda")]
        let stream = _stream;
        let graph = model.graph.clone().unwrap_or_default();
        Ok(GraphSession {
            session,
            label: label.into(),
            inputs: graph
                .input
                .iter()
                .filter(|v| !graph.initializer.iter().any(|t| t.name == v.name))
                .map(|v| v.name.clone())
                .collect(),
            outputs: graph.output.iter().map(|v| v.name.clone()).collect(),
            pool: None,
            shrink: None,
            direct: None,
            replay: opts.cuda_graph.then(Default::default),
            #[cfg(feature = "cuda")]
            stream,
        })
    }

    /// Stops profiling and returns the profile file's path (sessions made with
    /// `profile: true`).
    ///
    /// # Errors
    /// `Ort` when the session was not profiling.
    pub fn end_profiling(&mut self) -> Result<std::path::PathBuf> {
        self.session
            .end_profiling()
            .map(Into::into)
            .map_err(Error::ort(format!("ending the profile of {}", self.label)))
    }

    /// Refuses a run other than [`GraphSession::run_device`] of a session recorded as a
    /// CUDA graph: only that run binds every value at a fixed address.
    fn not_replayed(&self) -> Result<()> {
        match self.replay {
            None => Ok(()),
            Some(_) => Err(Error::Device {
                device: self.label.clone(),
                reason: "recorded as a CUDA graph (`runtime.cuda_graph`), it replays only a \
                         stage with its state on the device that hands nothing on there"
                    .into(),
            }),
        }
    }

    /// The graph's input names, in order.
    pub fn input_names(&self) -> &[String] {
        &self.inputs
    }

    /// What names this session in errors (its graph's name, for a stage's sessions).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The graph's output names, in order.
    pub fn output_names(&self) -> &[String] {
        &self.outputs
    }

    /// Runs the graph. Every feed is lent to ONNX Runtime without a copy; the outputs are
    /// returned in the graph's output order.
    ///
    /// # Errors
    /// `Ort` when a feed is missing or has the wrong type or shape, or a kernel fails.
    pub fn run(&mut self, feeds: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        let views: Vec<(&str, TensorView<'_>)> =
            feeds.iter().map(|(n, t)| (*n, t.view())).collect();
        self.run_views(&views)
    }

    /// Runs the graph and returns only each output's element type and shape, in the
    /// graph's output order (nothing is copied out).
    ///
    /// # Errors
    /// As [`GraphSession::run`].
    pub(crate) fn run_shapes(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
    ) -> Result<Vec<(DType, Vec<usize>)>> {
        self.not_replayed()?;
        let label = self.label.clone();
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(feeds.len());
        for (name, t) in feeds {
            inputs.push((
                Cow::Borrowed(*name),
                view(t).map_err(Error::ort(format!("running {label}")))?,
            ));
        }
        let outputs = self
            .session
            .run(inputs)
            .map_err(Error::ort(format!("running {label}")))?;
        let mut result = Vec::with_capacity(self.outputs.len());
        for name in &self.outputs {
            let value = outputs.get(name).ok_or_else(|| Error::BadTensor {
                name: name.clone(),
                reason: format!("{label} did not produce this output"),
            })?;
            let ValueType::Tensor { ty, shape, .. } = value.dtype() else {
                return Err(Error::BadTensor {
                    name: name.clone(),
                    reason: "output is not a tensor".into(),
                });
            };
            let dtype = match ty {
                TensorElementType::Float32 => DType::F32,
                TensorElementType::Float64 => DType::F64,
                TensorElementType::Int64 => DType::I64,
                TensorElementType::Int32 => DType::I32,
                TensorElementType::Bool => DType::Bool,
                other => {
                    return Err(Error::BadTensor {
                        name: name.clone(),
                        reason: format!("unsupported element type {other:?}"),
                    })
                }
            };
            result.push((dtype, shape.iter().map(|&d| d as usize).collect()));
        }
        Ok(result)
    }

    /// [`GraphSession::run`] with borrowed views (slices of a flat parameter buffer, say).
    ///
    /// # Errors
    /// As [`GraphSession::run`].
    pub fn run_views(&mut self, feeds: &[(&str, TensorView<'_>)]) -> Result<Vec<Tensor>> {
        Ok(self
            .run_views_into(feeds, &mut |_, _| Ok(false))?
            .into_iter()
            .map(|(_, t)| t)
            .collect())
    }

    /// [`GraphSession::run_views`] that first offers every float32 output, still in
    /// ONNX Runtime's memory, to `sink` (name, values): what it takes (returns true for)
    /// is never copied out, so gradients go straight into their accumulators. Returns the
    /// other outputs, by name, in the graph's order.
    ///
    /// # Errors
    /// As [`GraphSession::run`], and what `sink` returns.
    pub fn run_views_into(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        self.run_with(feeds, None, &[], sink)
    }
}

/// `model` as `opts` computes it, `None` where that is the model itself: with mixed
/// precision its products in half precision ([`crate::graph::autocast`]); on a GPU
/// in a fixed order, its embedding gradients as one-hot products
/// ([`crate::graph::scatter_adds_as_products`]: ONNX Runtime's CUDA scatters add with
/// atomics; the CPU's `ScatterElements` adds in order). The products are cast first, so the embedding
/// gradient's own product stays float32, as PyTorch's embedding backward does.
fn rewritten(model: &ModelProto, opts: &SessionOptions) -> Result<Option<ModelProto>> {
    let gpu = opts.device != Device::Cpu;
    let nodes = || model.graph.iter().flat_map(|g| &g.node);
    let scatters = gpu && opts.deterministic && nodes().any(|n| n.op_type == "ScatterElements");
    if !scatters && opts.mixed_precision.is_none() {
        return Ok(None);
    }
    let mut graph = Graph::from_model(model)?;
    if let Some(half) = opts.mixed_precision {
        crate::graph::autocast::autocast(&mut graph, half, crate::graph::autocast::products(gpu));
    }
    if scatters {
        match cfg!(feature = "cuda") && opts.cuda_kernels {
            true => crate::graph::scatter_adds_as_rows_add(&mut graph),
            false => crate::graph::scatter_adds_as_products(&mut graph),
        };
    }
    Ok(Some(graph.to_model()))
}
