//! Engine overhead and pipeline idle time (issue: actor runtime).
//!
//! 1. dp = pp = 1: the actor runtime driving one `OrtStage` vs a bare loop calling the same
//!    stage's forward, backward and update (same sessions, same host work), interleaved
//!    in windows so machine noise hits both alike.
//! 2. pp = 2 (4 micro-batches; 1F1B, ZB-H1, and on the V's placement, two stages a
//!    rank, ZB-V, DualPipeV, V-Half and V-Min): each rank's measured idle time in the
//!    recorded trace vs the simulator's prediction for the measured action times.
//!
//! `cargo bench --bench engine`

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::Instant;

use pipetrain::compute::Runtime;
use pipetrain::config::{ScheduleKind, TrainConfig};
use pipetrain_actors::schedules::simulate_with;
use pipetrain_actors::{BackwardPart, StageCompute};

const WINDOWS: usize = 7;
const STEPS: usize = 60;
/// Steps left out of the timing at the start of each window (first runs, arenas).
const WARMUP: usize = 10;

/// The schedules whose idle time is set against the simulator's: one stage a rank, then
/// the V's placement, two stages a rank.
const IDLE_SCHEDULES: [ScheduleKind; 6] = [
    ScheduleKind::OneFOneB,
    ScheduleKind::ZbH1,
    ScheduleKind::ZbV,
    ScheduleKind::DualPipeV,
    ScheduleKind::VHalf,
    ScheduleKind::VMin,
];

fn config(model: &str, pp: usize, accum: usize, batch: usize, steps: usize) -> TrainConfig {
    let (label, layout) = if model == "mlp" {
        (
            "y",
            r#"batch_order = "batch_idx"
layout = { kind = "arrays", feeds = { x = "x", y = "y" } }"#,
        )
    } else {
        (
            "targets",
            r#"layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }"#,
        )
    };
    let text = format!(
        r#"
model_path = "../peers/data/{model}.onnx"
init_path = "../peers/data/{model}_init.safetensors"
batch_size = {batch}
gradient_accumulation_steps = {accum}
num_train_steps = {n}
pipeline_parallel_size = {pp}
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "{label}"
[data]
path = "../peers/data/{model}_data.npz"
{layout}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.05
"#,
        n = steps * accum
    );
    TrainConfig::parse(
        &text,
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/bench.toml"),
    )
    .unwrap()
}

fn main() {
    let rt = common::runtime();
    println!("## Engine overhead at dp = pp = 1 (train SGD steps/s over steps {WARMUP}..{STEPS}, {WINDOWS} interleaved windows)\n");
    println!(
        "| model | bare loop over the stage | actor engine | engine slower by |\n|---|---|---|---|"
    );
    for (model, batch) in [("mlp", 64), ("tiny_gpt", 8)] {
        let cfg = config(model, 1, 1, batch, STEPS);
        let tokio = tokio::runtime::Builder::new_multi_thread()
            // As `pipetrain::train::train` builds it.
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let (mut bare, mut engine) = (Vec::new(), Vec::new());
        for _ in 0..WINDOWS {
            // On a thread of its own, as the engine runs a stage.
            let (rt2, cfg2) = (rt.clone(), cfg.clone());
            let h = tokio.handle().clone();
            bare.push(
                std::thread::spawn(move || h.block_on(bare_loop(&rt2, &cfg2)))
                    .join()
                    .unwrap(),
            );
            // Steps after the first WARMUP, timed by the step reports, as the bare loop
            // times them: the run's start and end (actors spawned, threads joined) are
            // not a cost per step. The last report comes once the run is over, so the
            // window ends at the one before.
            let mut at = Vec::new();
            tokio
                .block_on(pipetrain::train::train_async(
                    &rt,
                    &cfg,
                    Path::new("bench.toml"),
                    false,
                    |r| at.push(r.elapsed.as_secs_f64()),
                ))
                .unwrap();
            engine.push((STEPS - 1 - WARMUP) as f64 / (at[STEPS - 2] - at[WARMUP - 1]));
        }
        let (b, e) = (median(&mut bare), median(&mut engine));
        println!(
            "| {model} | {b:.1} | {e:.1} | {:+.1}% |",
            100.0 * (b / e - 1.0)
        );
    }

    println!("\n## Idle time per rank at pp = 2 (4 micro-batches): measured vs simulated with each action's own measured time\n");
    println!("The simulation takes every step's recorded compute and update times and no transfer cost: the difference is what the engine adds (hand-offs, wake-ups, the step boundary).\n");
    println!("| model | schedule | rank | idle measured ms/step | idle simulated ms/step | difference | bubble measured |\n|---|---|---|---|---|---|---|");
    let mut bubbles = Vec::new();
    for (model, batch) in [("mlp", 16), ("tiny_gpt", 8)] {
        for schedule in IDLE_SCHEDULES {
            let (mut cfg, kind) = (config(model, 2, 4, batch, 30), schedule.name());
            cfg.pipeline.schedule = schedule;
            let s =
                pipetrain::train::train(&rt, &cfg, Path::new("bench.toml"), true, |_| {}).unwrap();
            let trace = s.trace.unwrap();
            let (measured, simulated, bubble) = idle_per_rank(&trace);
            bubbles.push((model, kind, bubble));
            for r in 0..2 {
                println!(
                    "| {model} | {kind} | {r} | {:.3} | {:.3} | {:+.1}% | {:.3} |",
                    measured[r] * 1e3,
                    simulated[r] * 1e3,
                    100.0 * (measured[r] / simulated[r] - 1.0),
                    bubble
                );
            }
        }
    }
    println!("\n| model | bubble 1F1B / bubble ZB-H1 | bubble 1F1B / bubble ZB-V (measured) |\n|---|---|---|");
    for model in ["mlp", "tiny_gpt"] {
        let of = |k: &str| bubbles.iter().find(|b| b.0 == model && b.1 == k).unwrap().2;
        println!(
            "| {model} | {:.2}x | {:.2}x |",
            of("1f1b") / of("zb_h1"),
            of("1f1b") / of("zb_v")
        );
    }
}

