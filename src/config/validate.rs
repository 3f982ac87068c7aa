//! The rules a training configuration must follow, checked once it is read: each
//! refusal names the file, the field and the rule.

use std::path::Path;

use super::{ScheduleKind, TrainConfig};
use crate::graph::Partition;
use crate::{Error, Result};

impl TrainConfig {
    pub(crate) fn validate(&self, path: &Path) -> Result<()> {
        self.validate_model_source(path)?;
        self.validate_data_sources(path)?;
        self.validate_sizes(path)?;
        self.validate_pipeline(path)?;
        self.validate_limits(path)?;
        self.validate_run_state(path)?;
        self.optimizer.validate(path)?;
        crate::optim::validate_groups(&self.optimizer_attributes, &self.optimizer, path)?;
        self.lr_schedule.validate(path)?;
        Ok(())
    }

    /// Either a model file or a built-in model, and the built-in model's sizes.
    fn validate_model_source(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| config_error(path, field, rule);
        match (&self.model, self.model_path.as_os_str().is_empty()) {
            (Some(_), false) => {
                return Err(bad(
                    "model",
                    "give either `model_path` (a file) or `[model]` (a built-in model), not both"
                        .into(),
                ))
            }
            (None, true) => {
                return Err(bad(
                    "model_path",
                    "missing: give the model file, or a built-in `[model]` (kind = \"gpt2\", \"squeezenet\" or \"mlp\")"
                        .into(),
                ))
            }
            (Some(spec), true) => spec.validate(path)?,
            (None, false) => {}
        }
        Ok(())
    }

    /// Each data set from one source: shards, an .npz file, or a synthetic set.
    fn validate_data_sources(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| config_error(path, field, rule);
        for (field, d) in [
            ("data", Some(&self.data)),
            ("eval_data", self.eval_data.as_ref()),
        ] {
            let Some(d) = d else { continue };
            if d.shards.is_some() {
                let given = [
                    ("path", !d.path.as_os_str().is_empty()),
                    ("synth", d.synth.is_some()),
                    ("batch_order", d.batch_order.is_some()),
                    ("layout", !d.layout.is_unset()),
                ];
                if let Some((name, _)) = given.iter().find(|(_, g)| *g) {
                    return Err(bad(
                        &format!("{field}.{name}"),
                        "does not apply to `shards` (their `input_name_map` feeds the model)"
                            .into(),
                    ));
                }
                continue;
            }
            match (&d.synth, d.path.as_os_str().is_empty()) {
                (Some(_), false) => return Err(bad(
                    field,
                    "give either `path` (an .npz file) or `synth` (a synthetic data set), not both"
                        .into(),
                )),
                (None, true) => {
                    return Err(bad(
                        &format!("{field}.path"),
                        "missing: give an .npz file, or `synth = { kind = ... }`".into(),
                    ))
                }
                (Some(spec), true) => spec.validate(path)?,
                (None, false) => {}
            }
        }
        Ok(())
    }

