//! The device path run on the CPU over host memory (`debug.device_path_on_host`): each
//! stage's state in a device state, the update as the element-wise program the device
//! kernels are checked against, stage messages and the stash left where ONNX Runtime
//! computed them (bound with its I/O binding), data-parallel replicas summing in a group.
//! What a GPU runs, checked here without one: the same bits as the host path, and no
//! message or stashed value crossing between host and device.

use crate::common::exported::{piped, train_summary, Layout, Run, GPT2};
use pipetrain::pipeline::HostTraffic;
use pipetrain::train::TrainSummary;

const DEVICE_PATH: &str = "[debug]\ndevice_path_on_host = true\n";

/// The exported GPT-2 fixture's 16-token rows, 4 a step.
const TOKENS_PER_STEP: usize = 4 * 16;
const STEPS: usize = 3;

fn trained(layout: Layout, extra: &str) -> (Vec<f64>, TrainSummary) {
    let run = Run {
        model: "model.onnx",
        optimizer: "adamw",
        lr: 1e-3,
        layout,
        steps: STEPS,
        extra,
    };
    train_summary(&GPT2, &run)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Both paths' losses and trained parameters, bit for bit.
fn assert_same(what: &str, host: &(Vec<f64>, TrainSummary), device: &(Vec<f64>, TrainSummary)) {
    assert_eq!(bits(&host.0), bits(&device.0), "{what}: losses");
    let (a, b) = (&host.1.parameters, &device.1.parameters);
    assert_eq!(a.len(), b.len(), "{what}");
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m, "{what}");
        assert!(x == y, "{what}: parameter {n} differs");
    }
}

#[test]
fn pipelines_on_the_device_path_train_as_the_host_path_and_keep_their_messages_there() {
    for schedule in ["1f1b", "zb_h1"] {
        let layout = piped(2, 4, schedule);
        let host = trained(layout, "");
        let device = trained(layout, DEVICE_PATH);
        assert_same(schedule, &host, &device);
        assert!(
            host.1.host_traffic.is_empty(),
            "the host path has no device"
        );
        let traffic: Vec<(usize, HostTraffic)> = device.1.host_traffic.clone();
        assert_eq!(traffic.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
        // Stage 0 reads the token ids (its backward takes them from the stash, where
        // the data stays on the host); it sends its activations on and takes their
        // gradients back on the device, and hands out only its gradients' norm.
        let ids = TOKENS_PER_STEP * 8 * STEPS;
        assert_eq!(traffic[0].1.to_device, ids, "{schedule}: stage 0 in");
        assert_eq!(traffic[0].1.to_host, 8 * STEPS, "{schedule}: stage 0 out");
        // Stage 1 reads the labels and each micro-batch's backward seed (one float32),
        // and hands out each micro-batch's loss (one float32) and its gradients' norm.
        let seeds = 4 * 4 * STEPS;
        let stage1 = traffic[1].1;
        assert_eq!(stage1.to_device, ids + seeds, "{schedule}: stage 1 in");
        assert_eq!(
            stage1.to_host,
            (4 * 4 + 8) * STEPS,
            "{schedule}: stage 1 out"
        );
    }
}

#[test]
fn every_schedule_on_the_device_path_trains_as_on_the_host_path() {
    for layout in [
        piped(4, 4, "1f1b"),
        piped(2, 4, "gpipe"),
        piped(2, 4, "interleaved_1f1b"),
        piped(2, 4, "zb_v"),
        piped(2, 4, "v_half"),
    ] {
        let what = format!("pp {} {}", layout.pp, layout.schedule);
        let device = trained(layout, DEVICE_PATH);
        assert_same(&what, &trained(layout, ""), &device);
        assert!(
            !device.1.host_traffic.is_empty(),
            "{what}: on the device path"
        );
    }
}

#[test]
fn replicas_on_the_device_path_sum_in_their_group_as_the_host_path_sums() {
    let layout = Layout {
        pp: 1,
        dp: 2,
        micro_batches: 2,
        schedule: "1f1b",
    };
    let host = trained(layout, "");
    let device = trained(layout, DEVICE_PATH);
    assert_same("dp 2", &host, &device);
    // Replica 0's one stage: the gradients never came to the host to be summed.
    let traffic = &device.1.host_traffic;
    assert_eq!(traffic.len(), 1);
    let ids = TOKENS_PER_STEP / 2 * 8 * STEPS;
    let seeds = 2 * 4 * STEPS;
    assert_eq!(traffic[0].1.to_device, 2 * ids + seeds, "ids and labels in");
    assert_eq!(
        traffic[0].1.to_host,
        (2 * 4 + 8) * STEPS,
        "losses and norm out"
    );
}

/// A checkpoint written from device state (its host copy brought up to date first) and
/// restored into it (copied back up): resuming on the device path, or on the host path,
/// gives the uninterrupted run's losses and parameters bit for bit.
#[test]
fn the_device_path_checkpoints_and_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = dir.path().join("ckpts");
    let layout = piped(2, 4, "1f1b");
    let run = |extra: &str| {
        let run = Run {
            model: "model.onnx",
            optimizer: "adamw",
            lr: 1e-3,
            layout,
            steps: 4,
            extra,
        };
        train_summary(&GPT2, &run)
    };
    let saving = format!("checkpoints_dir = {ckpts:?}\ncheckpoint_period = 2\n{DEVICE_PATH}");
    let straight = run(&saving);
    let from = ckpts.join(pipetrain::checkpoint::folder_name(2));
    let loading = format!("checkpoint_to_load_path = {from:?}\n");
    for (what, extra) in [
        ("device path", format!("{loading}{DEVICE_PATH}")),
        ("host path", loading.clone()),
    ] {
        let resumed = run(&extra);
        assert_eq!(bits(&resumed.0), bits(&straight.0[2..]), "{what}: losses");
        assert!(
            resumed.1.parameters == straight.1.parameters,
            "{what}: trained parameters"
        );
    }
}

