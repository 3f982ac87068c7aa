//! Optimizers over flat parameter buffers, and learning-rate schedules.
//!
//! # Layout
//! - [`ParamLayout`] (`layout.rs`): where each parameter tensor of a stage sits in the
//!   stage's one flat `f32` buffer (parameters, gradients and optimizer state all share it).
//! - [`OptimizerConfig`] (`config.rs`): which optimizer, its hyper-parameters with
//!   `torch.optim`'s defaults, and their validation.
//! - [`Optimizer`] and [`build`] (here): one step over the flat buffers.
//!   - `sgd.rs`: `torch.optim.SGD` (momentum, dampening, Nesterov, L2 weight decay).
//!   - `adam.rs`: `torch.optim.Adam` and `torch.optim.AdamW` (one kernel, two decays).
//!   - `lamb.rs`: LAMB as ONNX Runtime's `LambOptimizer` (per-tensor trust ratio).
//! - [`ParamGroup`] (`groups.rs`): `[[optimizer_attributes]]`, per-parameter weight decay,
//!   learning-rate scale, betas and eps for parameters matched by name; the optimizers
//!   step over stretches of equal settings.
//! - [`LrSchedule`] (`schedule.rs`): linear warmup, then constant / linear / polynomial /
//!   cosine decay, HuggingFace's `get_*_schedule_with_warmup`.
//!
//! Every optimizer allocates its state once, in [`build`], and a step is a few passes of
//! plain slice loops that the compiler vectorizes: the step runs on the hot path, hundreds
//! of times a second over ~670k parameters. Over big buffers the element-wise loops run in
//! pieces on several cores (`pieces.rs`), with the same result; on one core, the update
//! can take the gradients' statistics on its way (`counted.rs`). Scalars (bias
//! corrections, step sizes) are computed in `f64` and rounded to `f32` once per step, as
//! `torch.optim` computes them as Python floats.

use std::path::Path;

use pipetrain_actors::GradStats;

use crate::{Error, Result};

mod adam;
mod config;
mod counted;
mod elementwise;
mod groups;
mod lamb;
mod layout;
mod pieces;
mod schedule;
mod sgd;

pub use config::OptimizerConfig;
pub use elementwise::{ElementwiseStep, Rule};
pub use groups::{unmatched_patterns, validate_groups, ParamGroup};
pub use layout::ParamLayout;
pub use schedule::{LrDecay, LrSchedule};

/// One stage's optimizer: updates the flat parameter buffer from the flat gradient buffer.
///
/// The buffers are laid out by the [`ParamLayout`] given to [`build`]. The gradient is taken
/// as a value, already averaged over micro-batches and replicas (candle's
/// `Optimizer::step(&GradStore)`): the optimizer owns only its own state.
pub trait Optimizer: Send {
    /// Applies one update with learning rate `lr` and counts the step.
    ///
    /// # Errors
    /// `BadTensor` when `params` or `grads` do not hold exactly the layout's number of
    /// values; nothing is changed then.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<()>;

