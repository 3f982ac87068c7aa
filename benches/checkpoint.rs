//! Checkpoint speed (issue: checkpoints).
//!
//! 1. Write: a whole checkpoint of the peers' mlp and tiny_gpt with AdamW state
//!    (snapshot, safetensors encoding, write and fsync of every shard, manifest, atomic
//!    rename) against `cp` of the same files followed by `sync` of the copies, alternating
//!    windows. Reported as throughput relative to `cp` (goal >= 50%).
//! 2. Load: reading it back (every shard read, CRC-checked, indexed, copied into stage
//!    buffers) against `cp` of the same files, alternating.
//! 3. The cost of `checkpoint_period = 10` on training steps/s, alternating runs with and
//!    without it (goal <= 5%).
//!
//! `cargo bench --bench checkpoint [-- io|snapshot|period]` (writes under
//! `target/bench-checkpoint`).

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use common::mlp::Mlp;
use pipetrain::checkpoint::{
    save_job, DirCheckpointer, LoadedCheckpoint, Manifest, SnapshotBuffers, StageState,
};
use pipetrain::optim::{build, OptimizerConfig, ParamLayout};
use pipetrain_actors::{Checkpointer, CommitState, ScalerState};

const PAIRS: usize = 10;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() - 1])
}

/// The peers' model's parameters as one stage's layout, with AdamW state that has
/// taken a step (so the moments are not zero).
fn stage_of(model: &str) -> (ParamLayout, Vec<f32>, Box<dyn pipetrain::optim::Optimizer>) {
    let proto =
        pipetrain::onnx::load_model(&common::peers_dir().join(format!("data/{model}.onnx")))
            .unwrap();
    let graph = proto.graph.unwrap();
    let layout = ParamLayout::new(
        graph
            .initializer
            .iter()
            .filter(|t| t.data_type == 1)
            .map(|t| {
                (
                    t.name.clone(),
                    t.dims.iter().map(|&d| d as usize).collect::<Vec<_>>(),
                )
            }),
    );
    let params: Vec<f32> = (0..layout.len())
        .map(|i| (i % 1000) as f32 * 1e-3)
        .collect();
    let mut opt = build(&OptimizerConfig::default(), &layout).unwrap();
    let mut p = params.clone();
    let g: Vec<f32> = (0..layout.len()).map(|i| (i % 7) as f32 * 1e-2).collect();
    opt.step(&mut p, &g, 1e-3).unwrap();
    (layout, p, opt)
}

fn write_once(
    root: &Path,
    layout: &ParamLayout,
    params: &[f32],
    opt: &dyn pipetrain::optim::Optimizer,
    pool: &SnapshotBuffers,
) -> (f64, PathBuf) {
    let template: Manifest = serde_json::from_str(MANIFEST_TEMPLATE).unwrap();
    let store = DirCheckpointer::new(
        root,
        Some(1),
        Arc::new(move |state: CommitState, shards| Manifest {
            steps_done: state.steps_done,
            shards,
            ..template.clone()
        }),
    )
    .unwrap();
    let t = Instant::now();
    let dir = store.prepare(1).unwrap();
    let state = StageState {
        layout,
        params,
        optimizer: opt,
        stats: &[],
        shard: None,
        zero: None,
    };
    let job = save_job(0, &dir, state, None, pool).unwrap();
    let shards = job().unwrap();
    let state = CommitState {
        steps_done: 1,
        scaler: ScalerState {
            scale: 1.0,
            stable_steps: 0,
        },
    };
    let path = store.commit(&dir, state, shards).unwrap();
    (t.elapsed().as_secs_f64(), path)
}

/// `cp` of a checkpoint's files, then `sync` of the copies (fsync each, as the writer does).
fn cp_once(from: &Path, to: &Path) -> f64 {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    let files: Vec<PathBuf> = std::fs::read_dir(from)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let t = Instant::now();
    let ok = Command::new("cp").args(&files).arg(to).status().unwrap();
    assert!(ok.success());
    let copies: Vec<PathBuf> = std::fs::read_dir(to)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let ok = Command::new("sync").args(&copies).status().unwrap();
    assert!(ok.success());
    t.elapsed().as_secs_f64()
}

