//! [`GraphSession`] running with some inputs and outputs in device memory (a stage that
//! keeps its state on its device: `compute/resident.rs`).

use std::borrow::Cow;

use ort::session::SessionInputValue;
use ort::value::DynValue;

use super::super::direct::{over, DirectOutputs, Target};
use super::super::resident::DeviceSpan;
use super::{produced, to_host, view, GraphSession};
use crate::tensor::{Tensor, TensorView};
use crate::{Error, Result};

impl GraphSession {
    /// Runs the graph with some inputs read in place from device memory (`device`: name,
    /// values, shape) and the float32 outputs named by `targets` written in place into
    /// their ranges of the device buffer `out`; the other outputs come back to the host,
    /// by name, in the graph's order. The run returns once the device has finished it
    /// (ONNX Runtime synchronizes its stream at a run's end). A session recorded as a
    /// CUDA graph records or replays it (`replay.rs`).
    ///
    /// # Errors
    /// As [`GraphSession::run`]; `BadTensor` when a target does not fit `out` or ONNX
    /// Runtime did not write it where it was told.
    pub fn run_device(
        &mut self,
        host: &[(&str, TensorView<'_>)],
        device: &[(&str, DeviceSpan, &[usize])],
        out: DeviceSpan,
        targets: &[Target<'_>],
    ) -> Result<Vec<(String, Tensor)>> {
        if self.replay.is_some() {
            return self.run_replayed(host, device, out, targets);
        }
        let info = out
            .memory_info()
            .map_err(Error::ort(format!("running {}", self.label)))?;
        if !self
            .direct
            .as_ref()
            .is_some_and(|d| d.fits_at(out.addr, out.len, targets))
        {
            // SAFETY: `out` is a device buffer its owner keeps while it runs sessions
            // with it (`DeviceSpan`'s contract); it is checked again before every run.
            self.direct = Some(unsafe {
                DirectOutputs::at(
                    out.addr,
                    out.len,
                    &info,
                    targets,
                    &self.outputs,
                    &self.label,
                )?
            });
        }
        let GraphSession {
            session,
            label,
            outputs: names,
            direct,
            ..
        } = self;
        let ctx = || format!("running {label}");
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(host.len() + device.len());
        for (name, t) in host {
            inputs.push((Cow::Borrowed(*name), view(t).map_err(Error::ort(ctx()))?));
        }
        for (name, span, shape) in device {
            let data = span.addr as *mut f32;
            let value = over(&info, data, shape, label)?;
            inputs.push((Cow::Borrowed(*name), value.into()));
        }
        let options = &direct.as_ref().expect("made above").options;
        let started = std::time::Instant::now();
        let outputs = session
            .run_with_options(inputs, options)
            .map_err(Error::ort(ctx()))?;
        let run_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(target: "pipetrain::device", session = %label, run_ms, "run, state on the device");
        let mut result = Vec::with_capacity(names.len());
        for (k, name) in names.iter().enumerate() {
            let value = produced(&outputs, name, label)?;
            match targets.iter().find(|t| t.output == k) {
                Some(t) => on_device(value, name, t, &out, label)?,
                None => result.push((name.clone(), to_host(value, name)?)),
            }
        }
        Ok(result)
    }
}

/// Checks that ONNX Runtime wrote a directed output where it was told, in `out`.
pub(super) fn on_device(
    value: &DynValue,
    name: &str,
    t: &Target<'_>,
    out: &DeviceSpan,
    label: &str,
) -> Result<()> {
    let tensor = value
        .view()
        .downcast::<ort::value::DynTensorValueType>()
        .map_err(Error::ort(format!("running {label}")))?;
    let want = out.addr + t.offset * size_of::<f32>();
    if tensor.data_ptr() as usize != want {
        return Err(Error::BadTensor {
            name: name.into(),
            reason: format!(
                "{label} wrote this gradient elsewhere than the device buffer it was given"
            ),
        });
    }
    Ok(())
}
