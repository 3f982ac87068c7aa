//! The training configuration (TOML), validated up front.
//!
//! Field names follow ONNX Runtime's `TrainingRunner::Parameters` where one applies
//! (`model_path`, `num_train_steps`, `display_loss_steps`, ...). Relative paths are
//! relative to the configuration file's folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::graph::{LossSpec, Partition};
use crate::{Error, Result};

/// A training run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The forward ONNX model.
    pub model_path: PathBuf,
    /// Initial weights (safetensors) replacing the model's initializers of the same name.
    #[serde(default)]
    pub init_path: Option<PathBuf>,
    /// Where the trained inference model is written.
    #[serde(default)]
    pub output_path: Option<PathBuf>,
    /// Optimizer steps to run.
    pub num_train_steps: usize,
    /// Log the loss every this many steps.
    #[serde(default = "default_display")]
    pub display_loss_steps: usize,
    /// The loss.
    pub loss: LossSpec,
    /// Training data.
    pub data: DataConfig,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Pipeline stages.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// ONNX Runtime settings.
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

fn default_display() -> usize {
    10
}

/// Where batches come from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// An `.npz` archive.
    pub path: PathBuf,
    /// An integer array `[steps, batch]` of row indices: step `s` uses rows
    /// `batch_order[s]`. Without it, step `s` takes the next `batch_size` rows.
    #[serde(default)]
    pub batch_order: Option<String>,
    /// Rows per batch when there is no `batch_order`.
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// How the arrays feed the model.
    pub layout: DataLayout,
}

/// How arrays of the data file become model inputs.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DataLayout {
    /// Each model input (and the label) is the array of the given name.
    Arrays {
        /// Model input or label name -> array name.
        feeds: BTreeMap<String, String>,
    },
    /// Language modelling: `array` rows of `T + 1` tokens give the input
    /// `row[..T]` and the label `row[1..]`.
    NextToken {
        /// The token array.
        array: String,
        /// The model's token input.
        input: String,
        /// The label name (as in the loss).
        label: String,
    },
}

/// The optimizer (more kinds arrive with the runtime).
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// Plain SGD: `p -= lr * g`.
    Sgd {
        /// Learning rate.
        lr: f64,
    },
}

/// Pipeline stages.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// How to cut the model; none trains it as one stage.
    #[serde(default)]
    pub partition: Option<Partition>,
    /// Run each stage's backward as input-gradient and weight-gradient halves.
    #[serde(default)]
    pub split_backward: bool,
}

/// ONNX Runtime settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Threads per operator.
    #[serde(default = "default_threads")]
    pub intra_op_threads: usize,
    /// ONNX Runtime graph optimizations.
    #[serde(default = "default_true")]
    pub optimize: bool,
    /// Allow `com.microsoft` contrib ops (FusedMatMul) in backward graphs.
    #[serde(default = "default_true")]
    pub contrib_ops: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            intra_op_threads: default_threads(),
            optimize: true,
            contrib_ops: true,
        }
    }
}

fn default_threads() -> usize {
    2
}

fn default_true() -> bool {
    true
}

impl TrainConfig {
    /// Reads, resolves relative paths against the file's folder, and validates.
    ///
    /// # Errors
    /// `Io` when unreadable; `Config` naming the field and the rule otherwise.
    pub fn load(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
        TrainConfig::parse(&text, path)
    }

    /// Parses TOML text; `path` names the file in errors and anchors relative paths.
    ///
    /// # Errors
    /// `Config` naming the field and the rule.
    pub fn parse(text: &str, path: &Path) -> Result<TrainConfig> {
        let mut cfg: TrainConfig = toml::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            field: field_of(&e),
            rule: e.message().to_string(),
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let resolve = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        resolve(&mut cfg.model_path);
        resolve(&mut cfg.data.path);
        cfg.init_path.as_mut().map(resolve);
        cfg.output_path.as_mut().map(resolve);
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: field.into(),
            rule,
        };
        if self.num_train_steps == 0 {
            return Err(bad("num_train_steps", "must be at least 1".into()));
        }
        if self.display_loss_steps == 0 {
            return Err(bad("display_loss_steps", "must be at least 1".into()));
        }
        if self.data.batch_order.is_none() && self.data.batch_size.is_none_or(|b| b == 0) {
            return Err(bad(
                "data.batch_size",
                "needs a positive value when data.batch_order is not given".into(),
            ));
        }
        let OptimizerConfig::Sgd { lr } = self.optimizer;
        if !(lr.is_finite() && lr > 0.0) {
            return Err(bad(
                "optimizer.lr",
                format!("must be a positive number, got {lr}"),
            ));
        }
        if self.runtime.intra_op_threads == 0 {
            return Err(bad("runtime.intra_op_threads", "must be at least 1".into()));
        }
        if let Some(Partition::Balanced { stages: 0, .. }) = self.pipeline.partition {
            return Err(bad(
                "pipeline.partition.balanced.stages",
                "must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// The dotted field a TOML error is about, from its position in the text when serde
/// names none.
fn field_of(e: &toml::de::Error) -> String {
    let msg = e.message();
    // serde's messages quote the offending key: "unknown field `lr_rate`, expected ...".
    if let Some(start) = msg.find('`') {
        if let Some(len) = msg[start + 1..].find('`') {
            return msg[start + 1..start + 1 + len].to_string();
        }
    }
    "<document>".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
model_path = "m.onnx"
num_train_steps = 10
[loss]
kind = "mse"
prediction = "y"
label = "t"
[data]
path = "d.npz"
batch_size = 4
layout = { kind = "arrays", feeds = { x = "x", t = "t" } }
[optimizer]
kind = "sgd"
lr = 0.1
"#;

    fn err(text: &str) -> String {
        TrainConfig::parse(text, Path::new("/cfg/run.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn paths_resolve_against_the_config_folder() {
        let c = TrainConfig::parse(GOOD, Path::new("/cfg/run.toml")).unwrap();
        assert_eq!(c.model_path, Path::new("/cfg/m.onnx"));
        assert_eq!(c.data.path, Path::new("/cfg/d.npz"));
        assert_eq!(c.runtime.intra_op_threads, 2);
    }

    #[test]
    fn each_rule_names_its_field() {
        let e = err(&GOOD.replace("num_train_steps = 10", "num_train_steps = 0"));
        assert!(
            e.contains("run.toml") && e.contains("`num_train_steps`") && e.contains("at least 1"),
            "{e}"
        );
        let e = err(&GOOD.replace("lr = 0.1", "lr = -1.0"));
        assert!(
            e.contains("`optimizer.lr`") && e.contains("positive"),
            "{e}"
        );
        let e = err(&GOOD.replace("lr = 0.1", "lr = 0.1\nmomentum = 0.9"));
        assert!(e.contains("momentum") && e.contains("unknown field"), "{e}");
        let e = err(&GOOD.replace("kind = \"sgd\"", "kind = \"adagrad\""));
        assert!(e.contains("adagrad"), "{e}");
        let e = err(&GOOD.replace("batch_size = 4\n", ""));
        assert!(e.contains("`data.batch_size`"), "{e}");
    }
}
