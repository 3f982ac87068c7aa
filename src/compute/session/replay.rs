//! [`GraphSession`] recorded once as a CUDA graph and replayed (`runtime.cuda_graph`).
//!
//! ONNX Runtime's CUDA provider (`enable_cuda_graph`) records a run's kernels once and
//! then replays the recording: one launch a run instead of one a kernel, and none of
//! ONNX Runtime's own work between kernels. A replay reads and writes the addresses the
//! recording saw, so every input and output stays at one address from run to run:
//! - the parameters and gradients already do (the stage's device buffers);
//! - host inputs (data, the backward's seed) are copied each run into fixed homes on the
//!   device, on the session's stream, ahead of the run;
//! - outputs read on the host (the loss, statistics) are written into fixed homes, and
//!   copied back after the run.
//!
//! The first run is an ordinary one (run option `gpu_graph_id = -1`): it finds the
//! shapes of the outputs, for their homes. Each set of addresses (a step's first
//! micro-batch writes the gradients, later ones the scratch buffer) has a graph of its
//! own (`gpu_graph_id` 1, 2, ...; 0 is ONNX Runtime's default), up to [`MAX_GRAPHS`]; a
//! run with yet another set is not recorded (said once, as a warning). The first call
//! with a new id runs the graph twice as usual, then records it and replays the
//! recording, all within that call (ONNX Runtime's `Run` calls itself until it has
//! recorded): harmless here, where every output is a function of the inputs alone (the
//! gradients are written, not added to, and no output is also an input).
//!
//! A replay runs none of ONNX Runtime's host-side work: an operator that draws random
//! numbers with a host-side generator (ONNX's `Dropout`, `Random*`) would replay its
//! first draw for ever, so a graph holding one is refused ([`check_replayable`];
//! pipetrain's `KeyedDropout` reads its key on the device). ONNX Runtime keeps a graph
//! per thread: a stage's actor runs on a thread of its own. It records with
//! `cudaStreamCaptureModeGlobal`, so no other thread of the process may call CUDA while
//! it does: hence one stage and one replica (`runtime.cuda_graph`'s rule).
//!
//! Over host memory (`debug.device_path_on_host`) the same homes serve without a graph:
//! that is how they are tested without a GPU.

use ort::session::RunOptions;
use ort::sys::ONNXTensorElementDataType as Elem;
use ort::value::{DynValue, ValueType};

use super::super::direct::{over, over_bytes, Target};
use super::super::resident::{memory_info, DeviceSpan};
use super::super::value::DeviceValue;
use super::bound::{bytes_of, distinct_outputs, elem};
use super::device::on_device;
use super::GraphSession;
use crate::tensor::{Tensor, TensorView};
use crate::{Error, Result};

/// The most graphs one session records, one for each set of addresses its runs use.
pub const MAX_GRAPHS: usize = 4;

/// A session's fixed homes, and the sets of addresses it has recorded graphs for.
#[derive(Default)]
pub(super) struct Replay {
    /// The host inputs' homes.
    inputs: Vec<Home>,
    /// The homes of the outputs read on the host, by output index (after the first run).
    outputs: Option<Vec<(usize, Home)>>,
    /// The sets of (address, length) recorded so far; a set's place + 1 is its graph's id.
    graphs: Vec<Vec<(usize, usize)>>,
    /// Whether a run beyond [`MAX_GRAPHS`] sets was reported.
    warned: bool,
}

/// A value's fixed home: its name, shape, element type and memory.
struct Home {
    name: String,
    shape: Vec<usize>,
    elem: Elem,
    bytes: usize,
    memory: Memory,
}

/// Memory at one address for as long as it lives.
enum Memory {
    /// Over host memory (`debug.device_path_on_host`), aligned for any element type.
    Host(Vec<u64>),
    #[cfg(feature = "cuda")]
    Device(super::super::cuda::DeviceHome),
}

impl Memory {
    fn addr(&mut self) -> usize {
        match self {
            Memory::Host(v) => v.as_mut_ptr() as usize,
            #[cfg(feature = "cuda")]
            Memory::Device(d) => d.addr,
        }
    }
}

