//! Training-step throughput on the peers' models (peers/), as the peers measure
//! it: 2 threads, batch 64 (mlp) / 8 x 64 (tiny_gpt), forward + loss + backward + SGD
//! update, 10 warm-up steps then windows of 50 steps, median of the windows.
//!
//! `cargo bench --bench train_step` prints steps/s per model and the ratio to the best
//! peer's figure in `peers/results/throughput.csv` (measured on another day);
//! `benches/side_by_side.sh` runs the peers and this bench in one sitting for a fair ratio.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::Instant;

use common::PeerModel;
use pipetrain::compute::{SessionOptions, StageChain, TensorMap, TrainSession};
use pipetrain::graph::{assign_stages, build_stage_graphs, BalanceBy, Partition};
use pipetrain::tensor::Tensor;

const WARMUP: usize = 10;
const WINDOW: usize = 50;
const WINDOWS: usize = 5;

fn main() {
    let rt = common::runtime();

    println!("| model | runner | train SGD steps/s (median of {WINDOWS} x {WINDOW}) | min | max | best peer SGD steps/s | ratio |");
    println!("|---|---|---|---|---|---|---|");
    let mut profiles = Vec::new();
    for model in ["mlp", "tiny_gpt"] {
        let peer = PeerModel::load(model);
        let batches: Vec<TensorMap> = (0..200).map(|s| peer.batch(s)).collect();
        let tg = peer.training_graph(&rt);
        let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
        let best_peer = best_peer_sgd(model);
        let opts = SessionOptions {
            intra_threads: 2,
            inter_threads: 1,
            optimize: true,
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
        let nospin = SessionOptions {
            spin: false,
            ..opts
        };
        let stages = build_stage_graphs(
            &tg,
            &assign_stages(
                &tg,
                &Partition::Balanced {
                    stages: 2,
                    by: BalanceBy::Flops,
                },
            )
            .unwrap(),
        )
        .unwrap();
        let runners: [(&str, MakeRunner); 3] = [
            (
                "one graph",
                Box::new(|| Runner::Whole(TrainSession::new(&rt, &tg, &opts).unwrap())),
            ),
            (
                "one graph, no spinning",
                Box::new(|| Runner::Whole(TrainSession::new(&rt, &tg, &nospin).unwrap())),
            ),
            (
                "2 stages in a chain",
                Box::new(|| {
                    Runner::Chain(StageChain::new(&rt, &tg, &stages, &nospin, false).unwrap())
                }),
            ),
        ];
        for (name, make) in runners {
            let mut runner = make();
            let mut params: TensorMap = tg
                .params
                .iter()
                .map(|p| (p.name.clone(), p.init.to_tensor().unwrap()))
                .collect();
            let rates = measure(|i| {
                let out = runner.step(&params, &batches[i % 200], &seed);
                common::sgd(&mut params, &out.grads, 0.05);
            });
            report(model, name, &rates, best_peer);
        }
        profiles.push((model, where_time_goes(&rt, &tg, &batches, &seed, opts)));
    }
    for (model, table) in profiles {
        println!("\n{model}: where one training step's time goes (ONNX Runtime profile, 20 steps, one graph)\n{table}");
    }
}

/// Runs 20 profiled steps and sums ONNX Runtime's kernel times per operator type, next
/// to the wall time of the whole step (the difference is pipetrain's own host work:
/// binding, copying gradients out, SGD).
fn where_time_goes(
    rt: &pipetrain::compute::Runtime,
    tg: &pipetrain::graph::TrainingGraph,
    batches: &[TensorMap],
    seed: &Tensor,
    opts: SessionOptions,
) -> String {
    let opts = SessionOptions {
        profile: true,
        device: pipetrain::compute::Device::Cpu,
        spin: true,
        ..opts
    };
    let mut session = TrainSession::new(rt, tg, &opts).unwrap();
    let mut params: TensorMap = tg
        .params
        .iter()
        .map(|p| (p.name.clone(), p.init.to_tensor().unwrap()))
        .collect();
    for batch in &batches[..5] {
        let out = session.step(&params, batch, seed).unwrap();
        common::sgd(&mut params, &out.grads, 0.05);
    }
    let t = Instant::now();
    let mut run_us = 0.0;
    for batch in &batches[..20] {
        let r = Instant::now();
        let out = session.step(&params, batch, seed).unwrap();
        run_us += r.elapsed().as_secs_f64() * 1e6;
        common::sgd(&mut params, &out.grads, 0.05);
    }
    let wall_us = t.elapsed().as_secs_f64() * 1e6;
    let path = session.end_profiling().unwrap();
    let events: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    if std::env::var_os("KEEP_PROFILE").is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let mut per_op: std::collections::HashMap<String, f64> = Default::default();
    let mut model_run_us = 0.0;
    for e in &events {
        let dur = e["dur"].as_f64().unwrap_or(0.0);
        if e["cat"] == "Node"
            && e["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("_kernel_time"))
        {
            *per_op
                .entry(e["args"]["op_name"].as_str().unwrap_or("?").to_string())
                .or_default() += dur;
        } else if e["cat"] == "Session" && e["name"] == "model_run" {
            model_run_us += dur;
        }
    }
    // The first 5 (warm-up) runs are in the profile too: keep the last 20 of them.
    let scale = 20.0 / 25.0;
    let kernels: f64 = per_op.values().sum::<f64>() * scale;
    let mut ops: Vec<(String, f64)> = per_op.into_iter().map(|(k, v)| (k, v * scale)).collect();
    ops.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut out = String::from("| part | us/step | share of step |\n|---|---|---|\n");
    let per = |us: f64| us / 20.0;
    let share = |us: f64| 100.0 * us / wall_us;
    for (op, us) in ops.iter().take(8) {
        out += &format!("| kernel {op} | {:.0} | {:.1}% |\n", per(*us), share(*us));
    }
    out += &format!(
        "| all kernels | {:.0} | {:.1}% |\n",
        per(kernels),
        share(kernels)
    );
    out += &format!(
        "| ORT run outside kernels | {:.0} | {:.1}% |\n",
        per(model_run_us * scale - kernels),
        share(model_run_us * scale - kernels)
    );
    let glue = run_us - model_run_us * scale;
    out += &format!(
        "| around ORT's run (lending feeds, copying outputs out) | {:.0} | {:.1}% |\n",
        per(glue),
        share(glue)
    );
    out += &format!(
        "| pipetrain host work (batch, SGD) | {:.0} | {:.1}% |\n",
        per(wall_us - run_us),
        share(wall_us - run_us)
    );
    out += &format!("| step (wall) | {:.0} | 100% |", per(wall_us));
    out
}

/// Builds a runner once its turn comes (sessions of the others are dropped by then).
type MakeRunner<'a> = Box<dyn Fn() -> Runner + 'a>;

/// The two ways of running a training step that the bench compares.
enum Runner {
    Whole(TrainSession),
    Chain(StageChain),
}

impl Runner {
    fn step(
        &mut self,
        params: &TensorMap,
        data: &TensorMap,
        seed: &Tensor,
    ) -> pipetrain::compute::StepOutput {
        match self {
            Runner::Whole(s) => s.step(params, data, seed).unwrap(),
            Runner::Chain(c) => c.step(params, data, seed).unwrap(),
        }
    }
}

fn measure(mut step: impl FnMut(usize)) -> Vec<f64> {
    let mut i = 0;
    for _ in 0..WARMUP {
        step(i);
        i += 1;
    }
    let mut rates: Vec<f64> = (0..WINDOWS)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..WINDOW {
                step(i);
                i += 1;
            }
            WINDOW as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates
}

fn report(model: &str, runner: &str, rates: &[f64], best_peer: Option<f64>) {
    let median = rates[rates.len() / 2];
    let (peer, ratio) = match best_peer {
        Some(p) => (format!("{p:.1}"), format!("{:.2}x", median / p)),
        None => ("-".into(), "-".into()),
    };
    println!(
        "| {model} | {runner} | {median:.1} | {:.1} | {:.1} | {peer} | {ratio} |",
        rates[0],
        rates[rates.len() - 1]
    );
}

/// The best peer's median SGD training steps/s: from the CSV named by
/// `PEERS_THROUGHPUT_CSV` (what `benches/side_by_side.sh` measured in the same sitting),
/// else from the peers' stored `results/throughput.csv`.
fn best_peer_sgd(model: &str) -> Option<f64> {
    let path = std::env::var_os("PEERS_THROUGHPUT_CSV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| common::peers_dir().join("results/throughput.csv"));
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (m, mode, opt, v) = (
        col("model")?,
        col("mode")?,
        col("opt")?,
        col("steps_per_s_median")?,
    );
    lines
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let hit = f.get(m) == Some(&model)
                && f.get(mode) == Some(&"train")
                && f.get(opt) == Some(&"sgd");
            hit.then(|| f.get(v)?.parse::<f64>().ok()).flatten()
        })
        .reduce(f64::max)
}