/// `cp` only (reading the files back from the page cache, as a load does).
fn cp_plain(from: &Path, to: &Path) -> f64 {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    let files: Vec<PathBuf> = std::fs::read_dir(from)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let t = Instant::now();
    let ok = Command::new("cp").args(&files).arg(to).status().unwrap();
    assert!(ok.success());
    t.elapsed().as_secs_f64()
}

fn load_once(dir: &Path, layout: &ParamLayout, opt: &mut dyn pipetrain::optim::Optimizer) -> f64 {
    let mut params = vec![0.0f32; layout.len()];
    let t = Instant::now();
    let ckpt = LoadedCheckpoint::open(dir).unwrap();
    pipetrain::checkpoint::restore_stage(&ckpt, (layout, None), &mut params, opt, None).unwrap();
    t.elapsed().as_secs_f64()
}

/// Time of the snapshot alone (what the stage's thread spends; the rest is background).
fn snapshot_bench(scratch: &Path) {
    println!("\n## Snapshot on the stage's thread (encode only; median of {PAIRS})\n");
    for model in ["mlp", "tiny_gpt"] {
        let (layout, params, opt) = stage_of(model);
        let dir = scratch.join("snap");
        std::fs::create_dir_all(&dir).unwrap();
        let pool = SnapshotBuffers::default();
        let mut t = Vec::new();
        for _ in 0..PAIRS {
            let s = Instant::now();
            let state = StageState {
                layout: &layout,
                params: &params,
                optimizer: opt.as_ref(),
                stats: &[],
                shard: None,
                zero: None,
            };
            let job = save_job(0, &dir, state, None, &pool).unwrap();
            t.push(s.elapsed().as_secs_f64());
            drop(job);
        }
        println!("- {model}: {:.2} ms", median(&mut t) * 1e3);
    }
}

fn io_bench(scratch: &Path) {
    println!("## Checkpoint write and load vs `cp` of the same bytes ({PAIRS} alternating pairs; median, [min-max] of per-pair ratios)\n");
    println!("| model | bytes | write (fsync) | `cp` + `sync` | write throughput vs cp | load | `cp` | load throughput vs cp |\n|---|---|---|---|---|---|---|---|");
    for model in ["mlp", "tiny_gpt"] {
        let (layout, params, mut opt) = stage_of(model);
        let root = scratch.join(model);
        let pool = SnapshotBuffers::default();
        let _ = std::fs::remove_dir_all(&root);
        let (_, dir) = write_once(&root, &layout, &params, opt.as_ref(), &pool);
        let bytes: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        let (mut w, mut c, mut wr) = (vec![], vec![], vec![]);
        let (mut l, mut c2, mut lr) = (vec![], vec![], vec![]);
        for _ in 0..PAIRS {
            let (tw, dir) = write_once(&root, &layout, &params, opt.as_ref(), &pool);
            let tc = cp_once(&dir, &scratch.join("copy"));
            w.push(tw);
            c.push(tc);
            wr.push(tc / tw);
            let tl = load_once(&dir, &layout, opt.as_mut());
            let tc2 = cp_plain(&dir, &scratch.join("copy"));
            l.push(tl);
            c2.push(tc2);
            lr.push(tc2 / tl);
        }
        let (wr_lo, wr_hi) = spread(&mut wr.clone());
        let (lr_lo, lr_hi) = spread(&mut lr.clone());
        println!(
            "| {model} | {:.1} MiB | {:.1} ms | {:.1} ms | {:.0}% [{:.0}-{:.0}] | {:.1} ms | {:.1} ms | {:.0}% [{:.0}-{:.0}] |",
            bytes as f64 / (1 << 20) as f64,
            median(&mut w) * 1e3,
            median(&mut c) * 1e3,
            median(&mut wr) * 100.0,
            wr_lo * 100.0,
            wr_hi * 100.0,
            median(&mut l) * 1e3,
            median(&mut c2) * 1e3,
            median(&mut lr) * 100.0,
            lr_lo * 100.0,
            lr_hi * 100.0,
        );
    }
}

/// Steps/s of a training run, up to its next-to-last step: the last report comes after
/// the final checkpoint is on disk, a wait at the end of the run, not a cost per step.
fn steps_per_s(
    rt: &pipetrain::compute::Runtime,
    cfg: &pipetrain::config::TrainConfig,
    path: &Path,
) -> f64 {
    let mut times = Vec::new();
    pipetrain::train::train(rt, cfg, path, false, |r| {
        times.push(r.elapsed.as_secs_f64())
    })
    .unwrap();
    (times.len() - 1) as f64 / times[times.len() - 2]
}

