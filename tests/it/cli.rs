//! The `pipetrain` binary, run as a user runs it.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn pipetrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    text
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// An example with absolute paths and fewer steps, written to the temp folder.
fn example(name: &str, edits: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(format!(
        "{}/examples/{name}.toml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let peers = common::peers_dir().join("data");
    text = text.replace("../peers/data", peers.to_str().unwrap());
    for (old, new) in edits {
        assert!(text.contains(old), "{name}: {old}");
        text = text.replace(old, new);
    }
    let path = tmp(&format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn doctor_reports_the_library_and_cpu_provider() {
    let text = ok(&pipetrain(&["doctor"]));
    assert!(
        text.contains("libonnxruntime.so") && text.contains("version:   1.31.1"),
        "{text}"
    );
    assert!(text.contains("CPUExecutionProvider"), "{text}");
}

#[test]
fn a_recorded_1f1b_run_and_a_zero_bubble_run_replay_in_order() {
    let model = tmp("mlp_pipeline.onnx");
    let _ = std::fs::remove_file(&model);
    for (schedule, out) in [("1f1b", Some(&model)), ("zb_h1", None)] {
        let steps =
            "num_train_steps = 40            # forward/backward passes: 10 optimizer steps x 4";
        let mut edits = vec![
            ("num_train_steps = 800            # forward/backward passes: 200 optimizer steps x 4", steps),
            ("schedule = \"1f1b\"", if schedule == "1f1b" { "schedule = \"1f1b\"" } else { "schedule = \"zb_h1\"" }),
        ];
        let model_line = format!("output_path = \"{}\"", model.display());
        if out.is_some() {
            edits.push((
                "output_path = \"../runs/mlp_pipeline/model.onnx\"",
                &model_line,
            ));
        }
        let cfg = example("mlp_pipeline", &edits);
        let trace = tmp(&format!("{schedule}.trace.json"));
        let metrics = tmp(&format!("{schedule}.jsonl"));
        let text = ok(&pipetrain(&[
            "train",
            cfg.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ]));
        assert!(text.contains("done: 10 steps on 2 stage(s)"), "{text}");
        // Step 1's loss is the initial weights' loss on batch 0, as in the peers' curves.
        let first = std::fs::read_to_string(&metrics).unwrap();
        assert!(
            first.lines().count() == 10 && first.contains("\"loss\":2.29836"),
            "{first}"
        );
        // Every step's time is its own (the last one too: results reach the reporter a
        // round late, and the last two together).
        let mut times: Vec<f64> = first
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step_s"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        let last = *times.last().unwrap();
        times.sort_by(f64::total_cmp);
        assert!(
            last > times[times.len() / 2] / 10.0,
            "step times {times:?}, last {last}"
        );
        let text = ok(&pipetrain(&["schedule", "replay", trace.to_str().unwrap()]));
        assert!(text.contains("replayed 10 step(s) x 1 replica(s): every actor ran its actions in the recorded order"), "{text}");
        let svg = tmp(&format!("{schedule}.svg"));
        ok(&pipetrain(&[
            "schedule",
            "draw",
            "--trace",
            trace.to_str().unwrap(),
            "-o",
            svg.to_str().unwrap(),
        ]));
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    }
    assert!(
        pipetrain::onnx::load_model(&model).is_ok(),
        "the trained model was exported"
    );
}

#[test]
fn schedule_show_and_simulate_print_the_schedule_and_its_figures() {
    let text = ok(&pipetrain(&[
        "schedule",
        "show",
        "--kind",
        "1f1b",
        "--stages",
        "2",
        "--micro-batches",
        "3",
    ]));
    assert!(text.contains("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1"), "{text}");
    // A legend of the kinds it uses.
    assert!(
        text.contains("`1F3` is stage 1's forward of micro-batch 3"),
        "{text}"
    );
    assert!(
        text.contains("SEND_F    send activations to the next stage"),
        "{text}"
    );
    assert!(
        !text.contains("#   W "),
        "a kind the schedule does not use: {text}"
    );
    let text = ok(&pipetrain(&[
        "schedule",
        "simulate",
        "--kind",
        "1f1b",
        "--stages",
        "4",
        "--micro-batches",
        "8",
    ]));
    // (p - 1) / (m + p - 1) = 3 / 11 with F = B.
    assert!(text.contains("bubble fraction  0.2727"), "{text}");
    let text = ok(&pipetrain(&[
        "schedule",
        "simulate",
        "--kind",
        "zb_h1",
        "--stages",
        "4",
        "--micro-batches",
        "8",
    ]));
    assert!(text.contains("bubble fraction"), "{text}");
    // The costs are a rank's: interleaving 2 virtual stages a rank halves the bubble
    // (F = I = W = 1 a rank: 1F1B 11 x 3 = 33, interleaved 8 x 3 + 3 x 3 / 2 = 28.5).
    let makespan = |kind: &str| -> f64 {
        let text = ok(&pipetrain(&[
            "schedule",
            "simulate",
            "--kind",
            kind,
            "--stages",
            "4",
            "--micro-batches",
            "8",
        ]));
        let line = text.lines().find(|l| l.starts_with("makespan")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(makespan("1f1b"), 33.0);
    assert_eq!(makespan("interleaved_1f1b"), 28.5);
}

#[test]
fn a_bad_config_names_file_and_field() {
    let path = example(
        "mlp_sgd",
        &[(
            "batch_order = \"batch_idx\"",
            "batch_order = \"batch_idx\"\nshuffle = true",
        )],
    );
    let out = pipetrain(&["train", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("mlp_sgd.toml") && err.contains("`data.shuffle`"),
        "{err}"
    );
}

/// `[runtime] profile = true`: ONNX Runtime's per-operator profile of every session lands
/// in the working folder, one JSON file per session, with the kernels of every run, and
/// `benches/ort_profile.py` summarizes one.
#[test]
fn runtime_profile_writes_each_sessions_ort_profile_in_the_working_folder() {
    let cfg = example(
        "mlp",
        &[
            (
                "num_train_steps = 800            # 200 optimizer steps x 4 micro-batches",
                "num_train_steps = 40",
            ),
            ("output_path = \"../runs/mlp/model.onnx\"\n", ""),
            (
                "schedule = \"1f1b\"",
                "schedule = \"1f1b\"\n\n[runtime]\nprofile = true",
            ),
        ],
    );
    let dir = tmp("profile_run");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["train", cfg.to_str().unwrap()])
        .current_dir(&dir)
        .output()
        .unwrap();
    ok(&out);
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    // Two stages, each with its forward, backward and evaluation sessions.
    for stage in ["stage0", "stage1"] {
        assert!(
            files
                .iter()
                .any(|f| f.starts_with(&format!("pipetrain_{stage}_forward"))
                    && f.ends_with(".json")),
            "{files:?}"
        );
    }
    // 10 optimizer steps of 4 micro-batches, one backward run each: a step's first in
    // the backward session, the other three in its accumulating twin, which adds the
    // gradients into the step's accumulators (`graph::accumulating`).
    let runs_in = |name: &str| -> (String, Vec<serde_json::Value>, usize) {
        let file = files
            .iter()
            .find(|f| f.starts_with(name))
            .unwrap_or_else(|| panic!("no {name}* in {files:?}"));
        let events: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        let runs = events
            .iter()
            .filter(|e| e["cat"] == "Session" && e["name"] == "model_run")
            .count();
        (file.clone(), events, runs)
    };
    let (_, _, first) = runs_in("pipetrain_stage0_backward_2");
    let (backward, events, runs) = runs_in("pipetrain_stage0_backward__accumulating_");
    assert_eq!((first, runs), (10, 30), "{backward}");
    let kernels = events
        .iter()
        .filter(|e| {
            e["cat"] == "Node"
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("_kernel_time"))
        })
        .count();
    assert!(kernels >= 30, "{kernels} kernel events in {backward}");
    let summary = Command::new("python3")
        .args([
            format!("{}/benches/ort_profile.py", env!("CARGO_MANIFEST_DIR")),
            dir.join(backward).display().to_string(),
        ])
        .output()
        .unwrap();
    let text = ok(&summary);
    assert!(
        text.contains("20 runs after 10 skipped") && text.contains("| of which matmuls"),
        "{text}"
    );
}

/// A second `train` into a `checkpoints_dir` that holds the first run's checkpoints,
/// without `--resume`, refuses and names both ways on, leaving every byte there; with
/// `--fresh` it moves them aside, says where, and trains from step 0.
#[test]
fn a_used_checkpoints_dir_is_refused_without_resume_or_fresh() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let config = dir.path().join("train.toml");
    let text = format!(
        "batch_size = 16\nnum_train_steps = 4\ncheckpoints_dir = {ck:?}\ncheckpoint_period = 2\n\
         [model]\nkind = \"mlp\"\nhidden = [8]\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
         [data]\nsynth = {{ kind = \"teacher\", samples = 64, seed = 1 }}\n\
         layout = {{ kind = \"arrays\", feeds = {{ x = \"x\", y = \"y\" }} }}\n\
         [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.1\n"
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_str().unwrap();
    ok(&pipetrain(&["train", config]));
    let files = |root: &std::path::Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut all = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                match e.path().is_dir() {
                    true => dirs.push(e.path()),
                    false => all.push((
                        e.path().strip_prefix(root).unwrap().to_path_buf(),
                        std::fs::read(e.path()).unwrap(),
                    )),
                }
            }
        }
        all.sort();
        all
    };
    let first = files(&ck);
    assert!(first.iter().any(|(p, _)| p.ends_with("manifest.json")));

    let out = pipetrain(&["train", config]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{err}");
    for said in ["checkpoints_dir", "step-00000004", "--resume", "--fresh"] {
        assert!(err.contains(said), "no `{said}` in: {err}");
    }
    assert!(
        files(&ck) == first,
        "the refused run changed the checkpoints"
    );

    let out = pipetrain(&["train", config, "--fresh"]);
    let text = ok(&out);
    let aside = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("ck.before-")
        })
        .unwrap_or_else(|| panic!("nothing moved aside: {text}"));
    assert!(text.contains(&aside.display().to_string()), "{text}");
    assert!(files(&aside) == first, "the moved checkpoints differ");
    assert!(
        ck.join("step-00000004/manifest.json").exists(),
        "the fresh run's checkpoint"
    );
    let err = String::from_utf8_lossy(&pipetrain(&["train", config, "--resume", "--fresh"]).stderr)
        .to_string();
    assert!(err.contains("cannot be used with"), "{err}");
}
