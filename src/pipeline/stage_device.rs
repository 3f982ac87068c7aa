//! [`OrtStage`] keeping its state on its device (`compute::DeviceState`): the sessions
//! read the parameters and write the gradients in device memory, a later micro-batch's
//! gradients are added there, and the optimizer's element-wise step runs there. The host
//! copy (`params`, the optimizer's own state) is brought up to date only when something
//! on the host reads it: a checkpoint, the trained parameters, a data-parallel reduction
//! over the host.

use std::collections::HashSet;
use std::sync::Arc;

use pipetrain_actors::GradStats;

use super::buckets::Chain;
use super::settings::StageSettings;
use super::stage::{OrtStage, Payload};
use super::stage_run::{fed, grad_targets};
use crate::compute::{BoundInputs, Buffer, Device, GraphSession, SessionOptions, Value};
use crate::graph::{StageIo, ACC_CORRECT, ACC_COUNTED, LOSS, LOSS_GRAD};
use crate::optim::OptimizerConfig;
use crate::{Error, Result};

/// Whether a stage opened with `opts` and `settings` keeps its state on its device: on a
/// GPU, asked for, and with nothing that reads the buffers on the host every step
/// (tensor shards, gradient buckets, Adasum, a sharded optimizer, histograms) or updates per tensor (LAMB).
pub(super) fn keeps_state_on_device(
    opts: &SessionOptions,
    settings: &StageSettings,
    chain: &Option<Chain>,
) -> bool {
    state_fits_device(opts, settings) && chain.is_none()
}

/// Whether a stage opened with `opts` and `settings`, without gradient buckets, keeps
/// its state on its device ([`keeps_state_on_device`]): where every data-parallel
/// replica of a stage does, in one process, they sum their gradients there
/// (`StageSettings::replicas`).
pub fn state_fits_device(opts: &SessionOptions, settings: &StageSettings) -> bool {
    (opts.device != Device::Cpu || opts.device_path_on_host)
        && opts.state_on_device
        && settings.shard.is_none()
        && settings.adasum.is_none()
        && settings.zero.is_none()
        && settings.histograms.is_none()
        && !matches!(settings.optimizer, OptimizerConfig::Lamb { .. })
}

/// The device state of a stage on `device` holding `params` and `optimizer`'s state
/// buffers, uploaded: on the CPU, the device path over host memory
/// (`debug.device_path_on_host`; [`keeps_state_on_device`] asks for it there only then).
pub(super) fn open_state(
    device: Device,
    params: &[f32],
    optimizer: &dyn crate::optim::Optimizer,
) -> Result<Option<Box<dyn crate::compute::DeviceState>>> {
    let state = optimizer.state();
    let bufs: Vec<&[f32]> = state.iter().map(|(_, b)| *b).collect();
    if device == Device::Cpu {
        return Ok(Some(Box::new(crate::compute::HostState::new(
            params, &bufs,
        ))));
    }
    crate::compute::open_device_state(device, params, &bufs)
}

/// What a stage on its device handed between host and device, in bytes: its host feeds
/// (data, messages from a stage on the host, the backward seed) and host outputs (loss,
/// statistics), the gradients' norm, and any state copied for a checkpoint or a
/// reduction over the host. Copies ONNX Runtime makes inside a run (for a node on the
/// CPU, say) are not seen here.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostTraffic {
    /// Bytes copied from the host to the device.
    pub to_device: usize,
    /// Bytes copied from the device to the host.
    pub to_host: usize,
}

/// A stage's [`HostTraffic`]: the step's so far, and the run's before it.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Traffic {
    pub step: HostTraffic,
    pub run: HostTraffic,
}

impl Traffic {
    /// Logs the step's traffic (target `pipetrain::device`, debug), adds it to the
    /// run's, and starts the next.
    pub(super) fn end_step(&mut self, step: u64) {
        let HostTraffic { to_device, to_host } = std::mem::take(&mut self.step);
        self.run.to_device += to_device;
        self.run.to_host += to_host;
        tracing::debug!(target: "pipetrain::device", step, to_device, to_host, "host traffic of the step (bytes)");
    }
}

/// The outputs of `io`'s graphs a stage with its state on its device leaves there: the
/// values it hands on (to the next stage, tied weights among them, back to the previous
/// one, from its forward to its backward, from its input-gradient half to its weight
/// half), but for those read on the host (the loss, accuracy counts, a running
/// statistic's update).
pub(super) fn left_on_device(io: &StageIo) -> HashSet<String> {
    let read_on_host: HashSet<&str> = (io.buffers.iter().map(|(_, update)| update.as_str()))
        .chain([LOSS, ACC_CORRECT, ACC_COUNTED])
        .collect();
    (io.fwd_send.iter())
        .chain(&io.bwd_send)
        .chain(&io.stash)
        .chain(&io.i_to_w)
        .filter(|n| !read_on_host.contains(n.as_str()))
        .cloned()
        .collect()
}

