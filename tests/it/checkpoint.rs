//! Checkpoints: exact resume, resume under another parallel layout, the files as other
//! tools read them, and refusals of checkpoints that do not fit.

use crate::common;

use std::path::{Path, PathBuf};

use crate::common::mlp::{Mlp, ADAMW_COSINE, SGD_MOMENTUM};
use pipetrain::checkpoint::{folder_name, latest_complete, LoadedCheckpoint};
use pipetrain::compute::Runtime;
use pipetrain::tensor::Tensor;
use pipetrain::Error;

/// What a run did: its per-step losses (by step index) and final parameters, by name.
struct Outcome {
    losses: Vec<(u64, f64)>,
    params: Vec<(String, Tensor)>,
}

fn run(rt: &Runtime, mlp: &Mlp, dir: &Path, extra: &str) -> Result<Outcome, Error> {
    let mut m = mlp.clone();
    m.extra.push_str(extra);
    let (cfg, path) = m.config(dir);
    let mut losses = Vec::new();
    let s = pipetrain::train::train(rt, &cfg, &path, false, |r| losses.push((r.step, r.loss)))?;
    let mut params = s.parameters;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Outcome { losses, params })
}

fn bits(p: &[(String, Tensor)]) -> Vec<(String, Vec<u32>)> {
    p.iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

fn ckpt_dir(dir: &Path) -> PathBuf {
    dir.join("ckpts")
}

fn saving(dir: &Path, period: usize) -> String {
    format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = {period}\n",
        ckpt_dir(dir).display()
    )
}

fn loading(path: &Path) -> String {
    format!("checkpoint_to_load_path = \"{}\"\n", path.display())
}

/// 20 steps straight, and 10 + resume + 10, give bitwise the same weights and losses:
/// parameters, optimizer state, step counts, learning-rate position and data position
/// all come back.
#[test]
fn resume_is_bit_exact() {
    let rt = common::runtime();
    let cases = [
        ("pp=2 1F1B, SGD momentum", 1, 2, "1f1b", SGD_MOMENTUM),
        ("pp=2 ZB-H1, SGD momentum", 1, 2, "zb_h1", SGD_MOMENTUM),
        ("pp=2 1F1B, AdamW cosine", 1, 2, "1f1b", ADAMW_COSINE),
        ("pp=2 ZB-H1, AdamW cosine", 1, 2, "zb_h1", ADAMW_COSINE),
        ("pp=2 ZB-V, AdamW cosine", 1, 2, "zb_v", ADAMW_COSINE),
        ("dp=2, SGD momentum", 2, 1, "1f1b", SGD_MOMENTUM),
        ("dp=2, AdamW cosine", 2, 1, "1f1b", ADAMW_COSINE),
    ];
    for (name, dp, pp, schedule, optimizer) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let mlp = Mlp {
            dp,
            pp,
            accum: 8 / dp,
            schedule,
            optimizer,
            ..Mlp::default()
        };
        let straight = run(&rt, &mlp, tmp.path(), &saving(tmp.path(), 10)).unwrap();
        assert_eq!(straight.losses.len(), 20, "{name}");
        let half = ckpt_dir(tmp.path()).join(folder_name(10));
        let other = tempfile::tempdir().unwrap();
        let resumed = run(&rt, &mlp, other.path(), &loading(&half)).unwrap();
        assert_eq!(
            resumed.losses,
            straight.losses[10..],
            "{name}: losses after the resume"
        );
        assert!(
            bits(&resumed.params) == bits(&straight.params),
            "{name}: weights differ after the resume"
        );
    }
}

/// Largest |a - b| over a tensor, relative to the tensor's largest |a| (as
/// `tests/it/equivalence.rs` measures a changed reduction order).
fn max_rel_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            let (x, y) = (ta.to_f64_vec(), tb.to_f64_vec());
            let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            x.iter()
                .zip(&y)
                .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()))
                / scale
        })
        .fold(0.0, f64::max)
}