    /// Sizes and parallel degrees: positive, consistent with each other and the world.
    fn validate_sizes(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| config_error(path, field, rule);
        let positive = [
            ("batch_size", self.batch_size),
            ("num_train_steps", self.num_train_steps),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("display_loss_steps", self.display_loss_steps),
            ("data_parallel_size", self.data_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
            ("horizontal_parallel_size", self.horizontal_parallel_size),
            ("pipeline.virtual_stages", self.pipeline.virtual_stages),
            ("eval_micro_batches", self.eval_micro_batches),
            ("evaluation_period", self.evaluation_period.unwrap_or(1)),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(bad(field, "must be at least 1".into()));
            }
        }
        if self.horizontal_parallel_size > 1 {
            if self.enable_adasum {
                return Err(bad(
                    "enable_adasum",
                    "Adasum combines whole per-tensor gradients; it cannot be used with \
                     horizontal_parallel_size > 1 (split tensors)"
                        .into(),
                ));
            }
            if matches!(self.optimizer, crate::optim::OptimizerConfig::Lamb { .. }) {
                return Err(bad(
                    "optimizer.kind",
                    "LAMB's trust ratio needs whole-tensor norms; it cannot be used with \
                     horizontal_parallel_size > 1 (split tensors)"
                        .into(),
                ));
            }
        }
        let product =
            self.data_parallel_size * self.horizontal_parallel_size * self.pipeline_parallel_size;
        if let Some(world) = self.world_size.filter(|&w| w != product) {
            return Err(bad(
                "world_size",
                format!(
                    "must equal data_parallel_size x horizontal_parallel_size x pipeline_parallel_size = {product}, got {world}"
                ),
            ));
        }
        if self.num_train_steps % self.gradient_accumulation_steps != 0 {
            return Err(bad(
                "num_train_steps",
                format!(
                    "must be divisible by gradient_accumulation_steps ({}), got {}",
                    self.gradient_accumulation_steps, self.num_train_steps
                ),
            ));
        }
        Ok(())
    }