/// The values among `names` fed from `sources` or `buffers` that an earlier run left on
/// a device other than `here`: a stage on another GPU handed them on. They are brought
/// through the host, and the run uploads them as it does the data; peer copies between
/// GPUs are not built.
fn carried_from_other_devices(
    names: &[String],
    (layout, here): (&crate::optim::ParamLayout, Device),
    sources: &[&Payload],
    buffers: &Payload,
) -> Result<Vec<(String, crate::tensor::Tensor)>> {
    let mut carried = Vec::new();
    for n in names {
        if n == LOSS_GRAD || layout.index_of(n).is_some() {
            continue;
        }
        if let Value::Device(d) = &**fed(n, sources, buffers)? {
            if d.device() != here {
                carried.push((n.clone(), d.to_host(n)?));
            }
        }
    }
    Ok(carried)
}

/// The inputs of a run on the device of a graph whose inputs are `names`: the backward's
/// seed, host values and values `carried` from another device on the host, the
/// parameters (`layout` over the device's `params`) in place, values left on this
/// device by earlier runs as they are.
fn inputs_of<'a>(
    names: &'a [String],
    seed: Option<&'a crate::tensor::Tensor>,
    (layout, params): (&'a crate::optim::ParamLayout, crate::compute::DeviceSpan),
    sources: &[&'a Payload],
    (buffers, carried): (&'a Payload, &'a [(String, crate::tensor::Tensor)]),
) -> Result<BoundInputs<'a>> {
    let mut inputs = BoundInputs {
        host: Vec::new(),
        device: Vec::new(),
        held: Vec::new(),
    };
    for n in names {
        if let Some(seed) = seed.filter(|_| n == LOSS_GRAD) {
            inputs.host.push((n.as_str(), seed.view()));
        } else if let Some((_, t)) = carried.iter().find(|(c, _)| c == n) {
            inputs.host.push((n.as_str(), t.view()));
        } else if let Some(i) = layout.index_of(n) {
            let at = params.part(layout.range(i));
            (inputs.device).push((n.as_str(), at, layout.shapes()[i].as_slice()));
        } else {
            match &**fed(n, sources, buffers)? {
                Value::Host(t) => inputs.host.push((n.as_str(), t.view())),
                Value::Device(d) => inputs.held.push((n.as_str(), d)),
            }
        }
    }
    Ok(inputs)
}

impl OrtStage {
    /// What this stage handed between host and device over the finished steps of the
    /// run (`None`: it keeps its state on the host).
    pub fn host_traffic(&self) -> Option<HostTraffic> {
        self.device_state.as_ref().map(|_| self.host_traffic.run)
    }

    /// [`OrtStage::run`] with the parameters and gradients in device memory: the
    /// parameters fed in place, a step's first gradients written by ONNX Runtime into
    /// the accumulators, later ones into the scratch buffer and added. Where the run
    /// reads a value an earlier run left on the device, or leaves one there
    /// ([`left_on_device`]), it goes through ONNX Runtime's I/O binding
    /// (`GraphSession::run_bound`); otherwise through its plain run with the gradients'
    /// buffers given (`GraphSession::run_device`).
    pub(super) fn run_on_device(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Payload> {
        let started = std::time::Instant::now();
        let names = session.input_names().to_vec();
        let seed = match names.iter().any(|n| n == LOSS_GRAD) {
            true => Some(self.seed(sources)?),
            false => None,
        };
        let OrtStage {
            layout,
            written,
            grad_slot,
            buffers,
            device_state,
            device_values,
            host_traffic,
            ..
        } = self;
        let state = device_state.as_mut().expect("a stage on its device");
        let params = (&*layout, state.params());
        let here = (&*layout, params.1.device);
        let carried = carried_from_other_devices(&names, here, sources, buffers)?;
        host_traffic.step.to_host += carried.iter().map(|(_, t)| t.view().bytes()).sum::<usize>();
        let inputs = inputs_of(&names, seed.as_ref(), params, sources, (buffers, &carried))?;
        let (targets, slots) = grad_targets(session.output_names(), grad_slot, layout);
        let first = slots.iter().all(|&i| !written[i]);
        let out = match first {
            true => state.grads(),
            false => state.scratch()?,
        };
        let keep = |name: &str| device_values.contains(name);
        let bound = !inputs.held.is_empty() || session.output_names().iter().any(|n| keep(n));
        let rest: Vec<(String, Value)> = match bound {
            true => session.run_bound(&inputs, out, &targets, &keep)?,
            false => (session.run_device(&inputs.host, &inputs.device, out, &targets)?)
                .into_iter()
                .map(|(n, t)| (n, t.into()))
                .collect(),
        };
        host_traffic.step.to_device += inputs.host.iter().map(|(_, v)| v.bytes()).sum::<usize>();
        host_traffic.step.to_host += (rest.iter())
            .filter(|(_, v)| matches!(v, Value::Host(_)))
            .map(|(_, v)| v.bytes())
            .sum::<usize>();
        if !first {
            let ranges: Vec<_> = slots
                .iter()
                .map(|&i| (layout.range(i), written[i]))
                .collect();
            state.take_scratch(&ranges)?;
        }
        for &i in &slots {
            written[i] = true;
        }
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(target: "pipetrain::device", total_ms, bound, "stage run, state on the device");
        Ok(rest.into_iter().map(|(n, v)| (n, Arc::new(v))).collect())
    }

    /// Zeroes, on the device, the gradients nothing wrote this step.
    pub(super) fn complete_device_grads(&mut self) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        for i in 0..self.layout.count() {
            if !self.written[i] {
                state.zero_grads(self.layout.range(i))?;
                self.written[i] = true;
            }
        }
        Ok(())
    }

