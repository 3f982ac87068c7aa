//! Checkpoints, clipping, loss scaling and the test aids of a run's configuration.

use std::path::Path;

use pipetrain_actors::DynamicScaling;
use serde::{Deserialize, Serialize};

use super::TrainConfig;
use crate::{Error, Result};

/// The dynamic loss scaler (ONNX Runtime's `DynamicLossScaler` defaults).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicScalerConfig {
    /// The first scale; default 2^16.
    pub initial: f64,
    /// Finite steps before the scale doubles; default 2000.
    pub window: u64,
    /// Smallest scale; default 1.
    pub min: f64,
    /// Largest scale; default 2^24.
    pub max: f64,
}

impl Default for DynamicScalerConfig {
    fn default() -> Self {
        let d = DynamicScaling::default();
        DynamicScalerConfig {
            initial: d.initial,
            window: d.window,
            min: d.min,
            max: d.max,
        }
    }
}

/// Test aids. Not for training runs: they inject faults on purpose.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugConfig {
    /// Put +inf into a stage's gradient at these optimizer steps (counting from 1).
    #[serde(default)]
    pub inject_grad_overflow: Vec<FaultAt>,
    /// Write each checkpoint file in 8 pieces with this pause (ms) between them, so
    /// crash tests can land inside a write.
    #[serde(default)]
    pub checkpoint_write_delay_ms: u64,
    /// Hold a stage's first forward of an optimizer step for `seconds`, its process
    /// alive and connected: a live but silent member, for watchdog tests.
    #[serde(default)]
    pub stall: Option<Stall>,
    /// On a GPU with one data-parallel replica, sum each stage's gradients every step
    /// through a one-rank NCCL communicator, the path replicas on several GPUs are to
    /// take (`compute/cuda_nccl.rs`): the sum is the gradients themselves.
    #[serde(default)]
    pub nccl_one_rank: bool,
    /// On the CPU, take the device path all the same, over host memory: each stage's
    /// state in a device state (`compute/host_state.rs`), replicas summing in a group,
    /// stage messages kept where ONNX Runtime made them. For testing that path where no
    /// GPU is; slower than the host path.
    #[serde(default)]
    pub device_path_on_host: bool,
}

/// A stage held still (see [`DebugConfig::stall`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stall {
    /// Optimizer step, counting from 1.
    pub step: u64,
    /// Pipeline stage.
    pub stage: usize,
    /// Data-parallel replica (all of its tensor shards).
    #[serde(default)]
    pub replica: usize,
    /// How long it is held.
    pub seconds: u64,
}

/// Where a fault is injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultAt {
    /// Optimizer step, counting from 1.
    pub step: u64,
    /// Pipeline stage.
    pub stage: usize,
    /// Data-parallel replica (all of its tensor shards).
    #[serde(default)]
    pub replica: usize,
}

/// Makes the error for a field of the configuration and the rule it breaks.
type Bad<'a> = dyn Fn(&str, String) -> Error + 'a;

