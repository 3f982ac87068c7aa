//! The peers' MLP as a training configuration, for tests of the run's state
//! (checkpoints, resume, clipping, loss scaling): fast, and exactly reproducible.

use std::path::{Path, PathBuf};

use pipetrain::config::TrainConfig;

/// What varies between the tests' runs.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub dp: usize,
    pub pp: usize,
    /// Micro-batches per step and replica.
    pub accum: usize,
    /// Samples per step, all replicas (the peers' batch order has 64).
    pub global: usize,
    pub steps: usize,
    /// `1f1b`, `zb_h1`, ...
    pub schedule: &'static str,
    /// Stages per rank (`interleaved_1f1b`).
    pub virtual_stages: usize,
    /// The `[optimizer]` and `[lr_schedule]` tables.
    pub optimizer: &'static str,
    /// More top-level keys (before any table).
    pub extra: String,
    /// ONNX Runtime threads per stage (1: bit-reproducible runs).
    pub threads: usize,
}

/// SGD with momentum at a constant rate.
pub const SGD_MOMENTUM: &str =
    "[optimizer]\nkind = \"sgd\"\nmomentum = 0.9\n[lr_schedule]\nkind = \"constant\"\nlr = 0.05\n";
/// AdamW with warmup and cosine decay.
pub const ADAMW_COSINE: &str = "[optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"cosine\"\nlr = 2e-3\nwarmup_ratio = 0.2\n";

impl Default for Mlp {
    fn default() -> Self {
        Mlp {
            dp: 1,
            pp: 2,
            accum: 8,
            global: 64,
            steps: 20,
            schedule: "1f1b",
            virtual_stages: 1,
            optimizer: SGD_MOMENTUM,
            extra: String::new(),
            threads: 1,
        }
    }
}

impl Mlp {
    /// The configuration's text.
    pub fn toml(&self) -> String {
        let batch = self.global / (self.dp * self.accum);
        format!(
            r#"
model_path = "{data}/mlp.onnx"
init_path = "{data}/mlp_init.safetensors"
batch_size = {batch}
gradient_accumulation_steps = {accum}
num_train_steps = {passes}
data_parallel_size = {dp}
pipeline_parallel_size = {pp}
{extra}
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
path = "{data}/mlp_data.npz"
batch_order = "batch_idx"
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
{optimizer}
[pipeline]
schedule = "{schedule}"
virtual_stages = {virtual_stages}
[runtime]
intra_op_threads = {threads}
"#,
            data = super::peers_dir().join("data").display(),
            accum = self.accum,
            passes = self.steps * self.accum,
            dp = self.dp,
            pp = self.pp,
            extra = self.extra,
            optimizer = self.optimizer,
            schedule = self.schedule,
            threads = self.threads,
            virtual_stages = self.virtual_stages,
        )
    }

    /// The configuration, as if read from `dir/run.toml` (also written there, for the
    /// command line).
    pub fn config(&self, dir: &Path) -> (TrainConfig, PathBuf) {
        let path = dir.join("run.toml");
        let text = self.toml();
        std::fs::write(&path, &text).unwrap();
        (TrainConfig::parse(&text, &path).unwrap(), path)
    }
}
