//! What an [`OrtStage`] hands out of its values: the trained parameters (for export and
//! the end of a run) and copies of named parameters and gradients for TensorBoard's
//! histograms.

use super::stage::OrtStage;
use crate::optim::ParamLayout;
use crate::tensor::Tensor;
use crate::Result;

impl OrtStage {
    /// The stage's parameters by name, then its running statistics (after training, for
    /// export); a stage keeping its state on a device gives the device's values.
    ///
    /// # Errors
    /// `Device` when the parameters cannot be copied from the stage's device.
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        match (&self.device_state, self.host_stale) {
            (Some(state), true) => {
                let mut v = vec![0f32; self.params.len()];
                state.download(crate::compute::Buffer::Params, &mut v)?;
                Ok(self.parameters_of(&v))
            }
            _ => Ok(self.host_parameters()),
        }
    }

    /// [`OrtStage::parameters`], the stage's sessions, gradients and optimizer state
    /// freed before the copies are made, so that they never sit beside them (the end
    /// of a run).
    ///
    /// # Errors
    /// As [`OrtStage::parameters`].
    pub fn into_parameters(self) -> Result<Vec<(String, Tensor)>> {
        if self.device_state.is_some() && self.host_stale {
            return self.parameters();
        }
        let (layout, params, stats) = {
            let stage = self;
            let stats = stage.buffer_values();
            (stage.layout, stage.params, stats)
        };
        let mut trained = tensors_of(&layout, &params);
        drop(params);
        trained.extend(stats);
        Ok(trained)
    }

    /// [`OrtStage::parameters`] from the host copy (the values themselves for a stage on
    /// the host, as the seeds' modules are).
    pub fn host_parameters(&self) -> Vec<(String, Tensor)> {
        self.parameters_of(&self.params)
    }

    fn parameters_of(&self, params: &[f32]) -> Vec<(String, Tensor)> {
        let mut trained = tensors_of(&self.layout, params);
        trained.extend(self.buffer_values());
        trained
    }

    /// Sends copies of the named tensors of `buf` (parameters or gradients) to the tap.
    pub(super) fn tap(&self, kind: &str, step: u64, buf: &[f32]) {
        self.tap_part(kind, step, buf, 0..self.layout.count());
    }

    /// [`OrtStage::tap`] of the named tensors among `tensors` (layout indices) only.
    pub(super) fn tap_part(
        &self,
        kind: &str,
        step: u64,
        buf: &[f32],
        tensors: std::ops::Range<usize>,
    ) {
        let Some(tap) = &self.settings.histograms else {
            return;
        };
        let shard = self.settings.shard.as_ref().map_or(0, |l| l.0.rank());
        for name in &tap.names {
            if let Some(i) = self.layout.index_of(name).filter(|i| tensors.contains(i)) {
                // The receiver only goes away when the run ends.
                let _ = tap.tx.send(super::Tapped {
                    tag: format!("{kind}/{name}"),
                    step,
                    shard,
                    values: self.layout.slice(buf, i).to_vec(),
                });
            }
        }
    }
}

/// `params` (laid out as `layout`) as one tensor per parameter, by name.
fn tensors_of(layout: &ParamLayout, params: &[f32]) -> Vec<(String, Tensor)> {
    let tensor = |i: usize| Tensor {
        shape: layout.shapes()[i].clone(),
        data: crate::tensor::TensorData::F32(layout.slice(params, i).to_vec()),
    };
    (0..layout.count())
        .map(|i| (layout.names()[i].clone(), tensor(i)))
        .collect()
}
