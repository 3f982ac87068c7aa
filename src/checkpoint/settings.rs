//! Which settings a resumed run must share with the run that wrote the checkpoint, and
//! which it may change.
//!
//! Fixed: the model (its structure's fingerprint), the optimizer's kind (its state would
//! not fit), the loss, and what decides which samples a step reads (global batch, data
//! layout, batch order, and with shards split by files the number of replicas). A change
//! there is refused, naming the setting. Everything else is recorded (hyper-parameters,
//! schedule, steps, clipping, loss scaling): a change is allowed, as DeepSpeed and ONNX
//! Runtime's runner allow it, and reported.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::manifest::{Manifest, Settings};
use crate::config::TrainConfig;
use crate::data::ShardSplit;
use crate::optim::OptimizerConfig;
use crate::{Error, Result};

/// The name of an optimizer kind, as in the configuration.
fn optimizer_kind(o: &OptimizerConfig) -> &'static str {
    match o {
        OptimizerConfig::Sgd { .. } => "sgd",
        OptimizerConfig::Adam { .. } => "adam",
        OptimizerConfig::AdamW { .. } => "adamw",
        OptimizerConfig::Lamb { .. } => "lamb",
    }
}

/// The settings of `cfg` as a checkpoint records them.
pub fn settings_of(cfg: &TrainConfig, model_fingerprint: &str) -> Settings {
    let fixed = BTreeMap::from([
        ("model".to_string(), json!(model_fingerprint)),
        (
            "optimizer.kind".to_string(),
            json!(optimizer_kind(&cfg.optimizer)),
        ),
        ("loss".to_string(), to(&cfg.loss)),
        ("global_batch".to_string(), json!(cfg.global_batch())),
        ("data.layout".to_string(), to(&cfg.data.layout)),
        ("data.batch_order".to_string(), json!(cfg.data.batch_order)),
        (
            "data.shards.shuffle_seed".to_string(),
            json!(cfg.data.shards.as_ref().and_then(|s| s.shuffle_seed)),
        ),
        ("data.shards.split".to_string(), split_of(cfg)),
    ]);
    let recorded = BTreeMap::from([
        ("optimizer".to_string(), to(&cfg.optimizer)),
        ("lr_schedule".to_string(), to(&cfg.lr_schedule)),
        // The run's length in optimizer steps: `num_train_steps` counts a replica's
        // passes, which a layout change with the same global batch (an elastic
        // shrink) changes while the run stays the same.
        ("optimizer_steps".to_string(), json!(cfg.optimizer_steps())),
        ("max_grad_norm".to_string(), json!(cfg.max_grad_norm)),
        ("loss_scale".to_string(), json!(cfg.loss_scale())),
        ("loss_scaler".to_string(), to(&cfg.loss_scaler)),
        (
            "data.path".to_string(),
            json!(cfg.data.path.file_name().map(|n| n.to_string_lossy())),
        ),
        ("data.synth".to_string(), to(&cfg.data.synth)),
        (
            "data.shards".to_string(),
            json!(cfg
                .data
                .shards
                .as_ref()
                .map(|s| s.train_data_dir.file_name().map(|n| n.to_string_lossy()))),
        ),
    ]);
    Settings::new(fixed, recorded)
}

/// How the replicas share shard data: with `split = "files"` the samples of a step
/// depend on the number of replicas, which then must not change either.
fn split_of(cfg: &TrainConfig) -> Value {
    match cfg.data.shards.as_ref().map(|s| s.split) {
        None => Value::Null,
        Some(ShardSplit::Samples) => json!("samples"),
        Some(ShardSplit::Files) => json!({
            "split": "files",
            "data_parallel_size": cfg.data_parallel_size,
        }),
    }
}

/// Checks that `cfg` may resume the checkpoint `manifest` describes; returns a line for
/// each recorded setting that changed.
///
/// # Errors
/// `Checkpoint` naming the manifest and every fixed setting that differs, with both
/// values.
pub fn check_resume(
    manifest: &Manifest,
    dir: &std::path::Path,
    cfg: &TrainConfig,
    model_fingerprint: &str,
) -> Result<Vec<String>> {
    let now = settings_of(cfg, model_fingerprint);
    let saved = &manifest.settings;
    let mut refused = Vec::new();
    for (name, then) in &saved.fixed {
        let current = now.fixed.get(name).unwrap_or(&Value::Null);
        if current != then {
            refused.push(format!(
                "`{name}` was {then} when the checkpoint was written and is {current} now"
            ));
        }
    }
    if !refused.is_empty() {
        return Err(Error::Checkpoint {
            path: dir.join(super::MANIFEST),
            reason: format!(
                "cannot resume: these settings must not change: {}",
                refused.join("; ")
            ),
        });
    }
    let mut changed = Vec::new();
    for (name, current) in &now.recorded {
        // A checkpoint of an older version may not have recorded it.
        let Some(then) = saved.recorded.get(name) else {
            continue;
        };
        if then != current {
            changed.push(format!("`{name}` changed from {then} to {current}"));
        }
    }
    Ok(changed)
}

/// A config part as JSON (every part serializes; `null` would only hide a bug).
fn to<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}