/// The README's built-in GPT-2 example layout (ZB-H1, 2 stages x 2 replicas, 4
/// micro-batches, evaluation every 5 steps): its input-gradient graph lists a gradient
/// twice among its outputs, and it evaluates. Both paths, bit for bit.
#[test]
fn the_built_in_gpt2_example_layout_trains_and_evaluates_alike_on_both_paths() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &str| {
        let text = format!(
            "batch_size = 4\ngradient_accumulation_steps = 4\nnum_train_steps = 40\n\
             data_parallel_size = 2\npipeline_parallel_size = 2\nevaluation_period = 5\n\
             eval_micro_batches = 2\n\
             [model]\nkind = \"gpt2\"\nlayers = 2\nd_model = 32\nheads = 4\nvocab = 64\nseq = 16\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"targets\"\n\
             [data]\nsynth = {{ kind = \"language\", samples = 512, seq = 16, vocab = 64, seed = 3 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [eval_data]\nsynth = {{ kind = \"language\", samples = 32, seq = 16, vocab = 64, seed = 3, sample_seed = 1 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3\n\
             [pipeline]\nschedule = \"zb_h1\"\n{extra}"
        );
        let path = dir.path().join("gpt2.toml");
        std::fs::write(&path, &text).unwrap();
        let cfg = pipetrain::config::TrainConfig::parse(&text, &path).unwrap();
        let mut reports = Vec::new();
        let summary = pipetrain::train::train(&crate::common::runtime(), &cfg, &path, false, |r| {
            reports.push(r.clone())
        })
        .unwrap();
        (reports, summary)
    };
    let (host, device) = (run(""), run(DEVICE_PATH));
    let losses = |r: &[pipetrain::train::StepReport]| -> Vec<u64> {
        r.iter().map(|s| s.loss.to_bits()).collect()
    };
    let evals = |r: &[pipetrain::train::StepReport]| -> Vec<u64> {
        r.iter()
            .filter_map(|s| s.eval_loss)
            .map(f64::to_bits)
            .collect()
    };
    assert_eq!(losses(&host.0), losses(&device.0), "losses");
    assert_eq!(evals(&host.0).len(), 2, "evaluated twice");
    assert_eq!(evals(&host.0), evals(&device.0), "evaluation losses");
    assert!(
        host.1.parameters == device.1.parameters,
        "trained parameters"
    );
    assert_eq!(
        device.1.host_traffic.len(),
        2,
        "both stages on the device path"
    );
}

/// Mixed precision (float16 products, a dynamic loss scale) with an overflow injected at
/// step 2: on the device path the unscaling, the overflow check and the skipped step
/// with its halved scale come out as on the host path, bit for bit.
#[test]
fn mixed_precision_and_its_overflow_skip_on_the_device_path_match_the_host_path() {
    let overflow = "inject_grad_overflow = [{ step = 2, stage = 1 }]\n";
    let reports = |device: bool| {
        let extra = match device {
            true => format!("use_mixed_precision = true\n{DEVICE_PATH}{overflow}"),
            false => format!("use_mixed_precision = true\n[debug]\n{overflow}"),
        };
        let run = Run {
            model: "model.onnx",
            optimizer: "adamw",
            lr: 1e-3,
            layout: piped(2, 4, "1f1b"),
            steps: 4,
            extra: &extra,
        };
        crate::common::exported::train_reports(&GPT2, &run)
    };
    let (host, device) = (reports(false), reports(true));
    let seen = |r: &[pipetrain::train::StepReport]| -> Vec<(u64, u64, bool)> {
        r.iter()
            .map(|s| (s.loss.to_bits(), s.loss_scale.to_bits(), s.skipped))
            .collect()
    };
    assert_eq!(seen(&host.0), seen(&device.0));
    assert!(
        device.0[1].skipped && !device.0[2].skipped,
        "step 2 alone skipped"
    );
    assert_eq!(device.0[2].loss_scale, device.0[1].loss_scale / 2.0);
    assert!(
        host.1.parameters == device.1.parameters,
        "trained parameters"
    );
}

