//! One ONNX Runtime session per graph, fed from pipetrain-owned buffers.

use std::borrow::Cow;

use ort::session::{builder::GraphOptimizationLevel, Session, SessionInputValue};
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};
use prost::Message;

use super::direct::{in_place, DirectOutputs, Target};
use super::shard_ops::{custom_domain, ShardLink};
use crate::compute::{Device, Runtime};
use crate::graph::custom_ops::DOMAIN;
use crate::graph::Graph;
use crate::onnx::proto::ModelProto;
use crate::tensor::{DType, Tensor, TensorData, TensorView, ViewData};
use crate::{Error, Result};

/// How sessions are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    /// Threads inside one operator (ONNX Runtime's intra-op pool).
    pub intra_threads: usize,
    /// Threads across independent operators (1 = sequential execution).
    pub inter_threads: usize,
    /// Run ONNX Runtime's graph optimizations (fusions, constant folding).
    pub optimize: bool,
    /// Let idle intra-op threads spin waiting for work (faster for one session alone,
    /// slower when several sessions share the cores).
    pub spin: bool,
    /// Record ONNX Runtime's per-operator profile (a JSON file in the current folder,
    /// named after the session; see [`GraphSession::end_profiling`]).
    pub profile: bool,
    /// Where the graph computes: ONNX Runtime's CPU provider, or its CUDA provider on a
    /// stream of the session's own (builds with `--features cuda`), the CPU provider
    /// taking the nodes it has no CUDA kernel for.
    pub device: Device,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            intra_threads: 2,
            inter_threads: 1,
            optimize: true,
            spin: true,
            profile: false,
            device: Device::Cpu,
        }
    }
}

