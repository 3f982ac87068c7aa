//! `deepspeed_zero_stage = 1`: the optimizer state sharded across the data-parallel
//! replicas. Each replica keeps the state of its part only (1 / dp of it), updates that
//! part and all-gathers the parameters; the run trains the same bits as an unsharded
//! one, and its checkpoints load at any layout, sharded or not. `= 2`: the gradients
//! too, reduce-scattered bucket by bucket as every micro-batch's backward makes them
//! (a replica never writes the rest: `grad_buckets.rs`). Over processes:
//! `tests/it/launch.rs`.

use std::path::Path;

use crate::common;
use crate::common::mlp::{Mlp, ADAMW_COSINE, SGD_MOMENTUM};
use pipetrain::checkpoint::folder_name;
use pipetrain::compute::Runtime;
use pipetrain::tensor::Tensor;

const ZERO: &str = "deepspeed_zero_stage = 1\n";
/// Stage 2, in buckets of 16 KiB: the mlp's stages cut into several.
const ZERO_2: &str = "deepspeed_zero_stage = 2\ngradient_bucket_mb = 0.015625\n";
const LAMB: &str = "[optimizer]\nkind = \"lamb\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-2\n";

/// A run's per-step losses and final parameters (sorted by name), as bits.
type Bits = (Vec<(u64, u64)>, Vec<(String, Vec<u32>)>);

fn run(rt: &Runtime, mlp: &Mlp, dir: &Path, extra: &str) -> Bits {
    let mut m = mlp.clone();
    // Top-level keys first: `mlp.extra` may end in a table.
    m.extra = format!("{extra}{}", m.extra);
    let (cfg, path) = m.config(dir);
    let mut losses = Vec::new();
    let s = pipetrain::train::train(rt, &cfg, &path, false, |r| {
        losses.push((r.step, r.loss.to_bits()))
    })
    .unwrap();
    let mut params: Vec<(String, Tensor)> = s.parameters;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let bits = params
        .into_iter()
        .map(|(n, t)| (n, t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect()))
        .collect();
    (losses, bits)
}

/// The mlp at dp 2 x pp 2, AdamW, 10 steps: for runs resumed at step 5.
fn resumable() -> Mlp {
    Mlp {
        dp: 2,
        pp: 2,
        accum: 4,
        steps: 10,
        optimizer: ADAMW_COSINE,
        ..Mlp::default()
    }
}

/// `mlp` with `extra`, saving every 5 steps: the folder holding it all, the run's bits
/// and its step-5 checkpoint.
fn saved_run(
    rt: &Runtime,
    mlp: &Mlp,
    extra: &str,
) -> (tempfile::TempDir, Bits, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let straight = run(rt, mlp, tmp.path(), &(saving(tmp.path()) + extra));
    let half = tmp.path().join("ckpts").join(folder_name(5));
    (tmp, straight, half)
}

fn saving(dir: &Path) -> String {
    format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = 5\n",
        dir.join("ckpts").display()
    )
}

