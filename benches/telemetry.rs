//! Cost of the telemetry writers, so that a run can afford them every step.
//!
//! 1. TensorBoard: a scalar event (encode, frame, CRC, buffered write), and histograms of
//!    1k to 1M values (two passes over the values, then one event); bytes per event.
//! 2. Chrome trace: converting a recorded run (1F1B, 4 stages, 8 micro-batches, lowered,
//!    200 steps) to JSON, and its size.
//!
//! Medians of `WINDOWS` windows. `cargo bench --bench telemetry` (writes under
//! `target/bench-telemetry`).

use std::path::PathBuf;
use std::time::Instant;

use pipetrain::telemetry::{chrome_trace, TensorBoardWriter};
use pipetrain_actors::RunTrace;
use pipetrain_schedules::{
    lower, one_f_one_b, simulate, CostModel, LowerOptions, StageCost, Trace, TraceEvent,
};

const WINDOWS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-telemetry");
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tensorboard() {
    let dir = dir();
    const SCALARS: u64 = 200_000;
    let mut per_scalar = Vec::new();
    for _ in 0..WINDOWS {
        let mut w = TensorBoardWriter::create(&dir).unwrap();
        let t = Instant::now();
        for step in 0..SCALARS {
            w.scalar("loss", step, 1.0 / (step + 1) as f64).unwrap();
        }
        w.flush().unwrap();
        per_scalar.push(t.elapsed().as_secs_f64() / SCALARS as f64);
        let bytes = std::fs::metadata(w.path()).unwrap().len();
        if per_scalar.len() == 1 {
            println!(
                "tensorboard scalar: {:.0} bytes/event",
                bytes as f64 / SCALARS as f64
            );
        }
    }
    println!(
        "tensorboard scalar: {:.0} ns/event (median of {WINDOWS} x {SCALARS}, flush included)",
        median(per_scalar) * 1e9
    );
    for n in [1_000usize, 100_000, 670_000, 1_000_000] {
        let values: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618).sin() * 0.1).collect();
        let reps = (2_000_000 / n).max(3);
        let mut per = Vec::new();
        let mut w = TensorBoardWriter::create(&dir).unwrap();
        for _ in 0..WINDOWS {
            let t = Instant::now();
            for step in 0..reps {
                w.histogram("w", step as u64, &values).unwrap();
            }
            w.flush().unwrap();
            per.push(t.elapsed().as_secs_f64() / reps as f64);
        }
        let m = median(per);
        println!(
            "tensorboard histogram of {n:>9} values: {:>9.1} us/event, {:.2} ns/value",
            m * 1e6,
            m * 1e9 / n as f64
        );
    }
    let mut w = TensorBoardWriter::create(&dir).unwrap();
    let before = std::fs::metadata(w.path()).unwrap().len();
    w.histogram("w", 1, &[0.0, 1.0]).unwrap();
    w.flush().unwrap();
    let after = std::fs::metadata(w.path()).unwrap().len();
    println!("tensorboard histogram: {} bytes/event", after - before);
}

fn recorded_run(steps: usize) -> RunTrace {
    let schedule = lower(
        &one_f_one_b(4, 8).unwrap(),
        LowerOptions {
            all_reduce: true,
            optimizer_step: true,
        },
    )
    .unwrap();
    let costs = CostModel::uniform(4, StageCost::split(1e-3, 1e-3, 1e-3));
    let timeline = simulate(&schedule, &costs).unwrap();
    let span_ns = (timeline.makespan() * 1e9) as u64 + 1000;
    let step = |s: usize| Trace {
        ranks: timeline
            .ranks
            .iter()
            .map(|spans| {
                spans
                    .iter()
                    .map(|sp| TraceEvent {
                        action: sp.action,
                        start_ns: s as u64 * span_ns + (sp.start * 1e9) as u64,
                        end_ns: s as u64 * span_ns + (sp.end * 1e9) as u64,
                    })
                    .collect()
            })
            .collect(),
    };
    RunTrace {
        schedule,
        replicas: 1,
        steps: (0..steps).map(|s| vec![step(s)]).collect(),
    }
}

fn chrome() {
    let trace = recorded_run(200);
    let actions: usize = trace.steps[0][0].ranks.iter().map(Vec::len).sum::<usize>() * 200;
    let mut per = Vec::new();
    let mut bytes = 0;
    for _ in 0..WINDOWS {
        let t = Instant::now();
        let v = chrome_trace(&trace);
        let json = serde_json::to_vec(&v).unwrap();
        per.push(t.elapsed().as_secs_f64());
        bytes = json.len();
    }
    let m = median(per);
    println!(
        "chrome trace: {actions} actions (200 steps) in {:.1} ms with serialisation, {:.0} ns/action, {:.0} bytes/action",
        m * 1e3,
        m * 1e9 / actions as f64,
        bytes as f64 / actions as f64
    );
}

fn main() {
    tensorboard();
    chrome();
}
