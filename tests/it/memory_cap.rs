//! A process's peak memory, predicted before its sessions open (`train::peak`), against
//! the peak it measured; and a run predicted over the process's memory cap, refused
//! before it trains with the layouts that would fit.
//!
//! The model is a GPT-2 whose parameters outweigh its activations (6 layers of width
//! 1,024, 16 tokens, AdamW with two micro-batches): at pp = 1 its state alone is 1.2 GB
//! (parameters, gradients and two moments; the second micro-batch's gradients are added
//! as they are made), at pp = 2 half of that per rank.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const CONFIG: &str = r#"
batch_size = 2
gradient_accumulation_steps = 2
num_train_steps = 4
output_path = "out/model.onnx"
[model]
kind = "gpt2"
layers = 6
d_model = 1024
heads = 8
vocab = 256
seq = 16
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = { kind = "language", samples = 256, seq = 16, vocab = 256, seed = 7 }
layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-3
"#;

/// The configuration as `name.toml`, with `top` keys first and `tail` tables last.
fn config(dir: &Path, name: &str, top: &str, tail: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, format!("{top}{CONFIG}{tail}")).unwrap();
    path
}

/// The cap under which one process is refused and two pipeline ranks train.
const CAP: u64 = 1_200_000_000;

fn train(config: &Path, metrics: &Path, cgroup: Option<&Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    c.arg("train").arg(config).arg("--metrics").arg(metrics);
    if let Some(g) = cgroup {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let procs = std::ffi::CString::new(g.join("cgroup.procs").as_os_str().as_bytes()).unwrap();
        // SAFETY: between fork and exec the child only makes system calls (no allocation:
        // another thread of this process may have held malloc's lock at the fork).
        unsafe {
            c.pre_exec(move || join_cgroup(&procs));
        }
    }
    c.output().unwrap()
}

/// Writes this process's id into the cgroup's `procs` file, with system calls only.
fn join_cgroup(procs: &std::ffi::CStr) -> std::io::Result<()> {
    let mut digits = [0u8; 20];
    let mut pid = std::process::id();
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    // SAFETY: a NUL-terminated path; a buffer of the bytes written; the descriptor closed.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = digits.len() - start;
        let written = libc::write(fd, digits[start..].as_ptr().cast(), n);
        libc::close(fd);
        match written == n as isize {
            true => Ok(()),
            false => Err(std::io::Error::last_os_error()),
        }
    }
}

/// `(measured, predicted)` GB from the closing line "peak memory of this process: X GB
/// (predicted Y GB)".
fn peaks(stderr: &str) -> (f64, f64) {
    let line = stderr
        .lines()
        .find_map(|l| l.split("peak memory of this process: ").nth(1))
        .unwrap_or_else(|| panic!("no peak memory line in:\n{stderr}"));
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

#[test]
fn the_predicted_peak_is_within_a_quarter_of_the_measured_one() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "wide_gpt", "", "");
    let out = train(&cfg, &dir.path().join("m.jsonl"), None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (measured, predicted) = peaks(&stderr);
    // Parameters, gradients, two moments and a micro-batch's gradients: 1 GB.
    assert!(measured > 1.0, "{stderr}");
    assert!(
        (predicted - measured).abs() <= 0.25 * measured,
        "predicted {predicted} GB, measured {measured} GB"
    );
}