    /// The device's gradients' statistics; a failure is kept for the update to return,
    /// and reads as an overflow meanwhile.
    pub(super) fn device_grad_stats(&mut self) -> Option<GradStats> {
        let state = self.device_state.as_mut()?;
        self.host_traffic.step.to_host += size_of::<f64>();
        Some(match state.grad_sum_sq() {
            Ok(sum_sq) => GradStats { sum_sq },
            Err(e) => {
                self.device_error = Some(e);
                GradStats { sum_sq: f64::NAN }
            }
        })
    }

    /// One optimizer step on the device, the gradients multiplied by `scale` first.
    pub(super) fn device_update(&mut self, lr: f64, scale: f64) -> Result<()> {
        if let Some(e) = self.device_error.take() {
            return Err(e);
        }
        let state = self.device_state.as_mut().expect("a stage on its device");
        let step = self
            .optimizer
            .elementwise_step(lr)
            .ok_or_else(|| Error::Device {
                device: "the stage's device".into(),
                reason: "this optimizer has no element-wise step to run there".into(),
            })?;
        state.apply(&step, scale as f32)?;
        self.host_stale = true;
        Ok(())
    }

    /// Brings the host copy of the parameters and the optimizer state up to date with
    /// the device's (nothing to do for a stage on the host).
    ///
    /// # Errors
    /// `Device` when a copy fails.
    pub fn sync_host(&mut self) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        if !self.host_stale {
            return Ok(());
        }
        state.download(Buffer::Params, &mut self.params)?;
        self.host_traffic.step.to_host += size_of_val(self.params.as_slice());
        let mut saved = Vec::new();
        for (k, (name, buf)) in self.optimizer.state().iter().enumerate() {
            let mut v = vec![0f32; buf.len()];
            state.download(Buffer::State(k), &mut v)?;
            self.host_traffic.step.to_host += size_of_val(v.as_slice());
            saved.push((*name, v));
        }
        let views: Vec<(&str, &[f32])> = saved.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        self.optimizer
            .load_state(self.optimizer.step_count(), &views)?;
        self.host_stale = false;
        Ok(())
    }

    /// Copies the host's parameters (and, with `state`, the optimizer state) to the
    /// device, after the host's were replaced (a checkpoint restored).
    pub(super) fn push_to_device(&mut self, with_state: bool) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        state.upload(Buffer::Params, &self.params)?;
        if with_state {
            for (k, (_, buf)) in self.optimizer.state().iter().enumerate() {
                state.upload(Buffer::State(k), buf)?;
            }
            self.host_stale = false;
        }
        Ok(())
    }

    /// The device's gradients copied into the host buffer (for a reduction over the host).
    pub(super) fn grads_to_host(&mut self) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        self.host_traffic.step.to_host += size_of_val(self.grads.as_slice());
        state.download(Buffer::Grads, &mut self.grads)
    }

    /// The host buffer's (reduced) gradients copied back to the device.
    pub(super) fn grads_to_device(&mut self) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        self.host_traffic.step.to_device += size_of_val(self.grads.as_slice());
        state.upload(Buffer::Grads, &self.grads)
    }
}