/// A checkpoint written at (dp, pp) = (1, 2) resumes at (2, 1), (1, 4) and (1, 1) with
/// the same global batch: the same samples in the same order (the data position), and the
/// weights of the uninterrupted run up to the float32 rounding of another reduction order
/// (the tolerance of `tests/it/equivalence.rs`); pipeline-only changes are bitwise.
#[test]
fn resume_under_another_layout() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let written = Mlp::default();
    let straight = run(&rt, &written, tmp.path(), &saving(tmp.path(), 10)).unwrap();
    let half = ckpt_dir(tmp.path()).join(folder_name(10));
    for (dp, pp) in [(2, 1), (1, 4), (1, 1)] {
        let other = tempfile::tempdir().unwrap();
        let layout = Mlp {
            dp,
            pp,
            accum: 8 / dp,
            ..Mlp::default()
        };
        let resumed = run(
            &rt,
            &layout,
            other.path(),
            &(loading(&half) + &saving(other.path(), 10)),
        )
        .unwrap();
        let steps: Vec<u64> = resumed.losses.iter().map(|l| l.0).collect();
        assert_eq!(steps, (10..20).collect::<Vec<_>>());
        let last = LoadedCheckpoint::open(&ckpt_dir(other.path()).join(folder_name(20))).unwrap();
        assert_eq!(last.manifest.data.sample_offset, 20 * 64);
        assert_eq!(last.manifest.data.batch_order_row, Some(20));
        assert_eq!(
            (
                last.manifest.layout.data_parallel_size,
                last.manifest.layout.pipeline_parallel_size
            ),
            (dp, pp)
        );
        let diff = max_rel_diff(&straight.params, &resumed.params);
        let loss_diff = straight.losses[10..]
            .iter()
            .zip(&resumed.losses)
            .map(|(a, b)| (a.1 - b.1).abs())
            .fold(0.0, f64::max);
        eprintln!("(1,2) -> ({dp},{pp}): weights {diff:.3e} relative, losses {loss_diff:.3e}");
        if dp == 1 {
            assert_eq!(diff, 0.0, "pipeline-only layout change must be bitwise");
            assert_eq!(loss_diff, 0.0);
        } else {
            assert!(diff <= 1e-5, "(1,2) -> ({dp},{pp}): {diff:.3e}");
            assert!(
                loss_diff <= 1e-5,
                "(1,2) -> ({dp},{pp}): losses {loss_diff:.3e}"
            );
        }
    }
}

/// The weight files are plain safetensors: Python's `safetensors` package reads them by
/// the ONNX initializer names, with the values pipetrain trained.
#[test]
fn python_safetensors_reads_the_weights() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        steps: 3,
        ..Mlp::default()
    };
    let out = run(&rt, &mlp, tmp.path(), &saving(tmp.path(), 3)).unwrap();
    let dir = ckpt_dir(tmp.path()).join(folder_name(3));
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `bash scripts/setup.sh`",
        python.display()
    );
    let script = r#"
import glob, json, sys
from safetensors.numpy import load_file
out = {}
for f in sorted(glob.glob(sys.argv[1] + "/stage-*.params.safetensors")):
    for name, a in load_file(f).items():
        out[name] = [list(a.shape), str(a.dtype), [int(v) for v in a.reshape(-1)[:4].view("uint32")], float(a.astype("float64").sum())]
print(json.dumps(out))
"#;
    let res = std::process::Command::new(&python)
        .args(["-c", script, dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(read.as_object().unwrap().len(), out.params.len());
    for (name, t) in &out.params {
        let v = &read[name];
        let shape: Vec<usize> = serde_json::from_value(v[0].clone()).unwrap();
        assert_eq!(shape, t.shape, "{name}");
        assert_eq!(v[1], "float32");
        let values = t.as_f32().unwrap();
        let first: Vec<u32> = serde_json::from_value(v[2].clone()).unwrap();
        let want: Vec<u32> = values.iter().take(4).map(|x| x.to_bits()).collect();
        assert_eq!(first, want, "{name}: the first values, bit for bit");
        let sum: f64 = values.iter().map(|&x| f64::from(x)).sum();
        let got = v[3].as_f64().unwrap();
        assert!(
            (got - sum).abs() <= 1e-9 * sum.abs().max(1.0),
            "{name}: {got} vs {sum}"
        );
    }
}

/// Keep-N deletes the oldest once a newer one is complete; a checkpoint follows the last
/// step; `--resume` takes the newest complete one and skips a folder without manifest.
#[test]
fn retention_and_the_latest_complete_checkpoint() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        steps: 7,
        ..Mlp::default()
    };
    run(
        &rt,
        &mlp,
        tmp.path(),
        &(saving(tmp.path(), 2) + "max_num_checkpoints = 2\n"),
    )
    .unwrap();
    let root = ckpt_dir(tmp.path());
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![folder_name(6), folder_name(7)],
        "2, 4 deleted; 7 is the last step"
    );
    // A newer folder without its manifest (a crash before the commit) is never taken.
    let broken = root.join(folder_name(9));
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("stage-000.params.safetensors"), b"partial").unwrap();
    let (latest, m) = latest_complete(&root).unwrap().unwrap();
    assert_eq!(latest, root.join(folder_name(7)));
    assert_eq!(m.steps_done, 7);
}