/// A memory cgroup of `bytes` for one child, where this machine lets us make one (cgroup
/// v1's memory controller, as root); `None` elsewhere.
fn memory_cgroup(name: &str, bytes: u64) -> Option<PathBuf> {
    let root = Path::new("/sys/fs/cgroup/memory");
    let g = root.join(format!("pipetrain-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&g).ok()?;
    match std::fs::write(g.join("memory.limit_in_bytes"), bytes.to_string()) {
        Ok(()) => Some(g),
        Err(_) => {
            let _ = std::fs::remove_dir(&g);
            None
        }
    }
}

#[test]
fn a_run_over_its_memory_cap_is_refused_before_it_trains_saying_what_would_fit() {
    let dir = tempfile::tempdir().unwrap();
    let cgroup = memory_cgroup("one", CAP);
    let cfg = config(dir.path(), "wide_gpt", "", &cap_unless(cgroup.is_some()));
    let metrics = dir.path().join("m.jsonl");
    let out = train(&cfg, &metrics, cgroup.as_deref());
    if let Some(g) = &cgroup {
        let _ = std::fs::remove_dir(g);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("is predicted to need"), "{stderr}");
    assert!(
        stderr.contains("over its memory cap of 1.20 GB"),
        "{stderr}"
    );
    assert!(stderr.contains("state 1.2"), "{stderr}");
    assert!(
        stderr.contains("would fit: pipeline_parallel_size = 2 ("),
        "{stderr}"
    );
    // Refused before the first step: no step was recorded, no model written.
    let steps = std::fs::read_to_string(&metrics).unwrap_or_default();
    assert!(steps.trim().is_empty(), "{steps}");
    assert!(!dir.path().join("out/model.onnx").exists());
}

#[test]
fn a_run_over_the_cap_warns_and_goes_on_where_refusing_is_off() {
    // Only the configuration's cap: a cgroup would stop the run for real.
    let dir = tempfile::tempdir().unwrap();
    let tail = format!(
        "[runtime]\nmemory_limit_gb = {}\nrefuse_over_memory_cap = false\n",
        CAP as f64 / 1e9
    );
    let cfg = config(dir.path(), "warned", "", &tail);
    let metrics = dir.path().join("m.jsonl");
    let out = train(&cfg, &metrics, None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("over its memory cap of 1.20 GB"),
        "{stderr}"
    );
    assert!(stderr.contains("going on"), "{stderr}");
    assert_eq!(crate::common::launch::losses(&metrics).len(), 2);
}

/// `[runtime] memory_limit_gb` at [`CAP`] where no cgroup holds the process to it.
fn cap_unless(cgroup: bool) -> String {
    match cgroup {
        true => String::new(),
        false => {
            eprintln!("no memory cgroup can be made here: the cap is [runtime] memory_limit_gb");
            format!("[runtime]\nmemory_limit_gb = {}\n", CAP as f64 / 1e9)
        }
    }
}

/// A manifest of two loopback nodes, a pipeline of two ranks.
fn two_node_manifest(dir: &Path) -> PathBuf {
    let rdzv = crate::common::launch::free_port();
    let port = std::iter::repeat_with(crate::common::launch::free_port)
        .find(|&p| p.abs_diff(rdzv) > 1)
        .unwrap();
    let secret = dir.join("cluster.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut text = format!(
        "[job]\nname = \"capped\"\nrendezvous = \"127.0.0.1:{rdzv}\"\nheartbeat_ms = 100\n\
         peer_timeout_s = 10\nconnect_timeout_s = 20\nsecret_file = \"cluster.secret\"\n\
         [layout]\ndata_parallel = 1\npipeline_parallel = 2\n"
    );
    for (i, n) in ["a", "b"].iter().enumerate() {
        text += &format!(
            "[[nodes]]\nname = \"{n}\"\naddress = \"127.0.0.{}\"\nport = {port}\ncpu_slots = 1\n",
            i + 1
        );
    }
    let path = dir.join("manifest.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn two_pipeline_ranks_train_under_the_cap_that_refuses_one_process() {
    use crate::common::launch::{losses, stderr};
    let dir = tempfile::tempdir().unwrap();
    let groups: Vec<Option<PathBuf>> = ["a", "b"].iter().map(|n| memory_cgroup(n, CAP)).collect();
    let capped = cap_unless(groups.iter().all(Option::is_some));
    let two = "pipeline_parallel_size = 2\n";
    let cfg = config(dir.path(), "ranks", two, &capped);
    let m = two_node_manifest(dir.path());
    let metrics = dir.path().join("ranks.jsonl");
    let children: Vec<_> = ["a", "b"]
        .iter()
        .zip(&groups)
        .map(|(n, g)| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
            c.arg("launch")
                .arg("--manifest")
                .arg(&m)
                .args(["--node", n, "--metrics"])
                .arg(&metrics)
                .arg(&cfg)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            if let Some(g) = g {
                use std::os::unix::ffi::OsStrExt;
                use std::os::unix::process::CommandExt;
                let procs =
                    std::ffi::CString::new(g.join("cgroup.procs").as_os_str().as_bytes()).unwrap();
                // SAFETY: as in `train`: system calls only between fork and exec.
                unsafe {
                    c.pre_exec(move || join_cgroup(&procs));
                }
            }
            c.spawn().unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    // memory.failcnt also counts the times the kernel reclaimed page cache at the limit
    // (files the ranks read and write, charged to their cgroup), which a busy machine's
    // test run does now and then: the OOM killer's count is what says a rank did not fit.
    let oom_kills: Vec<String> = groups
        .iter()
        .flatten()
        .map(|g| {
            let control = std::fs::read_to_string(g.join("memory.oom_control")).unwrap_or_default();
            let kills = control.lines().find_map(|l| l.strip_prefix("oom_kill "));
            kills.unwrap_or("0").trim().to_string()
        })
        .collect();
    for g in groups.iter().flatten() {
        let _ = std::fs::remove_dir(g);
    }
    for o in &outs {
        assert!(o.status.success(), "a rank failed:\n{}", stderr(o));
        let said = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(o);
        for l in said.lines().filter(|l| l.contains("peak memory")) {
            println!("rank: {l}");
        }
    }
    // Neither rank's cgroup killed a process at its limit.
    assert!(oom_kills.iter().all(|k| k == "0"), "{oom_kills:?}");
    // The same layout in one process, uncapped: the same losses, bit for bit.
    let one = config(dir.path(), "one", two, "");
    let single = dir.path().join("one.jsonl");
    let out = train(&one, &single, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (job, reference) = (losses(&metrics), losses(&single));
    assert_eq!(job.len(), 2);
    assert_eq!(job, reference);
}