impl GraphSession {
    /// [`GraphSession::run_device`] for a session recorded as a CUDA graph: the host
    /// inputs copied into their homes, every output written where the recording expects
    /// it, the run recorded or replayed.
    ///
    /// # Errors
    /// As [`GraphSession::run_device`]; `BadTensor` when an input's shape or type is not
    /// its first run's (a graph replays one shape).
    pub(super) fn run_replayed(
        &mut self,
        host: &[(&str, TensorView<'_>)],
        device: &[(&str, DeviceSpan, &[usize])],
        out: DeviceSpan,
        targets: &[Target<'_>],
    ) -> Result<Vec<(String, Tensor)>> {
        let mut replay = self.replay.take().expect("a session recorded as a graph");
        let result = self.replay_run(&mut replay, host, device, out, targets);
        self.replay = Some(replay);
        result
    }

    fn replay_run(
        &mut self,
        replay: &mut Replay,
        host: &[(&str, TensorView<'_>)],
        device: &[(&str, DeviceSpan, &[usize])],
        out: DeviceSpan,
        targets: &[Target<'_>],
    ) -> Result<Vec<(String, Tensor)>> {
        let ctx = || format!("running {}", self.label);
        let (binding, addrs) = self.bind_fixed(replay, host, device, out, targets)?;
        let graph = replay.graph_for(addrs, &self.label);
        let mut options = RunOptions::new().map_err(Error::ort(ctx()))?;
        options
            .set("gpu_graph_id", graph.to_string())
            .map_err(Error::ort(ctx()))?;
        let started = std::time::Instant::now();
        let mut outputs = self
            .session
            .run_binding_with_options(&binding, &options)
            .map_err(Error::ort(ctx()))?;
        let run_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(target: "pipetrain::device", session = %self.label, run_ms, graph, "run, as a CUDA graph");
        let taken = distinct_outputs(&self.outputs, &mut outputs, &self.label)?;
        drop(outputs);
        self.read_back(replay, taken, out, targets)
    }

    /// A binding of every input and output at its fixed address: the host inputs in
    /// their homes (this run's values copied in), the parameters and the targets in the
    /// stage's buffers, the other outputs in their homes (on the first run, wherever ONNX
    /// Runtime puts them). Also the addresses that differ from run to run of a stage.
    fn bind_fixed(
        &self,
        replay: &mut Replay,
        host: &[(&str, TensorView<'_>)],
        device: &[(&str, DeviceSpan, &[usize])],
        out: DeviceSpan,
        targets: &[Target<'_>],
    ) -> Result<(ort::session::IoBinding, Vec<(usize, usize)>)> {
        let ctx = || format!("running {}", self.label);
        let info = memory_info(out.device).map_err(Error::ort(ctx()))?;
        let mut binding = self.session.create_binding().map_err(Error::ort(ctx()))?;
        let mut addrs = Vec::new();
        for (name, t) in host {
            let home = self.home_of(&mut replay.inputs, name, t)?;
            let value = home.value(&info, &self.label)?;
            (binding.bind_input(*name, &value)).map_err(Error::ort(ctx()))?;
        }
        for (name, span, shape) in device {
            addrs.push((span.addr, shape.iter().product()));
            let value = over(&info, span.addr as *mut f32, shape, &self.label)?;
            (binding.bind_input(*name, &value)).map_err(Error::ort(ctx()))?;
        }
        let first = replay.outputs.is_none();
        for (k, name) in self.outputs.iter().enumerate() {
            if self.outputs[..k].contains(name) {
                continue;
            }
            let home = (replay.outputs.as_mut()).and_then(|o| o.iter_mut().find(|(i, _)| *i == k));
            let bound = match (targets.iter().find(|t| t.output == k), home) {
                (Some(t), _) => {
                    t.check_fits(out.len, name)?;
                    let at = out.addr + t.offset * size_of::<f32>();
                    addrs.push((at, t.shape.iter().product()));
                    let value = over(&info, at as *mut f32, t.shape, &self.label)?;
                    binding.bind_output(name.as_str(), value)
                }
                (None, Some((_, home))) => {
                    binding.bind_output(name.as_str(), home.value(&info, &self.label)?)
                }
                (None, None) if first => binding.bind_output_to_device(name.as_str(), &info),
                (None, None) => {
                    return Err(Error::BadTensor {
                        name: name.clone(),
                        reason: format!(
                            "{} is replayed as a CUDA graph (`runtime.cuda_graph`): this \
                             output was written in place on its first run and is not now",
                            self.label
                        ),
                    })
                }
            };
            bound.map_err(Error::ort(ctx()))?;
        }
        Ok((binding, addrs))
    }

    /// The run's outputs (by index) checked or read: the targets where they were to be
    /// written, the others copied to the host; after the first run, homes made for them.
    fn read_back(
        &self,
        replay: &mut Replay,
        taken: Vec<(usize, DynValue)>,
        out: DeviceSpan,
        targets: &[Target<'_>],
    ) -> Result<Vec<(String, Tensor)>> {
        let first = replay.outputs.is_none();
        let mut homes = Vec::new();
        let mut result = Vec::with_capacity(taken.len());
        for (k, value) in taken {
            let name = &self.outputs[k];
            if let Some(t) = targets.iter().find(|t| t.output == k) {
                on_device(&value, name, t, &out, &self.label)?;
                continue;
            }
            if first {
                homes.push((k, self.home_for_output(name, &value)?));
            }
            let read = DeviceValue::new(value, name, out.device)?;
            result.push((name.clone(), read.to_host(name)?));
        }
        if first {
            replay.outputs = Some(homes);
        }
        Ok(result)
    }

    /// The home of host input `name`, made at its first run, with `t`'s values copied in.
    fn home_of<'r>(
        &self,
        homes: &'r mut Vec<Home>,
        name: &str,
        t: &TensorView<'_>,
    ) -> Result<&'r mut Home> {
        let at = match homes.iter().position(|h| h.name == name) {
            Some(at) => at,
            None => {
                let bytes = t.bytes();
                homes.push(Home {
                    name: name.into(),
                    shape: t.shape.to_vec(),
                    elem: elem(t),
                    bytes,
                    memory: self.memory(bytes)?,
                });
                homes.len() - 1
            }
        };
        let home = &mut homes[at];
        if home.shape != t.shape || home.elem != elem(t) {
            return Err(Error::BadTensor {
                name: name.into(),
                reason: format!(
                    "{} is replayed as a CUDA graph (`runtime.cuda_graph`), which reads one \
                     shape every run: this run's is {:?} ({:?}), the first run's {:?} ({:?})",
                    self.label,
                    t.shape,
                    elem(t),
                    home.shape,
                    home.elem
                ),
            });
        }
        self.write(&mut home.memory, bytes_of(t))?;
        Ok(home)
    }

    /// A home for output `name`, of the shape and type of its first run's `value`.
    fn home_for_output(&self, name: &str, value: &DynValue) -> Result<Home> {
        let ValueType::Tensor { ty, shape, .. } = value.dtype() else {
            return Err(Error::BadTensor {
                name: name.into(),
                reason: "output is not a tensor".into(),
            });
        };
        let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        let bytes = ty.byte_size(shape.iter().product()).unwrap_or(0);
        Ok(Home {
            name: name.into(),
            shape,
            elem: (*ty).into(),
            bytes,
            memory: self.memory(bytes)?,
        })
    }

    /// `bytes` bytes at a fixed address where this session computes.
    fn memory(&self, bytes: usize) -> Result<Memory> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.stream.as_ref() {
            let home = stream
                .home(bytes)
                .map_err(|reason| self.device_error(reason))?;
            return Ok(Memory::Device(home));
        }
        Ok(Memory::Host(vec![0u64; bytes.div_ceil(8).max(1)]))
    }

    /// `bytes` copied into `memory`, on the session's stream where it has one.
    fn write(&self, memory: &mut Memory, bytes: &[u8]) -> Result<()> {
        match memory {
            Memory::Host(v) => {
                bytemuck::cast_slice_mut::<u64, u8>(v)[..bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Device(home) => {
                let stream = self
                    .stream
                    .as_ref()
                    .expect("device memory of a session's stream");
                stream
                    .write(home, bytes)
                    .map_err(|reason| self.device_error(reason))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn device_error(&self, reason: String) -> Error {
        Error::Device {
            device: self.label.clone(),
            reason,
        }
    }
}

impl Home {
    /// A value over this home, to bind.
    fn value(&mut self, info: &ort::memory::MemoryInfo, label: &str) -> Result<DynValue> {
        let at = self.memory.addr() as *mut std::ffi::c_void;
        // SAFETY: the home holds `bytes` bytes of its shape and type at a fixed address
        // for as long as the session's replay state lives, which outlives every run.
        unsafe { over_bytes(info, at, self.bytes, (&self.shape, self.elem), label) }
    }
}

impl Replay {
    /// The graph id of a run over `addrs`: -1 (not recorded) for the first run, which
    /// finds the outputs' shapes, and for a set of addresses beyond [`MAX_GRAPHS`].
    fn graph_for(&mut self, addrs: Vec<(usize, usize)>, label: &str) -> i64 {
        if self.outputs.is_none() {
            return -1;
        }
        if let Some(at) = self.graphs.iter().position(|g| *g == addrs) {
            return at as i64 + 1;
        }
        if self.graphs.len() == MAX_GRAPHS {
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    "{label}: its runs bind more than {MAX_GRAPHS} sets of buffers; the \
                     others run without a CUDA graph"
                );
            }
            return -1;
        }
        self.graphs.push(addrs);
        self.graphs.len() as i64
    }
}

/// Refuses, for a session to be recorded as a CUDA graph, a graph with an operator that
/// draws random numbers on the host each run (a replay would repeat its first draw).
///
/// # Errors
/// `Config` naming `runtime.cuda_graph`, the node and its operator.
pub(super) fn check_replayable(model: &crate::onnx::proto::ModelProto, label: &str) -> Result<()> {
    const HOST_DRAWN: [&str; 9] = [
        "Dropout",
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "BiasDropout",
        "BitmaskDropout",
    ];
    let nodes = model.graph.iter().flat_map(|g| &g.node);
    match nodes
        .into_iter()
        .find(|n| HOST_DRAWN.contains(&n.op_type.as_str()))
    {
        None => Ok(()),
        Some(n) => Err(Error::Config {
            path: "<config>".into(),
            field: "runtime.cuda_graph".into(),
            rule: format!(
                "{label}: node `{}` ({}) draws random numbers on the host each run, and a \
                 CUDA graph would replay its first draw every step (pipetrain's dropout \
                 on a GPU, `runtime.cuda_kernels`, draws on the device)",
                n.name, n.op_type
            ),
        }),
    }
}

#[cfg(test)]
mod tests;
