//! `pipetrain train` stopped by SIGTERM or SIGINT loses no work: the first signal finishes
//! the steps in flight, saves a checkpoint of the step it stopped after, prints where
//! it stopped and exits with 128 + the signal; `--resume` then ends with the weights and
//! optimizer state of a run that was never stopped, bit for bit. A second signal exits
//! at once and leaves the checkpoint it interrupted incomplete, which `--resume` skips.
//! The trained model a stopped run writes says in its metadata that it is partly trained.
//!
//! The model is the GPT-2 fixture (tied embedding) at pp = 2 with 2 micro-batches per
//! step and AdamW, so signals land between the micro-batches of a step, and during
//! checkpoint writes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pipetrain::checkpoint::{folder_name, latest_complete};

const STEPS: u64 = 400;

fn fixture(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/gpt2")
        .join(file)
}

/// A run of `STEPS` steps checkpointing every 100 into `dir/ck`, each checkpoint file
/// written in pieces `write_delay_ms` apart.
fn config(dir: &Path, write_delay_ms: u64) -> PathBuf {
    let text = format!(
        "model_path = {model:?}\nbatch_size = 2\ngradient_accumulation_steps = 2\n\
         pipeline_parallel_size = 2\nnum_train_steps = {passes}\ndisplay_loss_steps = 1000\n\
         checkpoints_dir = {ck:?}\ncheckpoint_period = 100\noutput_path = {out:?}\n\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"labels\"\n\n\
         [data]\npath = {data:?}\nlayout = {{ kind = \"arrays\", feeds = {{ input_ids = \"input_ids\", labels = \"labels\" }} }}\n\n\
         [optimizer]\nkind = \"adamw\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 0.001\n\n\
         [debug]\ncheckpoint_write_delay_ms = {write_delay_ms}\n",
        model = fixture("model.onnx"),
        data = fixture("data.npz"),
        passes = STEPS * 2,
        ck = dir.join("ck"),
        out = dir.join("model.onnx"),
    );
    let path = dir.join("train.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn start(config: &Path, metrics: &Path, resume: bool) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    c.arg("train").arg(config).arg("--metrics").arg(metrics);
    if resume {
        c.arg("--resume");
    }
    c.stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Steps reported so far in the metrics file.
fn steps_seen(metrics: &Path) -> usize {
    std::fs::read_to_string(metrics).map_or(0, |t| t.lines().count())
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_micros(300));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child process of ours that has not been waited for yet.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill");
}

/// Waits for `child`; its exit code and stderr.
fn finish(child: Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Folders of `root` being written now.
fn being_written(root: &Path) -> Vec<String> {
    std::fs::read_dir(root).map_or(Vec::new(), |d| {
        d.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect()
    })
}

/// The checkpoint's tensor files (weights and optimizer state), by name.
fn tensor_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no tensors in {}", dir.display());
    files
}

/// The step a stopped run says it stopped after, checked against its newest complete
/// checkpoint.
fn stopped_after(stderr: &str, root: &Path, sig: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("stopped by {sig} after step")))
        .unwrap_or_else(|| panic!("no stop line in:\n{stderr}"));
    let step: u64 = line
        .split("after step ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    let (_, manifest) = latest_complete(root).unwrap().unwrap();
    assert_eq!(manifest.steps_done, step, "the stop's checkpoint");
    step
}

/// The trained model's metadata: optimizer steps trained, of how many, and whether all.
fn trained_steps(model: &Path) -> (String, String, String) {
    let m = pipetrain::onnx::load_model(model).unwrap();
    let get = |key: &str| {
        m.metadata_props
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.clone())
            .unwrap_or_else(|| panic!("no {key} in {}", model.display()))
    };
    use pipetrain::graph::{COMPLETE_KEY, STEPS_KEY, TOTAL_KEY};
    (get(STEPS_KEY), get(TOTAL_KEY), get(COMPLETE_KEY))
}