/// The error of a run that must not start, as text.
fn refusal(rt: &Runtime, mlp: &Mlp, dir: &Path, extra: &str) -> String {
    match run(rt, mlp, dir, extra) {
        Ok(_) => panic!("the run should have been refused: {extra}"),
        Err(e) => e.to_string(),
    }
}

/// Checkpoints that do not fit are refused before training, naming the file and what
/// differs: another model, a truncated shard, an unknown format version, another
/// optimizer, a changed setting that must not change, an incomplete checkpoint.
#[test]
fn checkpoints_that_do_not_fit_are_refused() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        steps: 2,
        ..Mlp::default()
    };
    run(&rt, &mlp, tmp.path(), &saving(tmp.path(), 2)).unwrap();
    let good = ckpt_dir(tmp.path()).join(folder_name(2));
    let copy = |name: &str| -> PathBuf {
        let to = tmp.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    };
    let other = tempfile::tempdir().unwrap();
    let longer = Mlp {
        steps: 4,
        ..mlp.clone()
    };

    // Another optimizer kind.
    let e = refusal(
        &rt,
        &Mlp {
            optimizer: ADAMW_COSINE,
            ..longer.clone()
        },
        other.path(),
        &loading(&good),
    );
    assert!(
        e.contains("manifest.json") && e.contains("`optimizer.kind`"),
        "{e}"
    );
    assert!(e.contains("\"sgd\"") && e.contains("\"adamw\""), "{e}");

    // A setting that decides which samples a step reads.
    let mut half_batch = longer.clone();
    half_batch.global = 32;
    let e = refusal(&rt, &half_batch, other.path(), &loading(&good));
    assert!(
        e.contains("`global_batch` was 64") && e.contains("is 32"),
        "{e}"
    );

    // Another model: the peers' tiny GPT's checkpoint for the MLP run.
    let gpt_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny_gpt_sgd.toml");
    let mut gpt = pipetrain::config::TrainConfig::load(&gpt_path).unwrap();
    gpt.num_train_steps = 1;
    gpt.output_path = None;
    gpt.checkpoints_dir = Some(tmp.path().join("gpt"));
    pipetrain::train::train(&rt, &gpt, &gpt_path, false, |_| {}).unwrap();
    let gpt_ckpt = tmp.path().join("gpt").join(folder_name(1));
    let e = refusal(&rt, &longer, other.path(), &loading(&gpt_ckpt));
    assert!(
        e.contains("manifest.json") && e.contains("`model` was"),
        "{e}"
    );
    // The same check by tensors, for a model whose structure matches but not its
    // parameters' names or shapes.
    let ckpt = LoadedCheckpoint::open(&good).unwrap();
    let mut params: Vec<(String, Vec<usize>)> = ckpt
        .parameters()
        .iter()
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect();
    ckpt.check_model(&params).unwrap();
    params[0].1 = vec![7];
    let e = ckpt.check_model(&params).unwrap_err().to_string();
    assert!(e.contains(&format!("`{}` has shape", params[0].0)), "{e}");
    params[0].0 = "renamed".into();
    let e = ckpt.check_model(&params).unwrap_err().to_string();
    assert!(e.contains("no parameter `renamed`"), "{e}");

    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(good.join("manifest.json")).unwrap()).unwrap();
    // An unknown format version.
    let mut future = manifest.clone();
    future["format_version"] = 99.into();
    let newer = copy("newer");
    std::fs::write(newer.join("manifest.json"), future.to_string()).unwrap();
    let e = refusal(&rt, &longer, other.path(), &loading(&newer));
    assert!(
        e.contains("manifest.json") && e.contains("format_version") && e.contains("99"),
        "{e}"
    );

    // A truncated shard.
    let cut = copy("truncated");
    let shard = cut.join("stage-001.params.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.set_len(len / 2).unwrap();
    let e = refusal(&rt, &longer, other.path(), &loading(&cut));
    assert!(
        e.contains("stage-001.params.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // An altered shard of the right length.
    let altered = copy("altered");
    let shard = altered.join("stage-000.params.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x55;
    std::fs::write(&shard, bytes).unwrap();
    let e = refusal(&rt, &longer, other.path(), &loading(&altered));
    assert!(
        e.contains("stage-000.params.safetensors") && e.contains("CRC-32"),
        "{e}"
    );

    // No manifest: an incomplete checkpoint.
    let incomplete = copy("incomplete");
    std::fs::remove_file(incomplete.join("manifest.json")).unwrap();
    let e = refusal(&rt, &longer, other.path(), &loading(&incomplete));
    assert!(e.contains("incomplete"), "{e}");

    // A checkpoint further on than the run goes.
    let e = refusal(
        &rt,
        &Mlp {
            steps: 1,
            ..mlp.clone()
        },
        other.path(),
        &loading(&good),
    );
    assert!(e.contains("holds 2 optimizer steps"), "{e}");

    // The good one still resumes.
    run(&rt, &longer, other.path(), &loading(&good)).unwrap();
}

/// `pipetrain checkpoint inspect` describes a checkpoint (and a checkpoints folder), and
/// `pipetrain export --checkpoint` writes the inference model with its weights: the same
/// file the run's own `output_path` export wrote.
#[test]
fn inspect_and_export_from_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let trained = tmp.path().join("trained.onnx");
    let mlp = Mlp {
        steps: 4,
        extra: saving(tmp.path(), 2) + &format!("output_path = \"{}\"\n", trained.display()),
        ..Mlp::default()
    };
    let (_, config) = mlp.config(tmp.path());
    let bin = env!("CARGO_BIN_EXE_pipetrain");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    run(&["train", config.to_str().unwrap()]);
    let root = ckpt_dir(tmp.path());
    let last = root.join(folder_name(4));
    let listing = run(&["checkpoint", "inspect", root.to_str().unwrap()]);
    assert!(
        listing.contains("step-00000002  complete  step 2"),
        "{listing}"
    );
    assert!(
        listing.contains("step-00000004  complete  step 4"),
        "{listing}"
    );
    let one = run(&["checkpoint", "inspect", last.to_str().unwrap()]);
    for want in [
        "steps done   4",
        "data x pipeline = 1 x 2",
        "\"kind\":\"sgd\"",
        "state: momentum_buffer",
        "fc1.weight",
        "[512, 784]",
        "stage-001.params.safetensors",
        "batch order `batch_idx` row 4",
    ] {
        assert!(one.contains(want), "inspect should show {want:?}:\n{one}");
    }
    let exported = tmp.path().join("from_checkpoint.onnx");
    run(&[
        "export",
        "--checkpoint",
        last.to_str().unwrap(),
        "-o",
        exported.to_str().unwrap(),
    ]);
    let a = pipetrain::onnx::load_model(&trained).unwrap();
    let b = pipetrain::onnx::load_model(&exported).unwrap();
    assert!(
        a == b,
        "the export from the checkpoint differs from the run's own"
    );
}

/// The update decision waits for every stage; a rank holding two stages (interleaved
/// 1F1B) reports both at its first optimizer step, so clipping there neither deadlocks
/// nor changes the result beyond the rounding of the norm's sum over other cuts.
#[test]
fn clipping_with_two_stages_per_rank() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let plain = Mlp {
        steps: 3,
        extra: "max_grad_norm = 0.05\n".into(),
        ..Mlp::default()
    };
    let reference = run(&rt, &plain, tmp.path(), "").unwrap();
    let interleaved = Mlp {
        schedule: "interleaved_1f1b",
        virtual_stages: 2,
        ..plain
    };
    let (cfg, path) = interleaved.config(tmp.path());
    let s = pipetrain::train::train(&rt, &cfg, &path, false, |_| {}).unwrap();
    assert_eq!(s.stages, 4);
    let mut params = s.parameters;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let diff = max_rel_diff(&reference.params, &params);
    assert!(diff <= 1e-6, "{diff:e}");
}