/// The exported GPT-2 under mixed precision with an overflow at step 2, its step replayed
/// at fixed homes (`runtime.cuda_graph` over host memory): the backward's seed, which
/// carries the loss scale, copied into its home every run, so the halved scale reaches
/// the step after the skipped one; the same losses, scales, skip and parameters as the
/// host path, bit for bit.
#[test]
fn mixed_precision_replayed_at_fixed_homes_matches_the_host_path() {
    let overflow = "inject_grad_overflow = [{ step = 2, stage = 0 }]\n";
    let reports = |replayed: bool| {
        let extra = match replayed {
            true => format!(
                "use_mixed_precision = true\n[runtime]\ncuda_graph = true\n{DEVICE_PATH}{overflow}"
            ),
            false => format!("use_mixed_precision = true\n[debug]\n{overflow}"),
        };
        let run = Run {
            model: "model.onnx",
            optimizer: "adamw",
            lr: 1e-3,
            layout: crate::common::exported::ONE,
            steps: 4,
            extra: &extra,
        };
        crate::common::exported::train_reports(&GPT2, &run)
    };
    let (host, replayed) = (reports(false), reports(true));
    let seen = |r: &[pipetrain::train::StepReport]| -> Vec<(u64, u64, bool)> {
        r.iter()
            .map(|s| (s.loss.to_bits(), s.loss_scale.to_bits(), s.skipped))
            .collect()
    };
    assert_eq!(seen(&host.0), seen(&replayed.0));
    assert!(replayed.0[1].skipped, "step 2 skipped");
    assert_eq!(replayed.0[2].loss_scale, replayed.0[1].loss_scale / 2.0);
    assert!(
        host.1.parameters == replayed.1.parameters,
        "trained parameters"
    );
}

/// `runtime.cuda_graph` over host memory: the step's one session bound at fixed homes,
/// as a replayed CUDA graph is (the data copied into them each run, the loss read out of
/// them, the second micro-batch's gradients into the scratch buffer under a graph of
/// their own; evaluation runs apart), trains and evaluates as the host path, bit for
/// bit; the binary's log shows the runs recorded under both graphs.
#[test]
fn a_step_replayed_at_fixed_homes_trains_and_evaluates_as_the_host_path() {
    let dir = tempfile::tempdir().unwrap();
    let text = |extra: &str| {
        format!(
            "batch_size = 4\ngradient_accumulation_steps = 2\nnum_train_steps = 24\n\
             evaluation_period = 4\neval_micro_batches = 3\n\
             [model]\nkind = \"gpt2\"\nlayers = 2\nd_model = 32\nheads = 4\nvocab = 64\nseq = 16\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"targets\"\n\
             [data]\nsynth = {{ kind = \"language\", samples = 256, seq = 16, vocab = 64, seed = 5 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [eval_data]\nsynth = {{ kind = \"language\", samples = 20, seq = 16, vocab = 64, seed = 5, sample_seed = 1 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3\n{extra}"
        )
    };
    let replayed = format!("[runtime]\ncuda_graph = true\n{DEVICE_PATH}");
    let run = |extra: &str| {
        let path = dir.path().join("gpt2.toml");
        std::fs::write(&path, text(extra)).unwrap();
        let cfg = pipetrain::config::TrainConfig::parse(&text(extra), &path).unwrap();
        let mut reports = Vec::new();
        let summary = pipetrain::train::train(&crate::common::runtime(), &cfg, &path, false, |r| {
            reports.push(r.clone())
        })
        .unwrap();
        (reports, summary)
    };
    let (host, device) = (run(""), run(&replayed));
    let losses = |r: &[pipetrain::train::StepReport]| -> Vec<u64> {
        r.iter().map(|s| s.loss.to_bits()).collect()
    };
    let evals = |r: &[pipetrain::train::StepReport]| -> Vec<u64> {
        (r.iter().filter_map(|s| s.eval_loss))
            .map(f64::to_bits)
            .collect()
    };
    assert_eq!(losses(&host.0), losses(&device.0), "losses");
    assert_eq!(evals(&host.0).len(), 3, "evaluated three times");
    assert_eq!(evals(&host.0), evals(&device.0), "evaluation losses");
    assert!(
        host.1.parameters == device.1.parameters,
        "trained parameters"
    );

    let path = dir.path().join("replayed.toml");
    std::fs::write(&path, text(&replayed)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(&path)
        .env("RUST_LOG", "warn,pipetrain::device=debug")
        .output()
        .unwrap();
    let log = plain_text(&String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{log}");
    let runs = |graph: &str| {
        log.lines()
            .filter(|l| l.contains("as a CUDA graph") && l.contains(graph))
            .count()
    };
    // 12 steps of two micro-batches. The first run finds the outputs' shapes; the next,
    // into the scratch buffer, has the first graph (id 1); the later first micro-batches,
    // into the gradients, the second.
    assert_eq!(runs("graph=-1"), 1, "{log}");
    assert_eq!(runs("graph=1"), 12, "{log}");
    assert_eq!(runs("graph=2"), 11, "{log}");
}

/// `text` without its terminal colours (`ESC [ ... m`).
fn plain_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                for c in chars.by_ref() {
                    if c == 'm' {
                        break;
                    }
                }
            }
            c => out.push(c),
        }
    }
    out
}