impl TrainConfig {
    /// Checkpoints, clipping, loss scaling, TensorBoard's names and the test aids.
    pub(super) fn validate_run_state(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            rule,
        };
        self.validate_checkpoints(&bad)?;
        self.validate_scaling(&bad)?;
        self.validate_logged(&bad)?;
        self.validate_faults(&bad)?;
        self.validate_cuda_graph(&bad)?;
        self.validate_devices(&bad)
    }

    /// `runtime.cuda_graph`: a GPU (or the device path over host memory, which tests its
    /// fixed homes), the state on the device, one stage and one replica.
    fn validate_cuda_graph(&self, bad: &Bad) -> Result<()> {
        if !self.runtime.cuda_graph {
            return Ok(());
        }
        let gpu = self.runtime.device != crate::compute::Device::Cpu;
        let rule = if !gpu && !self.debug.device_path_on_host {
            Some("needs a GPU (`runtime.device = \"cuda\"`)".to_string())
        } else if !self.runtime.state_on_device {
            Some("needs `runtime.state_on_device` (the parameters and gradients at fixed device addresses)".into())
        } else if self.stages() * self.data_parallel_size * self.horizontal_parallel_size != 1 {
            Some(format!(
                "is for one stage and one replica, not {} stages x {} replicas x {} tensor \
                 shards: ONNX Runtime records a graph while no other stream of the process \
                 works, and stages hand each other new values every run",
                self.stages(),
                self.data_parallel_size,
                self.horizontal_parallel_size
            ))
        } else {
            None
        };
        match rule {
            Some(rule) => Err(bad("runtime.cuda_graph", rule)),
            None => Ok(()),
        }
    }

    /// `runtime.devices`: GPUs, with `runtime.device` a GPU too.
    fn validate_devices(&self, bad: &Bad) -> Result<()> {
        let devices = &self.runtime.devices;
        if devices.is_empty() {
            return Ok(());
        }
        if self.runtime.device == crate::compute::Device::Cpu {
            let rule = "places ranks on GPUs: set `runtime.device = \"cuda\"` too".into();
            return Err(bad("runtime.devices", rule));
        }
        match devices
            .iter()
            .position(|d| *d == crate::compute::Device::Cpu)
        {
            Some(i) => Err(bad(
                &format!("runtime.devices[{i}]"),
                "must be a GPU (`\"cuda:N\"`), not the CPU".into(),
            )),
            None => Ok(()),
        }
    }

    /// The checkpoints' period, count and folder.
    fn validate_checkpoints(&self, bad: &Bad) -> Result<()> {
        if self.checkpoint_period == Some(0) {
            return Err(bad("checkpoint_period", "must be at least 1".into()));
        }
        if self.max_num_checkpoints == Some(0) {
            return Err(bad("max_num_checkpoints", "must be at least 1".into()));
        }
        if self.checkpoint_period.is_some() && self.checkpoints_dir.is_none() {
            return Err(bad(
                "checkpoint_period",
                "needs `checkpoints_dir`, the folder checkpoints go to".into(),
            ));
        }
        Ok(())
    }

    /// Clipping, mixed precision and loss scaling.
    fn validate_scaling(&self, bad: &Bad) -> Result<()> {
        if let Some(n) = self.max_grad_norm.filter(|n| !(n.is_finite() && *n > 0.0)) {
            return Err(bad(
                "max_grad_norm",
                format!("must be a positive number, got {n}"),
            ));
        }
        if self.use_bfloat16 && !self.use_mixed_precision {
            return Err(bad(
                "use_bfloat16",
                "chooses mixed precision's half type: needs `use_mixed_precision = true`".into(),
            ));
        }
        if self.use_bfloat16 && self.runtime.device == crate::compute::Device::Cpu {
            return Err(bad(
                "use_bfloat16",
                "ONNX Runtime's CPU provider has no bfloat16 matrix product: set \
                 `[runtime] device = \"cuda\"`, or use float16 (`use_bfloat16 = false`)"
                    .into(),
            ));
        }
        if let Some(s) = self.loss_scale.filter(|s| !(s.is_finite() && *s >= 0.0)) {
            return Err(bad(
                "loss_scale",
                format!("must be a positive factor, or 0 for dynamic scaling; got {s}"),
            ));
        }
        let d = self.loss_scaler;
        let scaler_ok = d.min.is_finite()
            && d.min > 0.0
            && d.max.is_finite()
            && d.min <= d.initial
            && d.initial <= d.max
            && d.window >= 1;
        if !scaler_ok {
            return Err(bad(
                "loss_scaler",
                format!("needs 0 < min <= initial <= max (finite) and window >= 1, got {d:?}"),
            ));
        }
        Ok(())
    }

    /// The scalars and histograms asked of TensorBoard, and its folder.
    fn validate_logged(&self, bad: &Bad) -> Result<()> {
        for (i, name) in self.scalar_names.iter().flatten().enumerate() {
            if !super::SCALAR_NAMES.contains(&name.as_str()) {
                return Err(bad(
                    &format!("scalar_names[{i}]"),
                    format!(
                        "unknown scalar `{name}`; known: {}",
                        super::SCALAR_NAMES.join(", ")
                    ),
                ));
            }
        }
        if self.log_dir.is_none()
            && (self.scalar_names.is_some() || !self.histogram_names.is_empty())
        {
            return Err(bad(
                "log_dir",
                "scalar_names and histogram_names need `log_dir`, the folder of the TensorBoard files".into(),
            ));
        }
        Ok(())
    }

    /// The test aids' faults fall on a step and stage of the run.
    fn validate_faults(&self, bad: &Bad) -> Result<()> {
        let mut faults: Vec<(String, FaultAt)> = (self.debug.inject_grad_overflow.iter())
            .enumerate()
            .map(|(i, f)| (format!("debug.inject_grad_overflow[{i}]"), *f))
            .collect();
        if let Some(s) = self.debug.stall {
            let at = FaultAt {
                step: s.step,
                stage: s.stage,
                replica: s.replica,
            };
            faults.push(("debug.stall".into(), at));
        }
        for (field, f) in faults {
            if f.step == 0 || f.step as usize > self.optimizer_steps() {
                return Err(bad(
                    &format!("{field}.step"),
                    format!(
                        "must be an optimizer step in 1..={}, got {}",
                        self.optimizer_steps(),
                        f.step
                    ),
                ));
            }
            if f.stage >= self.stages() || f.replica >= self.data_parallel_size {
                return Err(bad(
                    &field,
                    format!(
                        "stage {} replica {} is not in a run of {} stages x {} replicas",
                        f.stage,
                        f.replica,
                        self.stages(),
                        self.data_parallel_size
                    ),
                ));
            }
        }
        if self.debug.nccl_one_rank {
            let rule = match (self.runtime.device, self.data_parallel_size) {
                (crate::compute::Device::Cpu, _) => {
                    Some("needs `runtime.device = \"cuda\"`".into())
                }
                (_, 1) if !self.runtime.state_on_device => {
                    Some("needs `runtime.state_on_device` (the gradients on the device)".into())
                }
                (_, 1) => None,
                (_, d) => Some(format!(
                    "is for one data-parallel replica (a one-rank communicator), not {d}"
                )),
            };
            if let Some(rule) = rule {
                return Err(bad("debug.nccl_one_rank", rule));
            }
        }
        if self.debug.device_path_on_host {
            let rule = match self.runtime.device {
                crate::compute::Device::Cuda(_) => Some("is for the CPU (`runtime.device = \"cpu\"`): a GPU takes the device path itself"),
                crate::compute::Device::Cpu if !self.runtime.state_on_device => {
                    Some("needs `runtime.state_on_device` (the state in the device state it tests)")
                }
                crate::compute::Device::Cpu => None,
            };
            if let Some(rule) = rule {
                return Err(bad("debug.device_path_on_host", rule.into()));
            }
        }
        Ok(())
    }
}
