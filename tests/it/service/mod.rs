//! pipetrain embedded in a service, as a service uses it: runs that fail, are cancelled
//! or whose handle is dropped leave no thread or memory behind, and the service's runtime
//! is never held up while runs start and train (`process`: each in a service process of
//! its own); events read late still end with the run's end, each bad input fails with the
//! same error kind every time, the seeds' steps yield, a cancel while starting ends the
//! run before training (`api`).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::mlp::Mlp;
use pipetrain::api::{BoxError, Trainer};
use pipetrain::config::TrainConfig;
use pipetrain::data::{BatchSource, Batches};
use pipetrain::models::ModelSpec;
use pipetrain::tensor::TensorMap;

mod api;
mod process;

/// A 2-stage pipeline of the peers' MLP, 2 micro-batches a step, `steps` steps.
fn pipeline(dir: &Path, steps: usize) -> TrainConfig {
    std::fs::create_dir_all(dir).unwrap();
    let mlp = Mlp {
        accum: 2,
        steps,
        threads: 1,
        ..Mlp::default()
    };
    mlp.config(dir).0
}

/// The file's batches, handed in by the service; from step `fail_at` on, an error (or a
/// panic); counts the calls for step `fail_at`.
struct Served {
    batches: Batches,
    fail_at: u64,
    panic: bool,
    calls_at_fail: Arc<AtomicUsize>,
}

impl Served {
    fn new(cfg: &TrainConfig, fail_at: u64, panic: bool) -> Served {
        Served {
            batches: Batches::open(&cfg.data, cfg.global_batch(), Path::new("service.toml"))
                .unwrap(),
            fail_at,
            panic,
            calls_at_fail: Arc::default(),
        }
    }
}

impl BatchSource for Served {
    fn batch(&self, step: u64) -> Result<TensorMap, BoxError> {
        if step == self.fail_at {
            self.calls_at_fail.fetch_add(1, Ordering::SeqCst);
        }
        if step >= self.fail_at {
            if self.panic {
                panic!("the service's store lost step {step}");
            }
            return Err(format!("the service's store has no step {step}").into());
        }
        Ok(self.batches.batch(step as usize)?)
    }
}

/// The repository's GPT-2 pipeline example as a service would edit it: 8 layers x 256
/// (graph building and its shape probes take about a second), one replica of 2 stages,
/// 5 optimizer steps, no evaluation, nothing written.
fn gpt2() -> Trainer {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gpt2_pipeline.toml");
    Trainer::from_file(&example).unwrap().with(|c| {
        if let Some(ModelSpec::Gpt2(g)) = &mut c.model {
            g.layers = 8;
            g.d_model = 256;
        }
        c.num_train_steps = 20; // 5 optimizer steps x 4 micro-batches
        c.data_parallel_size = 1;
        c.evaluation_period = None;
        c.output_path = None;
    })
}
