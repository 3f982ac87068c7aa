//! A [`DeviceState`] over host memory: the device path of a stage (its buffers in a
//! device state, sessions reading the parameters and writing the gradients there in
//! place, the update as the element-wise program, replicas summing in a group, stage
//! messages kept where ONNX Runtime made them) run on the CPU, where no GPU is
//! (`debug.device_path_on_host`). It is how that path is tested without a GPU; it is
//! slower than the host path it mirrors, and not meant for training.
//!
//! The arithmetic is the device's: the update is `ElementwiseStep::apply_on_host`, which
//! the device kernels are checked against bit for bit; the replicas' sum adds the sources
//! in their order as `sum_replicas` does; the sum of squares is the host path's.

use std::ops::Range;

use pipetrain_actors::GradStats;

use super::resident::{Buffer, DeviceSpan, DeviceState, GradBuffer};
use super::Device;
use crate::optim::ElementwiseStep;
use crate::{Error, Result};

/// A stage's parameters, gradients, scratch and optimizer state in host buffers that
/// never move (their lengths are fixed when made), so the spans handed out stay valid.
pub struct HostState {
    params: Vec<f32>,
    grads: Vec<f32>,
    scratch: Option<Vec<f32>>,
    state: Vec<Vec<f32>>,
}

impl HostState {
    /// A state holding `params`, zero gradients and the optimizer's `state` buffers.
    pub fn new(params: &[f32], state: &[&[f32]]) -> HostState {
        HostState {
            params: params.to_vec(),
            grads: vec![0.0; params.len()],
            scratch: None,
            state: state.iter().map(|b| b.to_vec()).collect(),
        }
    }

    fn buffer(&mut self, which: Buffer) -> Result<&mut Vec<f32>> {
        match which {
            Buffer::Params => Ok(&mut self.params),
            Buffer::Grads => Ok(&mut self.grads),
            Buffer::State(k) => self
                .state
                .get_mut(k)
                .ok_or_else(|| failed(format!("no optimizer state buffer {k}"))),
        }
    }
}

fn failed(reason: String) -> Error {
    Error::Device {
        device: "the host (debug.device_path_on_host)".into(),
        reason,
    }
}

fn span(buf: &[f32]) -> DeviceSpan {
    DeviceSpan {
        device: Device::Cpu,
        addr: buf.as_ptr() as usize,
        len: buf.len(),
    }
}

/// Refuses a replica's span that is not host memory of the gradients' length.
fn check_peer(span: &DeviceSpan, len: usize) -> Result<()> {
    match span.device == Device::Cpu && span.len == len {
        true => Ok(()),
        false => Err(failed(format!(
            "a replica's gradients are {} values on {}, these {len} on the host",
            span.len, span.device
        ))),
    }
}

impl GradBuffer for HostState {
    fn grads(&self) -> DeviceSpan {
        span(&self.grads)
    }

    fn sum_grads(&mut self, sources: &[DeviceSpan], range: Range<usize>) -> Result<()> {
        let n = self.grads.len();
        sources.iter().try_for_each(|s| check_peer(s, n))?;
        if range.end > n {
            return Err(failed(format!("{range:?} past {n} gradients")));
        }
        let dst = self.grads.as_mut_ptr();
        for i in range {
            // SAFETY: every source is `n` host floats its replica keeps while the round
            // lasts (`DeviceSpan`'s contract, the lengths checked above) and `i < n`. In
            // this phase of the round no replica writes this range but this one, and
            // each value is read from every source before it is written over.
            unsafe {
                let mut s = *(sources[0].addr as *const f32).add(i);
                for src in &sources[1..] {
                    s += *(src.addr as *const f32).add(i);
                }
                *dst.add(i) = s;
            }
        }
        Ok(())
    }

    fn copy_grads(&mut self, source: DeviceSpan, range: Range<usize>) -> Result<()> {
        check_peer(&source, self.grads.len())?;
        let to = self
            .grads
            .get_mut(range.clone())
            .ok_or_else(|| failed(format!("{range:?} past the gradients")))?;
        // SAFETY: the source holds `range` (checked above) and its owner does not write
        // it in this phase of the round; it is another replica's buffer, not this one.
        let from = unsafe {
            std::slice::from_raw_parts((source.addr as *const f32).add(range.start), range.len())
        };
        to.copy_from_slice(from);
        Ok(())
    }
}

impl DeviceState for HostState {
    fn params(&self) -> DeviceSpan {
        span(&self.params)
    }

    fn scratch(&mut self) -> Result<DeviceSpan> {
        let n = self.grads.len();
        Ok(span(self.scratch.get_or_insert_with(|| vec![0.0; n])))
    }

    fn take_scratch(&mut self, ranges: &[(Range<usize>, bool)]) -> Result<()> {
        let scratch = self
            .scratch
            .as_ref()
            .ok_or_else(|| failed("no scratch buffer to take from".into()))?;
        for (r, add) in ranges {
            let (to, from) = (&mut self.grads[r.clone()], &scratch[r.clone()]);
            match add {
                true => to.iter_mut().zip(from).for_each(|(a, x)| *a += x),
                false => to.copy_from_slice(from),
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self, range: Range<usize>) -> Result<()> {
        self.grads[range].fill(0.0);
        Ok(())
    }

    fn set_grad(&mut self, index: usize, value: f32) -> Result<()> {
        let n = self.grads.len();
        *self
            .grads
            .get_mut(index)
            .ok_or_else(|| failed(format!("gradient {index} of {n}")))? = value;
        Ok(())
    }

    fn grad_sum_sq(&mut self) -> Result<f64> {
        Ok(GradStats::of(&self.grads).sum_sq)
    }

    fn apply(&mut self, step: &ElementwiseStep, scale: f32) -> Result<()> {
        let (_, states, _) = super::kernels::update_kernel(step.rule);
        if self.state.len() != states {
            return Err(failed(format!(
                "{:?} keeps {states} state buffers, this state {}",
                step.rule,
                self.state.len()
            )));
        }
        step.apply_on_host(&mut self.params, &self.grads, &mut self.state, scale);
        Ok(())
    }

    fn download(&self, which: Buffer, host: &mut [f32]) -> Result<()> {
        let buf = match which {
            Buffer::Params => &self.params,
            Buffer::Grads => &self.grads,
            Buffer::State(k) => (self.state.get(k))
                .ok_or_else(|| failed(format!("no optimizer state buffer {k}")))?,
        };
        if buf.len() != host.len() {
            return Err(failed(format!("{} values into {}", buf.len(), host.len())));
        }
        host.copy_from_slice(buf);
        Ok(())
    }

    fn upload(&mut self, which: Buffer, host: &[f32]) -> Result<()> {
        let buf = self.buffer(which)?;
        if buf.len() != host.len() {
            return Err(failed(format!("{} values into {}", host.len(), buf.len())));
        }
        buf.copy_from_slice(host);
        Ok(())
    }
}