/// Sharded and unsharded, the same losses and weights bit for bit: element-wise
/// optimizers and LAMB's per-tensor trust ratio (each part is whole tensors; each
/// replica's part of the gradients is the sum the all-reduce gives), over one and two
/// pipeline stages. With clipping, the global norm adds up the replicas' parts, another
/// order of the same float64 sum: within float32 rounding of the unsharded run.
#[test]
fn a_sharded_optimizer_state_trains_the_same_bits() {
    let rt = common::runtime();
    let cases = [
        ("dp=2 pp=2 AdamW", 2, 2, ADAMW_COSINE, ""),
        (
            "dp=2 pp=1 SGD momentum, clipped",
            2,
            1,
            SGD_MOMENTUM,
            "max_grad_norm = 0.5\n",
        ),
        ("dp=4 pp=1 LAMB", 4, 1, LAMB, ""),
    ];
    for (name, dp, pp, optimizer, extra) in cases {
        let mlp = Mlp {
            dp,
            pp,
            accum: 8 / dp,
            steps: 8,
            optimizer,
            extra: extra.into(),
            ..Mlp::default()
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let whole = run(&rt, &mlp, a.path(), "");
        let sharded = run(&rt, &mlp, b.path(), ZERO);
        assert_eq!(whole.0.len(), 8, "{name}");
        assert!(whole.0.first() != whole.0.last(), "{name}: it trains");
        if extra.is_empty() {
            assert!(whole.0 == sharded.0, "{name}: the losses differ");
            assert!(whole.1 == sharded.1, "{name}: the weights differ");
            continue;
        }
        for ((n, a), (_, b)) in whole.1.iter().zip(&sharded.1) {
            let f = |x: &u32| f32::from_bits(*x);
            let scale = a.iter().map(|x| f(x).abs()).fold(0.0, f32::max);
            let diff = (a.iter().zip(b))
                .map(|(x, y)| (f(x) - f(y)).abs())
                .fold(0.0, f32::max);
            assert!(diff <= 1e-6 * scale, "{name}: `{n}` off by {diff:e}");
        }
    }
}

/// Sharded gradients train as sharded optimizer state does, within float32 rounding
/// (the replicas are summed per micro-batch, not once per step): under 1F1B and ZB-H1
/// (whose weight-gradient half makes the buckets), with clipping, and over four
/// replicas. A stage-2 run resumed from its own checkpoint trains the bits of the run
/// straight through.
#[test]
fn sharded_gradients_train_as_a_sharded_optimizer_state_does() {
    let rt = common::runtime();
    let cases = [
        ("dp=2 pp=2 AdamW 1F1B", 2, 2, "1f1b", ADAMW_COSINE, ""),
        ("dp=2 pp=2 AdamW ZB-H1", 2, 2, "zb_h1", ADAMW_COSINE, ""),
        (
            "dp=2 pp=1 SGD momentum, clipped",
            2,
            1,
            "1f1b",
            SGD_MOMENTUM,
            "max_grad_norm = 0.5\n",
        ),
        ("dp=4 pp=1 LAMB", 4, 1, "1f1b", LAMB, ""),
    ];
    for (name, dp, pp, schedule, optimizer, extra) in cases {
        let mlp = Mlp {
            dp,
            pp,
            accum: 8 / dp,
            steps: 8,
            schedule,
            optimizer,
            extra: extra.into(),
            ..Mlp::default()
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let one = run(&rt, &mlp, a.path(), ZERO);
        let two = run(&rt, &mlp, b.path(), ZERO_2);
        assert_eq!(two.0.len(), 8, "{name}");
        let f = |x: u64| f64::from_bits(x);
        for ((s, x), (_, y)) in one.0.iter().zip(&two.0) {
            let off = (f(*x) - f(*y)).abs();
            assert!(
                off <= 1e-6 * f(*x).abs(),
                "{name}: step {s}'s loss off by {off:e}"
            );
        }
        let mut worst: f32 = 0.0;
        for ((n, a), (_, b)) in one.1.iter().zip(&two.1) {
            let f = |x: &u32| f32::from_bits(*x);
            let scale = a.iter().map(|x| f(x).abs()).fold(0.0, f32::max);
            let diff = (a.iter().zip(b))
                .map(|(x, y)| (f(x) - f(y)).abs())
                .fold(0.0, f32::max);
            worst = worst.max(diff / scale);
            assert!(diff <= 1e-5 * scale, "{name}: `{n}` off by {diff:e}");
        }
        eprintln!("{name}: weights within {worst:e} of stage 1's");
        // The replicas summed per micro-batch round otherwise than once per step.
        assert!(
            worst > 0.0,
            "{name}: stage 1's bits; were the gradients sharded?"
        );
    }
    let mlp = resumable();
    let (_tmp, straight, half) = saved_run(&rt, &mlp, ZERO_2);
    let loading = format!("checkpoint_to_load_path = \"{}\"\n", half.display());
    let other = tempfile::tempdir().unwrap();
    let resumed = run(&rt, &mlp, other.path(), &(loading + ZERO_2));
    assert!(resumed.0 == straight.0[5..], "losses after the resume");
    assert!(resumed.1 == straight.1, "weights after the resume");
}

/// Dynamic loss scaling: an inf injected into the gradients of one stage of replica 1
/// (the first value that replica reduces) skips the step everywhere, sharded as
/// unsharded: the coordinator sees it in that replica's part.
#[test]
fn an_overflow_in_one_replicas_part_skips_the_step_everywhere() {
    let rt = common::runtime();
    let mlp = Mlp {
        dp: 2,
        pp: 2,
        accum: 2,
        steps: 5,
        optimizer: ADAMW_COSINE,
        extra: "loss_scale = 0.0\n[[debug.inject_grad_overflow]]\nstep = 3\nstage = 1\n\
                replica = 1\n"
            .into(),
        ..Mlp::default()
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let whole = run(&rt, &mlp, a.path(), "");
    let sharded = run(&rt, &mlp, b.path(), ZERO);
    assert!(whole.0.iter().all(|(_, l)| f64::from_bits(*l).is_finite()));
    assert!(whole.0 == sharded.0, "the losses differ");
    assert!(whole.1 == sharded.1, "the weights differ");
}

/// A sharded run's checkpoint holds every rank's part of the optimizer state, in a file
/// of its own; it resumes bitwise sharded and unsharded at dp = 2, and at dp = 1 within
/// float32 rounding of the other reduction order. An unsharded checkpoint resumes
/// sharded, bitwise.
#[test]
fn a_sharded_checkpoint_resumes_under_any_layout() {
    let rt = common::runtime();
    let mlp = resumable();
    let (_tmp, straight, half) = saved_run(&rt, &mlp, ZERO);
    let mut files: Vec<String> = std::fs::read_dir(&half)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("optimizer"))
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "stage-000.optimizer.safetensors",
            "stage-000.zero-1.optimizer.safetensors",
            "stage-001.optimizer.safetensors",
            "stage-001.zero-1.optimizer.safetensors",
        ]
    );
    let loading = format!("checkpoint_to_load_path = \"{}\"\n", half.display());
    for (zero, label) in [(ZERO, "sharded"), ("", "unsharded")] {
        let other = tempfile::tempdir().unwrap();
        let resumed = run(&rt, &mlp, other.path(), &(loading.clone() + zero));
        assert!(
            resumed.0 == straight.0[5..],
            "{label}: losses after the resume"
        );
        assert!(resumed.1 == straight.1, "{label}: weights after the resume");
    }
    let one = Mlp {
        dp: 1,
        accum: 8,
        ..mlp.clone()
    };
    let other = tempfile::tempdir().unwrap();
    let resumed = run(&rt, &one, other.path(), &loading);
    for ((n, a), (_, b)) in resumed.1.iter().zip(&straight.1) {
        let scale = a
            .iter()
            .map(|&x| f32::from_bits(x).abs())
            .fold(0.0, f32::max);
        let diff = (a.iter().zip(b))
            .map(|(&x, &y)| (f32::from_bits(x) - f32::from_bits(y)).abs())
            .fold(0.0, f32::max);
        assert!(diff <= 1e-5 * scale, "dp = 1: `{n}` off by {diff:e}");
    }
    // And the other way: an unsharded checkpoint resumes sharded.
    let plain = tempfile::tempdir().unwrap();
    let unsharded = run(&rt, &mlp, plain.path(), &saving(plain.path()));
    let half = plain.path().join("ckpts").join(folder_name(5));
    let loading = format!("checkpoint_to_load_path = \"{}\"\n", half.display());
    let other = tempfile::tempdir().unwrap();
    let resumed = run(&rt, &mlp, other.path(), &(loading + ZERO));
    assert!(resumed.1 == unsharded.1, "unsharded -> sharded: weights");
}

