//! Embedding pipetrain in a tokio service: start a run, print its events, ask for a
//! checkpoint, then stop it. The service makes its own data (here: pipetrain's synthetic
//! teacher task, generated in memory) and sends one global batch per step through a
//! channel, so nothing but the checkpoints ever touches a file.
//!
//! `cargo run --release --example embed` (needs `bash scripts/setup.sh` once).

use std::path::PathBuf;

use pipetrain::api::{RunEvent, Trainer};
use pipetrain::compute::Runtime;
use pipetrain::config::TrainConfig;
use pipetrain::data::{generate, split_rows, SynthSpec};
use pipetrain::tensor::TensorMap;

/// A built-in MLP as a 2-stage pipeline; the data table is unused (the service feeds it).
const CONFIG: &str = r#"
batch_size = 16
gradient_accumulation_steps = 4
num_train_steps = 4000000         # the service decides when to stop
pipeline_parallel_size = 2
max_grad_norm = 1.0
[model]
kind = "mlp"
hidden = [256]
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
path = "<fed by the service>"
layout = { kind = "arrays", feeds = {} }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-3
"#;

/// Steps the service trains before it asks for a checkpoint, and then before it stops.
const STEPS_BEFORE_CHECKPOINT: u64 = 30;
const STEPS_BEFORE_STOP: u64 = 60;

/// Runs the example; the folder its checkpoints went to.
pub async fn run(workdir: PathBuf) -> pipetrain::Result<PathBuf> {
    let mut cfg = TrainConfig::parse(CONFIG, &workdir.join("embed.toml"))?;
    let checkpoints = workdir.join("checkpoints");
    cfg.checkpoints_dir = Some(checkpoints.clone());
    let rt = Runtime::from_env()?;
    let (trainer, batches) = Trainer::new(cfg).with_data_channel(4);
    let handle = trainer.start(&rt)?;

    // The service's data: 64 samples a step, cycling through 4096 generated ones.
    let data = generate(
        &toml::from_str::<SynthSpec>("kind = \"teacher\"\nsamples = 4096\nseed = 1").map_err(
            |e| pipetrain::Error::Config {
                path: "<example>".into(),
                field: "synth".into(),
                rule: e.to_string(),
            },
        )?,
    )?;
    let all: TensorMap = data
        .into_iter()
        .filter(|(k, _)| k == "x" || k == "y")
        .collect();
    let feeder = tokio::spawn(async move {
        for step in 0.. {
            let batch = split_rows(&all, step % 64, 64).expect("64 equal parts");
            if batches.send(batch).await.is_err() {
                break; // the run has ended
            }
        }
    });

    let events = handle.events().clone();
    loop {
        match events.recv().await {
            Some(RunEvent::Started {
                stages, replicas, ..
            }) => {
                println!("started: {stages} stages x {replicas} replicas")
            }
            Some(RunEvent::Step(r)) => {
                if r.step % 10 == 0 {
                    println!(
                        "step {:>3}: loss {:.4}, lr {:.1e}, grad norm {:.3}, {:.0} samples/s",
                        r.step + 1,
                        r.loss,
                        r.lr,
                        r.grad_norm,
                        r.samples_per_s
                    );
                }
                if r.step + 1 == STEPS_BEFORE_CHECKPOINT {
                    let saved = handle.checkpoint_now().await?;
                    println!(
                        "checkpoint after {} steps: {}",
                        saved.steps_done,
                        saved.path.display()
                    );
                }
                if r.step + 1 == STEPS_BEFORE_STOP {
                    break;
                }
            }
            Some(RunEvent::CheckpointSaved(c)) => println!("saved {}", c.path.display()),
            Some(RunEvent::Warning(w)) => println!("warning: {w}"),
            Some(other) => println!("{other:?}"),
            None => break,
        }
    }
    let summary = handle.stop().await?;
    feeder.abort();
    println!(
        "stopped after {} steps ({:.1} steps/s), final loss {:.4}",
        summary.steps,
        summary.steps as f64 / summary.elapsed.as_secs_f64(),
        summary.final_loss
    );
    Ok(checkpoints)
}

#[allow(dead_code)] // when the tests include this file
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> pipetrain::Result<()> {
    let dir = PathBuf::from("runs/embed");
    std::fs::create_dir_all(&dir).map_err(pipetrain::Error::io(&dir))?;
    run(dir).await.map(|_| ())
}