    /// [`step`](Optimizer::step), and the statistics of `grads` as [`GradStats::of`]
    /// takes them (the same bits). SGD and Adam take them on the update's own pass
    /// (`counted.rs`); by default they are taken first.
    ///
    /// # Errors
    /// As [`step`](Optimizer::step).
    fn step_counting(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<GradStats> {
        let stats = GradStats::of(grads);
        self.step(params, grads, lr)?;
        Ok(stats)
    }

    /// Steps taken so far (PyTorch's `state["step"]`); bias corrections use this.
    fn step_count(&self) -> u64;

    /// The state buffers by name (`torch.optim`'s names: `momentum_buffer`, `exp_avg`,
    /// `exp_avg_sq`), each laid out like the parameters, for checkpoints. Plain SGD has none.
    fn state(&self) -> Vec<(&'static str, &[f32])>;

    /// Restores what [`state`](Optimizer::state) and [`step_count`](Optimizer::step_count)
    /// returned, so that the next step continues the saved run exactly.
    ///
    /// # Errors
    /// `BadTensor` when a buffer is missing, unknown, given twice or of the wrong length;
    /// nothing is changed then.
    fn load_state(&mut self, step: u64, state: &[(&str, &[f32])]) -> Result<()>;

    /// Counts a step at learning rate `lr` and returns it as an element-wise program for
    /// a device that keeps the parameters, gradients and [`state`](Optimizer::state)
    /// itself (`elementwise.rs`); `None`, counting nothing, where the update is not
    /// element-wise (LAMB's per-tensor trust ratio).
    fn elementwise_step(&mut self, lr: f64) -> Option<ElementwiseStep> {
        let _ = lr;
        None
    }
}

/// Builds the optimizer that `cfg` describes for a stage laid out as `layout`, with its
/// state zeroed and its step count at 0.
///
/// # Errors
/// `Config` (path `<config>`) when `cfg` breaks a rule of [`OptimizerConfig::validate`].
pub fn build(cfg: &OptimizerConfig, layout: &ParamLayout) -> Result<Box<dyn Optimizer>> {
    build_grouped(cfg, &[], layout)
}

/// [`build`], each parameter matched by one of `groups` updated with its group's
/// settings (the first group that matches).
///
/// # Errors
/// `Config` (path `<config>`) when `cfg` or a group breaks a rule.
pub fn build_grouped(
    cfg: &OptimizerConfig,
    groups: &[ParamGroup],
    layout: &ParamLayout,
) -> Result<Box<dyn Optimizer>> {
    let path = Path::new("<config>");
    cfg.validate(path)?;
    validate_groups(groups, cfg, path)?;
    let len = layout.len();
    let segments = || groups::segments(cfg, groups, layout);
    Ok(match *cfg {
        OptimizerConfig::Sgd {
            momentum,
            dampening,
            nesterov,
            ..
        } => Box::new(sgd::Sgd::new(
            len,
            momentum,
            dampening,
            nesterov,
            segments(),
        )),
        OptimizerConfig::Adam { .. } => Box::new(adam::Adam::new(len, adam::Decay::L2, segments())),
        OptimizerConfig::AdamW { .. } => {
            Box::new(adam::Adam::new(len, adam::Decay::Decoupled, segments()))
        }
        OptimizerConfig::Lamb { .. } => Box::new(lamb::Lamb::new(
            layout,
            groups::tensor_hypers(cfg, groups, layout),
        )),
    })
}

/// Refuses buffers that do not match the layout, before anything is written.
fn check_lengths(len: usize, params: &[f32], grads: &[f32]) -> Result<()> {
    for (name, got) in [("parameters", params.len()), ("gradients", grads.len())] {
        if got != len {
            return Err(Error::BadTensor {
                name: format!("optimizer {name}"),
                reason: format!("holds {got} values, the parameter layout {len}"),
            });
        }
    }
    Ok(())
}

/// Copies saved state into `bufs`, after checking that every buffer is given exactly once
/// with the right length, so that a bad checkpoint leaves the optimizer untouched.
fn load_buffers(
    bufs: &mut [(&'static str, &mut Vec<f32>)],
    state: &[(&str, &[f32])],
) -> Result<()> {
    let bad = |name: &str, reason: String| Error::BadTensor {
        name: format!("optimizer state `{name}`"),
        reason,
    };
    for (i, (name, values)) in state.iter().enumerate() {
        let Some((_, buf)) = bufs.iter().find(|(n, _)| n == name) else {
            let known: Vec<&str> = bufs.iter().map(|(n, _)| *n).collect();
            return Err(bad(
                name,
                format!("unknown; this optimizer keeps {known:?}"),
            ));
        };
        if values.len() != buf.len() {
            let (got, want) = (values.len(), buf.len());
            return Err(bad(name, format!("holds {got} values, expected {want}")));
        }
        if state[..i].iter().any(|(n, _)| n == name) {
            return Err(bad(name, "given twice".into()));
        }
    }
    if let Some((name, _)) = bufs
        .iter()
        .find(|(n, _)| !state.iter().any(|(s, _)| s == n))
    {
        return Err(bad(name, "missing".into()));
    }
    for (name, values) in state {
        if let Some((_, buf)) = bufs.iter_mut().find(|(n, _)| n == name) {
            buf.copy_from_slice(values);
        }
    }
    Ok(())
}