/// A graph ready to run: an ONNX Runtime session and the order of its inputs and outputs.
pub struct GraphSession {
    /// Declared before `_stream`: ONNX Runtime's session goes first.
    session: Session,
    label: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    /// Run options directing outputs into a caller's buffer, kept for that buffer.
    direct: Option<DirectOutputs>,
    /// The CUDA stream ONNX Runtime computes on, for a session on a GPU.
    #[cfg(feature = "cuda")]
    _stream: Option<super::cuda::DeviceStream>,
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
        GraphSession::build(rt, &graph.to_model(), opts, label, (true, link, None))
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
        GraphSession::build(rt, model, opts, label, (true, None, None))
    }

    /// A session whose memory goes back to the system as soon as a run ends (no arena):
    /// for one-off runs such as the shape probe, whose values would otherwise stay in an
    /// arena (and the process's resident memory) for the rest of the run.
    pub(crate) fn one_off(
        rt: &Runtime,
        graph: &Graph,
        opts: &SessionOptions,
        label: &str,
    ) -> Result<GraphSession> {
        GraphSession::build(rt, &graph.to_model(), opts, label, (false, None, None))
    }

    /// [`GraphSession::one_off`] recording ONNX Runtime's profile (every node's output
    /// types and shapes among it) to `<to>_<time>.json`, found by
    /// [`GraphSession::end_profiling`].
    pub(crate) fn profiled_one_off(
        rt: &Runtime,
        graph: &Graph,
        opts: &SessionOptions,
        label: &str,
        to: &std::path::Path,
    ) -> Result<GraphSession> {
        GraphSession::build(rt, &graph.to_model(), opts, label, (false, None, Some(to)))
    }

    fn build(
        rt: &Runtime,
        model: &ModelProto,
        opts: &SessionOptions,
        label: &str,
        (arena, link, profile_to): (bool, Option<&ShardLink>, Option<&std::path::Path>),
    ) -> Result<GraphSession> {
        let custom = model.opset_import.iter().any(|o| o.domain == DOMAIN);
        let graph = model.graph.clone().unwrap_or_default();
        let bytes = model.encode_to_vec();
        let ctx = || format!("creating the session for {label}");
        let level = if opts.optimize {
            GraphOptimizationLevel::All
        } else {
            GraphOptimizationLevel::Disable
        };
        let (gpu, _stream) = gpu_provider(opts.device)?;
        let session = Session::builder(rt.env())
            .and_then(|b| {
                let cpu = ort::ep::CPU::default().with_arena_allocator(arena).build();
                let providers: Vec<_> = gpu.into_iter().chain([cpu]).collect();
                b.with_execution_providers(providers).map_err(Into::into)
            })
            .and_then(|b| b.with_optimization_level(level).map_err(Into::into))
            // Exact resume on a GPU asks for the same sums every run: ONNX Runtime's
            // deterministic kernels where it has them (the CPU's are already).
            .and_then(|b| {
                b.with_deterministic_compute(opts.device != Device::Cpu)
                    .map_err(Into::into)
            })
            .and_then(|b| b.with_intra_threads(opts.intra_threads).map_err(Into::into))
            .and_then(|b| b.with_inter_threads(opts.inter_threads).map_err(Into::into))
            .and_then(|b| {
                b.with_parallel_execution(opts.inter_threads > 1)
                    .map_err(Into::into)
            })
            .and_then(|b| {
                // Idle intra-op threads spin for work by default; with several sessions
                // on few cores (pipeline stages), spinning threads of an idle session
                // steal the cores a busy one needs.
                b.with_config_entry(
                    "session.intra_op.allow_spinning",
                    if opts.spin { "1" } else { "0" },
                )
                .map_err(Into::into)
            })
            .and_then(|b| match profile_to {
                Some(to) => b.with_profiling(to).map_err(Into::into),
                None if opts.profile => {
                    let name: String = label
                        .chars()
                        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                        .collect();
                    b.with_profiling(format!("pipetrain_{name}"))
                        .map_err(Into::into)
                }
                None => Ok(b),
            })
            .and_then(|b| match custom {
                true => {
                    let alone = ShardLink::alone();
                    let domain = custom_domain(link.unwrap_or(&alone))?;
                    b.with_operators(domain).map_err(Into::into)
                }
                false => Ok(b),
            })
            .and_then(|mut b| {
                let first = first_with_custom_domain(custom);
                let session = b.commit_from_memory(&bytes);
                if let (Some(mut known), Ok(_)) = (first, &session) {
                    *known = true;
                }
                session
            })
            .map_err(Error::ort(ctx()))?;
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
            direct: None,
            #[cfg(feature = "cuda")]
            _stream,
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

    /// The graph's input names, in order.
    pub fn input_names(&self) -> &[String] {
        &self.inputs
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
        feeds: &[(&str, &Tensor)],
    ) -> Result<Vec<(DType, Vec<usize>)>> {
        let label = self.label.clone();
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(feeds.len());
        for (name, t) in feeds {
            inputs.push((
                Cow::Borrowed(*name),
                view(&t.view()).map_err(Error::ort(format!("running {label}")))?,
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
        self.run_with(feeds, None, sink)
    }
}

impl GraphSession {
    /// [`GraphSession::run_views_into`] where ONNX Runtime writes the float32 outputs
    /// named by `targets` straight into their ranges of `buf` (a step's first gradients,
    /// into the accumulators); the other outputs go to `sink` or are returned as there.
    ///
    /// # Errors
    /// As [`GraphSession::run_views_into`]; `BadTensor` when a target does not fit `buf`
    /// or ONNX Runtime produced it with another shape.
    pub fn run_views_direct(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        buf: &mut [f32],
        targets: &[Target<'_>],
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        if !self.direct.as_ref().is_some_and(|d| d.fits(buf, targets)) {
            self.direct = Some(DirectOutputs::new(
                buf,
                targets,
                &self.outputs,
                &self.label,
            )?);
        }
        self.run_with(feeds, Some((buf, targets)), sink)
    }

    /// Runs the graph, with the outputs directed into a buffer when `direct` says so
    /// (then `self.direct` holds the options made for it), the rest offered to `sink`.
    fn run_with(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        direct: Option<(&mut [f32], &[Target<'_>])>,
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        let GraphSession {
            session,
            label,
            outputs: names,
            direct: options,
            ..
        } = self;
        let ctx = || format!("running {label}");
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(feeds.len());
        for (name, t) in feeds {
            inputs.push((Cow::Borrowed(*name), view(t).map_err(Error::ort(ctx()))?));
        }
        let outputs = match (&direct, options.as_ref()) {
            (Some(_), Some(d)) => session.run_with_options(inputs, &d.options),
            _ => session.run(inputs),
        }
        .map_err(Error::ort(ctx()))?;
        let (buf, targets) = direct.unwrap_or((&mut [], &[]));
        let mut result = Vec::with_capacity(names.len());
        for (k, name) in names.iter().enumerate() {
            let value = outputs.get(name).ok_or_else(|| Error::BadTensor {
                name: name.clone(),
                reason: format!("{label} did not produce this output"),
            })?;
            if let Some(t) = targets.iter().find(|t| t.output == k) {
                in_place(value, name, t, buf, label)?;
                continue;
            }
            if let Ok((_, values)) = value.try_extract_tensor::<f32>() {
                if sink(name, values)? {
                    continue;
                }
            }
            result.push((name.clone(), to_host(value, name)?));
        }
        Ok(result)
    }
}

/// Lends a host tensor to ONNX Runtime.
fn view<'a>(t: &TensorView<'a>) -> ort::Result<SessionInputValue<'a>> {
    let shape = t.shape.to_vec();
    Ok(match t.data {
        ViewData::F32(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::F64(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::I64(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::I32(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::Bool(v) => TensorRef::from_array_view((shape, v))?.into(),
    })
}

/// Copies an ONNX Runtime output into a host tensor.
pub(crate) fn to_host(value: &DynValue, name: &str) -> Result<Tensor> {
    let bad = |reason: String| Error::BadTensor {
        name: name.into(),
        reason,
    };
    let ValueType::Tensor { ty, .. } = value.dtype() else {
        return Err(bad("output is not a tensor".into()));
    };
    let ctx = || format!("reading output `{name}`");
    macro_rules! take {
        ($t:ty, $variant:ident) => {{
            let (shape, data) = value
                .try_extract_tensor::<$t>()
                .map_err(Error::ort(ctx()))?;
            let shape = shape.iter().map(|&d| d as usize).collect();
            Tensor::new(shape, TensorData::$variant(data.to_vec()))
        }};
    }
    match ty {
        TensorElementType::Float32 => take!(f32, F32),
        TensorElementType::Float64 => take!(f64, F64),
        TensorElementType::Int64 => take!(i64, I64),
        TensorElementType::Int32 => take!(i32, I32),
        TensorElementType::Bool => take!(bool, Bool),
        other => Err(bad(format!("unsupported output element type {other:?}"))),
    }
}

/// Whether a session with pipetrain's operator domain has been created in this process.
static CUSTOM_DOMAIN_KNOWN: std::sync::Mutex<bool> = std::sync::Mutex::new(false);

/// The stream a session on a GPU owns (nothing in a build without CUDA).
#[cfg(feature = "cuda")]
type OwnStream = Option<super::cuda::DeviceStream>;
#[cfg(not(feature = "cuda"))]
type OwnStream = ();

/// ONNX Runtime's CUDA provider for a session on `device` (none for the CPU), computing on
/// a new stream that the session keeps. TF32 stays off: float32 products as the CPU's.
fn gpu_provider(device: Device) -> Result<(Option<ort::ep::ExecutionProviderDispatch>, OwnStream)> {
    let Device::Cuda(index) = device else {
        return Ok((None, OwnStream::default()));
    };
    #[cfg(feature = "cuda")]
    {
        let stream = super::cuda::DeviceStream::new(index).map_err(|reason| Error::Device {
            device: device.to_string(),
            reason,
        })?;
        let cuda = ort::ep::CUDA::default()
            .with_device_id(index as i32)
            .with_tf32(false);
        // SAFETY: the stream outlives the session: both belong to the `GraphSession`,
        // which declares (so drops) its ONNX Runtime session first.
        let cuda = unsafe { cuda.with_compute_stream(stream.raw()) };
        Ok((Some(cuda.build().error_on_failure()), Some(stream)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = index;
        Err(Error::Device {
            device: device.to_string(),
            reason: "this build has no CUDA path; build pipetrain with `--features cuda`".into(),
        })
    }
}

/// ONNX Runtime enters a custom operator domain into a process-wide table when the first
/// session using it is created, checking and inserting without a lock: two sessions
/// created at once can both insert, and one fails ("the domain is already exist"). Until
/// one has been created, sessions with pipetrain's domain are created one at a time
/// (the guard, held over the creation); after that, concurrently (`None`).
fn first_with_custom_domain(custom: bool) -> Option<std::sync::MutexGuard<'static, bool>> {
    if !custom {
        return None;
    }
    let known = CUSTOM_DOMAIN_KNOWN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    (!*known).then_some(known)
}