/// Mean idle per rank per step (steps 5 on: warm), measured and simulated with the
/// step's own action times, and the measured bubble fraction (idle / ranks x span).
fn idle_per_rank(trace: &pipetrain_actors::RunTrace) -> ([f64; 2], [f64; 2], f64) {
    let steps = &trace.steps[5..];
    let (mut measured, mut simulated) = ([0.0f64; 2], [0.0f64; 2]);
    let (mut idle_all, mut span_all) = (0.0, 0.0);
    for step in steps {
        let t = &step[0];
        // Compute and update only: a rank reaches its step's first (zero-length) transfer
        // posts while the previous step is still draining, which is not this step's time.
        let work = |e: &&pipetrain_actors::schedules::TraceEvent| !e.action.kind().is_transfer();
        let start = t
            .ranks
            .iter()
            .flatten()
            .filter(work)
            .map(|e| e.start_ns)
            .min()
            .unwrap_or(0);
        let end = t
            .ranks
            .iter()
            .flatten()
            .filter(work)
            .map(|e| e.end_ns)
            .max()
            .unwrap_or(0);
        let span = (end - start) as f64 / 1e9;
        let mut durations = std::collections::HashMap::new();
        for (rank, events) in t.ranks.iter().enumerate() {
            let busy: f64 = events
                .iter()
                .filter(work)
                .map(|e| {
                    let d = (e.end_ns - e.start_ns) as f64 / 1e9;
                    durations.insert(e.action, d);
                    d
                })
                .sum();
            measured[rank] += span - busy;
            idle_all += span - busy;
        }
        span_all += span * t.ranks.len() as f64;
        let ideal = simulate_with(
            &trace.schedule,
            &|a| durations.get(&a).copied().unwrap_or(0.0),
            0.0,
        )
        .unwrap();
        for (r, idle) in ideal.idle().iter().enumerate() {
            simulated[r] += idle;
        }
    }
    let n = steps.len() as f64;
    (
        measured.map(|x| x / n),
        simulated.map(|x| x / n),
        idle_all / span_all,
    )
}

/// Steps/s of a loop calling the stage's forward, backward and update directly.
async fn bare_loop(rt: &Runtime, cfg: &TrainConfig) -> f64 {
    let (mut stage, data) = single_stage(rt, cfg);
    use pipetrain_actors::DataSource;
    let mut t = Instant::now();
    for step in 0..STEPS as u64 {
        if step == WARMUP as u64 {
            t = Instant::now();
        }
        let d = data.micro_batch(step, 0, 0, 0).unwrap();
        stage.forward(0, None, Some(d)).await.unwrap();
        stage.backward(0, BackwardPart::Full, None).await.unwrap();
        let g = stage.take_grads();
        stage.put_grads(g);
        // What the engine does at the step's end: statistics, then the update.
        let policy = pipetrain_actors::GradPolicy::default();
        let stats = stage.grad_stats(step);
        let (decision, _) = policy.decide(policy.scaling.initial_state(), &[stats]);
        stage.update(step, 0.05, &decision).await.unwrap();
    }
    (STEPS - WARMUP) as f64 / t.elapsed().as_secs_f64()
}

/// The stage and data the engine would build for a one-stage config.
fn single_stage(
    rt: &Runtime,
    cfg: &TrainConfig,
) -> (pipetrain::pipeline::OrtStage, pipetrain::pipeline::StepData) {
    let mut model = pipetrain::onnx::load_model(&cfg.model_path).unwrap();
    let init = pipetrain::data::read_safetensors(cfg.init_path.as_ref().unwrap()).unwrap();
    for t in &mut model.graph.as_mut().unwrap().initializer {
        if let Some(v) = init.get(&t.name) {
            *t = v.to_proto(&t.name);
        }
    }
    let batches =
        pipetrain::data::Batches::open(&cfg.data, cfg.global_batch(), Path::new("bench.toml"))
            .unwrap();
    let first = batches.part(0, 0, 1).unwrap();
    let example: Vec<_> = first.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let opts = pipetrain::graph::TrainOptions {
        inputs: Default::default(),
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    };
    let tg = pipetrain::graph::build_training_graph(rt, &model, &opts, &example).unwrap();
    let stages = pipetrain::graph::build_stage_graphs(
        &tg,
        &pipetrain::graph::assign_stages(&tg, &cfg.partition()).unwrap(),
    )
    .unwrap();
    let session = pipetrain::compute::SessionOptions {
        intra_threads: 2,
        inter_threads: 1,
        optimize: true,
        // As the engine sets it for one actor with one stage.
        spin: true,
        profile: false,
        device: pipetrain::compute::Device::Cpu,
        deterministic: true,
        mixed_precision: None,
        state_on_device: true,
        device_path_on_host: false,
        cuda_kernels: true,
        cuda_graph: false,
    };
    let settings = pipetrain::pipeline::StageSettings::new(cfg.optimizer.clone(), 1.0);
    let stage =
        pipetrain::pipeline::OrtStage::new(rt, &tg, &stages[0], &session, &settings).unwrap();
    let reads = stages.iter().map(|s| s.io.data.clone()).collect();
    (
        stage,
        pipetrain::pipeline::StepData::new(Box::new(batches), 1, 1, reads),
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