    /// The pipeline's schedule, its micro-batches and virtual stages, its partition.
    fn validate_pipeline(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| config_error(path, field, rule);
        let (p, m) = (
            self.pipeline_parallel_size,
            self.gradient_accumulation_steps,
        );
        let needs_full_pipe = matches!(
            self.pipeline.schedule,
            ScheduleKind::OneFOneB | ScheduleKind::ZbH1
        );
        if needs_full_pipe && m < p {
            return Err(bad(
                "gradient_accumulation_steps",
                format!(
                    "{:?} needs at least as many micro-batches as pipeline stages ({p}), got {m}",
                    self.pipeline.schedule
                ),
            ));
        }
        if self.pipeline.virtual_stages > 1
            && self.pipeline.schedule != ScheduleKind::Interleaved1f1b
        {
            return Err(bad(
                "pipeline.virtual_stages",
                "only the interleaved_1f1b schedule has virtual stages".into(),
            ));
        }
        if let Err(e) = self.schedule().generate() {
            return Err(bad("pipeline.schedule", e.to_string()));
        }
        if let Some(Partition::CutAt(cuts)) = &self.pipeline.partition {
            if cuts.len() + 1 != self.stages() {
                return Err(bad(
                    "pipeline.partition.cut_at",
                    format!(
                        "{} cuts make {} stages; the pipeline has {}",
                        cuts.len(),
                        cuts.len() + 1,
                        self.stages()
                    ),
                ));
            }
        }
        if let Some(Partition::Balanced { stages, .. } | Partition::Weighted { stages, .. }) =
            &self.pipeline.partition
        {
            if *stages != self.stages() {
                return Err(bad(
                    "pipeline.partition.balanced.stages",
                    format!(
                        "must equal {} = {}, got {stages}",
                        self.stages_rule(),
                        self.stages()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// ZeRO stage 2 reduce-scatters gradient buckets on the host as the backward makes
    /// them, one stage replica per tensor.
    fn validate_zero_2(&self, path: &Path) -> Result<()> {
        if self.deepspeed_zero_stage != 2 {
            return Ok(());
        }
        let bad = |field: &str, rule: &str| {
            config_error(
                path,
                field,
                format!("with deepspeed_zero_stage = 2, {rule}"),
            )
        };
        if self.gradient_bucket_mb <= 0.0 {
            return Err(bad(
                "gradient_bucket_mb",
                "must be more than 0: the sharded gradients are reduced in buckets as the \
                 backward makes them, and one bucket of them all would hold them all",
            ));
        }
        if self.horizontal_parallel_size > 1 {
            return Err(bad(
                "horizontal_parallel_size",
                "must be 1: tensor shards keep whole gradients (use deepspeed_zero_stage = 1)",
            ));
        }
        if self.runtime.device != crate::compute::Device::Cpu {
            return Err(bad(
                "runtime.device",
                "must be \"cpu\": on a GPU the gradients stay whole in device memory (use \
                 deepspeed_zero_stage = 1)",
            ));
        }
        Ok(())
    }

    /// Watchdog, bucket size, Adasum's replica count, thread count.
    fn validate_limits(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| config_error(path, field, rule);
        if !(self.watchdog_seconds.is_finite() && self.watchdog_seconds > 0.0) {
            return Err(bad(
                "watchdog_seconds",
                format!("must be a positive number, got {}", self.watchdog_seconds),
            ));
        }
        if !(self.gradient_bucket_mb.is_finite() && self.gradient_bucket_mb >= 0.0) {
            return Err(bad(
                "gradient_bucket_mb",
                format!(
                    "must be a number of MiB, 0 or more, got {}",
                    self.gradient_bucket_mb
                ),
            ));
        }
        if self.deepspeed_zero_stage > 2 {
            return Err(bad(
                "deepspeed_zero_stage",
                format!(
                    "0 (no sharding), 1 (optimizer state sharded across the data-parallel \
                     replicas) or 2 (and the gradients); stage 3 (sharded parameters) is not \
                     built, got {}",
                    self.deepspeed_zero_stage
                ),
            ));
        }
        self.validate_zero_2(path)?;
        if self.deepspeed_zero_stage >= 1 && self.enable_adasum {
            return Err(bad(
                "deepspeed_zero_stage",
                "Adasum combines every replica's whole gradients, a sharded optimizer state \
                 reduce-scatters them; use one or the other"
                    .into(),
            ));
        }
        if self.enable_adasum && !self.data_parallel_size.is_power_of_two() {
            return Err(bad(
                "enable_adasum",
                format!(
                    "Adasum combines replicas in a binary tree, as ONNX Runtime's and Horovod's: data_parallel_size must be a power of two, got {}",
                    self.data_parallel_size
                ),
            ));
        }
        if self.runtime.intra_op_threads == Some(0) {
            return Err(bad("runtime.intra_op_threads", "must be at least 1".into()));
        }
        Ok(())
    }
}

impl TrainConfig {
    /// This run at `data_parallel` replicas with the same global batch: each replica's
    /// gradient accumulation (and `num_train_steps`, which counts a replica's passes)
    /// grows as the replicas fall, so the optimizer steps and the samples of each stay
    /// those of the run as configured. An elastic job that lost nodes goes on so.
    ///
    /// # Errors
    /// `Config` on `data_parallel_size` when the step's micro-batches
    /// (`data_parallel_size x gradient_accumulation_steps`) cannot be shared evenly, or
    /// any rule the changed run breaks.
    pub fn at_data_parallel(&self, data_parallel: usize, path: &Path) -> Result<TrainConfig> {
        let micro_batches = self.data_parallel_size * self.gradient_accumulation_steps;
        if data_parallel == 0 || micro_batches % data_parallel != 0 {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: "data_parallel_size".into(),
                rule: format!(
                    "a step's {micro_batches} micro-batches (data_parallel_size x gradient_accumulation_steps) cannot be shared by {data_parallel} replicas"
                ),
            });
        }
        let mut c = self.clone();
        c.data_parallel_size = data_parallel;
        c.gradient_accumulation_steps = micro_batches / data_parallel;
        c.num_train_steps = self.optimizer_steps() * c.gradient_accumulation_steps;
        c.eval_micro_batches = (self.eval_micro_batches * self.data_parallel_size)
            .div_ceil(data_parallel)
            .max(1);
        if let Some(w) = c.world_size.as_mut() {
            *w = *w / self.data_parallel_size * data_parallel;
        }
        c.validate(path)?;
        Ok(c)
    }
}

/// A configuration error in `path`: `field` breaks `rule`.
fn config_error(path: &Path, field: &str, rule: String) -> Error {
    Error::Config {
        path: path.to_path_buf(),
        field: field.into(),
        rule,
    }
}