/// Each replica's optimizer allocates the state of its part only: the parts of the
/// peers' tiny GPT (AdamW) add up to the whole state, and none holds more than half of
/// it plus its largest tensor's.
#[test]
fn each_replica_keeps_its_part_of_the_optimizer_state() {
    use pipetrain::graph::{assign_stages, build_stage_graphs, BalanceBy, Partition};
    use pipetrain::optim::OptimizerConfig;
    use pipetrain::pipeline::{OrtStage, StageSettings, ZeroSlot};
    let rt = common::runtime();
    let model = common::PeerModel::load("tiny_gpt");
    let tg = model.training_graph(&rt);
    let one = Partition::Balanced {
        stages: 1,
        by: BalanceBy::Flops,
    };
    let graphs = build_stage_graphs(&tg, &assign_stages(&tg, &one).unwrap()).unwrap();
    let session = pipetrain::compute::SessionOptions {
        intra_threads: 1,
        ..Default::default()
    };
    let adamw: OptimizerConfig = toml::from_str("kind = \"adamw\"").unwrap();
    let state_values = |zero: Option<ZeroSlot>| {
        let settings = StageSettings {
            zero,
            ..StageSettings::new(adamw.clone(), 0.5)
        };
        let stage = OrtStage::new(&rt, &tg, &graphs[0], &session, &settings).unwrap();
        let (layout, _, optimizer) = stage.state();
        let largest = layout.ranges().map(|r| r.len()).max().unwrap_or(0);
        let held: usize = optimizer.state().iter().map(|(_, b)| b.len()).sum();
        (held, largest)
    };
    let (whole, largest) = state_values(None);
    let parts: Vec<usize> = (0..2)
        .map(|rank| {
            state_values(Some(ZeroSlot {
                rank,
                ranks: 2,
                gradients: false,
            }))
            .0
        })
        .collect();
    eprintln!("AdamW state values: whole {whole}, parts {parts:?}");
    assert_eq!(parts.iter().sum::<usize>(), whole);
    for p in &parts {
        assert!(*p <= whole / 2 + 2 * largest, "a part of {p} of {whole}");
    }
}