/// The moments a first signal lands at: after some steps (between micro-batches, as
/// most moments of a step are), and while a periodic checkpoint is being written.
#[test]
fn a_signal_stops_with_a_checkpoint_and_resume_is_bitwise() {
    let reference = tempfile::tempdir().unwrap();
    let cfg = config(reference.path(), 0);
    let (code, err) = finish(start(&cfg, &reference.path().join("m.jsonl"), false));
    assert_eq!(code, Some(0), "{err}");
    let want = tensor_files(&reference.path().join("ck").join(folder_name(STEPS)));

    let moments: [(&str, i32, u64, bool); 3] = [
        ("SIGTERM", libc::SIGTERM, 37, false),
        ("SIGINT", libc::SIGINT, 151, false),
        ("SIGTERM", libc::SIGTERM, 100, true),
    ];
    for (name, sig, after, in_write) in moments {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ck");
        let cfg = config(tmp.path(), if in_write { 20 } else { 0 });
        let metrics = tmp.path().join("m.jsonl");
        let child = start(&cfg, &metrics, false);
        if in_write {
            wait_for("a checkpoint write", || !being_written(&root).is_empty());
        } else {
            wait_for("the steps", || steps_seen(&metrics) >= after as usize);
        }
        signal(&child, sig);
        let (code, err) = finish(child);
        assert_eq!(code, Some(128 + sig), "{name} after {after}: {err}");
        let step = stopped_after(&err, &root, name);
        assert!(
            step >= after && step < STEPS,
            "{name}: stopped after step {step}"
        );
        assert!(being_written(&root).is_empty(), "a write was left behind");
        assert_eq!(
            trained_steps(&tmp.path().join("model.onnx")),
            (step.to_string(), STEPS.to_string(), "false".into()),
            "the stopped run's model says it is partly trained"
        );
        assert!(
            err.contains(&format!(
                "partly trained model: {}",
                tmp.path().join("model.onnx").display()
            )),
            "{err}"
        );

        let (code, err) = finish(start(&cfg, &metrics, true));
        assert_eq!(code, Some(0), "resume after {name} at step {step}: {err}");
        assert_eq!(
            trained_steps(&tmp.path().join("model.onnx")),
            (STEPS.to_string(), STEPS.to_string(), "true".into())
        );
        let got = tensor_files(&root.join(folder_name(STEPS)));
        assert!(
            got == want,
            "stopped by {name} after step {step} and resumed: not the uninterrupted run's weights"
        );
        eprintln!("{name} (after step {after}, in a write: {in_write}): stopped after step {step}, resumed bitwise");
    }
}

/// A second signal, past the grace for repeats, while the stop's checkpoint is being
/// written: the process exits at once, the write stays incomplete (`--resume` takes the
/// checkpoint before it), and the job still ends bitwise as the uninterrupted run.
#[test]
fn a_second_signal_exits_at_once_and_leaves_no_checkpoint_as_good() {
    let reference = tempfile::tempdir().unwrap();
    let cfg = config(reference.path(), 0);
    let (code, err) = finish(start(&cfg, &reference.path().join("m.jsonl"), false));
    assert_eq!(code, Some(0), "{err}");
    let want = tensor_files(&reference.path().join("ck").join(folder_name(STEPS)));

    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ck");
    // Each checkpoint file is written in 8 pieces 250 ms apart: about 2 s a file.
    let cfg = config(tmp.path(), 250);
    let metrics = tmp.path().join("m.jsonl");
    let child = start(&cfg, &metrics, false);
    wait_for("the checkpoint of step 100", || {
        root.join(folder_name(100)).join("manifest.json").exists()
    });
    wait_for("the steps", || steps_seen(&metrics) >= 120);
    signal(&child, libc::SIGTERM);
    wait_for("the stop's checkpoint write", || {
        !being_written(&root).is_empty()
    });
    std::thread::sleep(pipetrain::train::REPEAT_GRACE + Duration::from_millis(200));
    signal(&child, libc::SIGTERM);
    let stopped = Instant::now();
    let (code, err) = finish(child);
    assert_eq!(code, Some(128 + libc::SIGTERM), "{err}");
    assert!(
        stopped.elapsed() < Duration::from_secs(1),
        "the second signal took {:?}",
        stopped.elapsed()
    );
    assert!(err.contains("again: stopping at once"), "{err}");
    assert!(
        !being_written(&root).is_empty(),
        "the interrupted write should stay incomplete"
    );
    let (_, newest) = latest_complete(&root).unwrap().unwrap();
    assert_eq!(
        newest.steps_done, 100,
        "--resume must skip the incomplete checkpoint"
    );

    let fast = config(tmp.path(), 0);
    let (code, err) = finish(start(&fast, &metrics, true));
    assert_eq!(code, Some(0), "{err}");
    assert!(
        tensor_files(&root.join(folder_name(STEPS))) == want,
        "not the uninterrupted run's weights"
    );
}
