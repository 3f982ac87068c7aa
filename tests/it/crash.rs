//! Crash safety: `pipetrain train --resume` killed with SIGKILL at 20 moments while it
//! writes (and deletes) checkpoints. After every kill, each checkpoint that `--resume`
//! would accept loads completely (every shard's length and CRC-32), and `--resume`
//! picks the newest of them; restarted again and again, the job finishes with the
//! weights of a run that was never interrupted.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::mlp::Mlp;
use pipetrain::checkpoint::{folder_name, latest_complete, list, LoadedCheckpoint};

const STEPS: usize = 60;
const KILLS: usize = 20;

fn config(dir: &Path, slow_ms: u64) -> std::path::PathBuf {
    let mlp = Mlp {
        steps: STEPS,
        extra: format!(
            "checkpoints_dir = \"{}\"\ncheckpoint_period = 1\nmax_num_checkpoints = 3\n\
             [debug]\ncheckpoint_write_delay_ms = {slow_ms}\n",
            dir.join("ck").display()
        ),
        ..Mlp::default()
    };
    mlp.config(dir).1
}

fn pipetrain(config: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    c.args(["train", config.to_str().unwrap(), "--resume"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// The folders of `root` being written (`.tmp-`) or deleted (`.del-`) now.
fn in_progress(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-") || n.starts_with(".del-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the checkpoint after `steps` steps, or a later one, is being written.
fn writing_from(root: &Path, steps: u64) -> bool {
    in_progress(root).iter().any(|n| {
        n.strip_prefix(".tmp-step-")
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|s| s >= steps)
    })
}

/// Every checkpoint `--resume` would accept loads completely; the newest one is what it
/// takes. Returns its steps.
fn check_after_kill(root: &Path) -> u64 {
    let mut newest = 0;
    for l in list(root).unwrap() {
        if l.manifest.is_ok() {
            LoadedCheckpoint::open(&l.path).unwrap_or_else(|e| {
                panic!("{} was accepted but does not load: {e}", l.path.display())
            });
            newest = newest.max(l.steps_done);
        }
    }
    let latest = latest_complete(root)
        .unwrap()
        .map_or(0, |(_, m)| m.steps_done);
    assert_eq!(
        latest, newest,
        "--resume must take the newest complete checkpoint"
    );
    latest
}

#[test]
fn kills_while_saving_lose_nothing() {
    let reference = tempfile::tempdir().unwrap();
    let status = pipetrain(&config(reference.path(), 0)).status().unwrap();
    assert!(status.success());
    let want = LoadedCheckpoint::open(&reference.path().join("ck").join(folder_name(STEPS as u64)))
        .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), 2);
    let root = tmp.path().join("ck");
    let mut during_writes = 0;
    let mut progress = Vec::new();
    let mut resumed_from = 0;
    for i in 0..KILLS {
        // What the next run removes first; gone now, so that only its own writes count.
        for n in in_progress(&root) {
            std::fs::remove_dir_all(root.join(n)).unwrap();
        }
        let mut child = pipetrain(&cfg).spawn().unwrap();
        // Wait until the run writes its first, second or third checkpoint, then a
        // varying delay (0 to 19 ms) into that write.
        let target = resumed_from + 1 + (i as u64 % 3);
        let start = Instant::now();
        while !writing_from(&root, target) && start.elapsed() < Duration::from_secs(60) {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_millis((i as u64 * 7) % 20));
        let was_busy = !in_progress(&root).is_empty();
        child.kill().unwrap();
        let exit = child.wait().unwrap();
        if exit.code().is_none() && was_busy {
            during_writes += 1;
        }
        resumed_from = check_after_kill(&root);
        progress.push(resumed_from);
    }
    eprintln!("checkpoint reached after each kill: {progress:?}; {during_writes} of {KILLS} kills landed while a checkpoint was being written or deleted");
    assert!(
        during_writes >= KILLS / 2,
        "only {during_writes} kills landed during a write"
    );
    assert!(
        progress.last() > progress.first(),
        "the job made no progress across restarts"
    );

    // Restarted until done, the job's weights and optimizer state are the uninterrupted
    // run's, bit for bit.
    let status = pipetrain(&cfg).status().unwrap();
    assert!(status.success());
    let got = LoadedCheckpoint::open(&root.join(folder_name(STEPS as u64))).unwrap();
    for (name, shape) in want.parameters() {
        let n: usize = shape.iter().product();
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        want.copy_param(name, shape, &mut a).unwrap();
        got.copy_param(name, shape, &mut b).unwrap();
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name} differs from the uninterrupted run"
        );
        want.copy_state("momentum_buffer", name, shape, &mut a)
            .unwrap();
        got.copy_state("momentum_buffer", name, shape, &mut b)
            .unwrap();
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}: momentum"
        );
    }
}