fn period_bench(scratch: &Path) {
    let rt = common::runtime();
    println!("\n## Training with `checkpoint_period = 10` vs none (AdamW, pp = 1, 2 threads; {PAIRS} alternating pairs of 100-step runs; steps/s up to the next-to-last step)\n");
    println!("| run | state saved | steps/s without | steps/s with | cost: median [min to max] |\n|---|---|---|---|---|");
    let mlp = Mlp {
        dp: 1,
        pp: 1,
        accum: 1,
        steps: 100,
        threads: 2,
        optimizer: "[optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3\n",
        ..Mlp::default()
    };
    let dir = scratch.join("period");
    std::fs::create_dir_all(&dir).unwrap();
    let gpt_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny_gpt_adamw.toml");
    let mut gpt = pipetrain::config::TrainConfig::load(&gpt_path).unwrap();
    gpt.num_train_steps = 100;
    gpt.output_path = None;
    let mut gpt_saving = gpt.clone();
    gpt_saving.checkpoints_dir = Some(dir.join("ck"));
    gpt_saving.checkpoint_period = Some(10);
    gpt_saving.max_num_checkpoints = Some(2);
    let mlp_saving = Mlp {
        extra: format!(
            "checkpoints_dir = \"{}\"\ncheckpoint_period = 10\nmax_num_checkpoints = 2\n",
            dir.join("ck").display()
        ),
        ..mlp.clone()
    };
    for (name, mb) in [("mlp", 7.7), ("tiny_gpt", 6.1)] {
        let mut ratios = Vec::new();
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..PAIRS {
            let (plain, saved) = if name == "mlp" {
                let (c1, p1) = mlp.config(&dir);
                let (c2, p2) = mlp_saving.config(&dir);
                (steps_per_s(&rt, &c1, &p1), steps_per_s(&rt, &c2, &p2))
            } else {
                (
                    steps_per_s(&rt, &gpt, &gpt_path),
                    steps_per_s(&rt, &gpt_saving, &gpt_path),
                )
            };
            a.push(plain);
            b.push(saved);
            ratios.push(saved / plain);
        }
        let (lo, hi) = spread(&mut ratios.clone());
        println!(
            "| {name}, a checkpoint every 10 steps | {mb} MiB | {:.1} | {:.1} | {:.1}% [{:.1} to {:.1}] |",
            median(&mut a),
            median(&mut b),
            (1.0 - median(&mut ratios)) * 100.0,
            (1.0 - hi) * 100.0,
            (1.0 - lo) * 100.0
        );
    }
}

fn main() {
    let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-checkpoint");
    std::fs::create_dir_all(&scratch).unwrap();
    // `cargo bench --bench checkpoint -- period` runs only the parts named.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let run = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    if run("io") {
        io_bench(&scratch);
    }
    if run("snapshot") {
        snapshot_bench(&scratch);
    }
    if run("period") {
        period_bench(&scratch);
    }
}

/// A manifest whose run facts do not matter to the timing.
const MANIFEST_TEMPLATE: &str = r#"{
  "format": "pipetrain-checkpoint", "format_version": 1, "pipetrain_version": "bench",
  "steps_done": 0, "created_unix_s": 0,
  "layout": {"data_parallel_size": 1, "pipeline_parallel_size": 1, "virtual_stages": 1, "stages": 1, "schedule": "1f1b"},
  "model": {"path": "bench.onnx", "fingerprint": "", "tensors": 0, "parameters": 0},
  "optimizer": {"config": {"kind": "adamw"}, "state": ["exp_avg", "exp_avg_sq"]},
  "lr_schedule": {"config": {"kind": "constant", "lr": 0.001}, "step": 0, "total_steps": 1, "next_lr": 0.001},
  "data": {"next_step": 0, "global_batch": 1, "sample_offset": 0, "batch_order": null, "batch_order_row": null, "epoch": 0, "shuffle_seed": null},
  "loss_scaler": {"mode": "static", "state": {"scale": 1.0, "stable_steps": 0}},
  "settings": {"fixed": {}, "fingerprint": "", "recorded": {}},
  "shards": []
}"#;
