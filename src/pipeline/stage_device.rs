//! [`OrtStage`] keeping its state on its device (`compute::DeviceState`): the sessions
//! read the parameters and write the gradients in device memory, a later micro-batch's
//! gradients are added there, and the optimizer's element-wise step runs there. The host
//! copy (`params`, the optimizer's own state) is brought up to date only when something
//! on the host reads it: a checkpoint, the trained parameters, a data-parallel reduction
//! over the host.

use std::sync::Arc;

use pipetrain_actors::GradStats;

use super::buckets::Chain;
use super::settings::StageSettings;
use super::stage::{OrtStage, Payload};
use super::stage_run::{fed, grad_targets};
use crate::compute::{Buffer, Device, GraphSession, SessionOptions};
use crate::graph::LOSS_GRAD;
use crate::optim::OptimizerConfig;
use crate::tensor::TensorView;
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
    opts.device != Device::Cpu
        && opts.state_on_device
        && settings.shard.is_none()
        && settings.adasum.is_none()
        && settings.zero.is_none()
        && settings.histograms.is_none()
        && !matches!(settings.optimizer, OptimizerConfig::Lamb { .. })
}

/// The device state of a stage on `device` holding `params` and `optimizer`'s state
/// buffers, uploaded (`None` on the CPU).
pub(super) fn open_state(
    device: Device,
    params: &[f32],
    optimizer: &dyn crate::optim::Optimizer,
) -> Result<Option<Box<dyn crate::compute::DeviceState>>> {
    let state = optimizer.state();
    let bufs: Vec<&[f32]> = state.iter().map(|(_, b)| *b).collect();
    crate::compute::open_device_state(device, params, &bufs)
}

/// What a stage on its device handed between host and device in a step, in bytes: its
/// host feeds (data, messages, the backward seed) and host outputs (loss, messages), the
/// gradient statistics, and any state copied for a checkpoint or a reduction over the
/// host. Copies ONNX Runtime makes inside a run (for a node on the CPU, say) are not
/// seen here.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HostTraffic {
    pub to_device: usize,
    pub to_host: usize,
}

impl HostTraffic {
    /// Logs the step's traffic (target `pipetrain::device`, debug) and starts the next.
    pub(super) fn end_step(&mut self, step: u64) {
        let HostTraffic { to_device, to_host } = std::mem::take(self);
        tracing::debug!(target: "pipetrain::device", step, to_device, to_host, "host traffic of the step (bytes)");
    }
}

impl OrtStage {
    /// [`OrtStage::run`] with the parameters and gradients in device memory: the
    /// parameters fed in place, a step's first gradients written by ONNX Runtime into
    /// the accumulators, later ones into the scratch buffer and added.
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
            host_traffic,
            ..
        } = self;
        let state = device_state.as_mut().expect("a stage on its device");
        let params = state.params();
        let mut host: Vec<(&str, TensorView<'_>)> = Vec::new();
        let mut device = Vec::new();
        for n in &names {
            if let Some(seed) = seed.as_ref().filter(|_| n == LOSS_GRAD) {
                host.push((n.as_str(), seed.view()));
            } else if let Some(i) = layout.index_of(n) {
                device.push((
                    n.as_str(),
                    params.part(layout.range(i)),
                    layout.shapes()[i].as_slice(),
                ));
            } else {
                host.push((n.as_str(), fed(n, sources, buffers)?.view()));
            }
        }
        let (targets, slots) = grad_targets(session.output_names(), grad_slot, layout);
        let first = slots.iter().all(|&i| !written[i]);
        let out = match first {
            true => state.grads(),
            false => state.scratch()?,
        };
        let rest = session.run_device(&host, &device, out, &targets)?;
        host_traffic.to_device += host.iter().map(|(_, v)| v.bytes()).sum::<usize>();
        host_traffic.to_host += rest
            .iter()
            .map(|(_, t)| t.len() * t.dtype().size())
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
        tracing::debug!(target: "pipetrain::device", total_ms, "stage run, state on the device");
        Ok(rest.into_iter().map(|(n, t)| (n, Arc::new(t))).collect())
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
        self.host_traffic.to_host += size_of::<f64>();
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
        self.host_traffic.to_host += size_of_val(self.params.as_slice());
        let mut saved = Vec::new();
        for (k, (name, buf)) in self.optimizer.state().iter().enumerate() {
            let mut v = vec![0f32; buf.len()];
            state.download(Buffer::State(k), &mut v)?;
            self.host_traffic.to_host += size_of_val(v.as_slice());
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
        self.host_traffic.to_host += size_of_val(self.grads.as_slice());
        state.download(Buffer::Grads, &mut self.grads)
    }

    /// The host buffer's (reduced) gradients copied back to the device.
    pub(super) fn grads_to_device(&mut self) -> Result<()> {
        let Some(state) = self.device_state.as_mut() else {
            return Ok(());
        };
        self.host_traffic.to_device += size_of_val(self.grads.as_slice());
        state.upload(Buffer::Grads, &self.grads)
    }
}
