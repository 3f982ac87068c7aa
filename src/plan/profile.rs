//! What each forward node of a model costs on this machine, and what its backward costs,
//! split into the input-gradient and weight-gradient parts: measured by ONNX Runtime's
//! own profiler (`enable_profiling`) on a few real training steps of the model, one
//! stage, in a `pipetrain train` process of its own (so the profile's memory and threads
//! are not the planner's, and its files land in a folder of their own).
//!
//! A node's kernel events are found by name: the sessions run the training graph's nodes
//! under their own names (the backward's are `grad/<forward node>/...`). Kernel
//! time ONNX Runtime spends in nodes it made itself (its fusions) is spread over the
//! session's named nodes in proportion; [`Profile::unmatched`] says how much that was.
//!
//! The profiler's own bookkeeping slows the run it records, so its times give only each
//! node's share: a second run without it (our trace) gives the passes' true times, and
//! a third the one-graph forward and backward that a single stage runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::ort_profile::{read_profile, Counting};

use crate::graph::TrainingGraph;
use crate::{Error, Result};

/// Per forward node, seconds per micro-batch on one stage running `threads` intra-op
/// threads, micro-batches of `micro_batch` samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Intra-op threads the sessions ran.
    pub threads: usize,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Each forward node's kernels.
    pub forward: Vec<f64>,
    /// Each backward node's (`tg.graph.nodes[tg.forward_len..]`) kernels.
    pub backward: Vec<f64>,
    /// A micro-batch's forward and backward as one graph (one stage, unsplit schedule).
    pub fused: f64,
    /// The optimizer step's seconds per parameter value.
    pub step_per_value: f64,
    /// What each action costs beside its compute (the actors' hand-over, feeding the
    /// micro-batch, accumulating): the one-stage run's step less its actions' time,
    /// shared over its actions.
    pub action_gap: f64,
    /// Share of kernel time in nodes ONNX Runtime made itself, spread by proportion.
    pub unmatched: f64,
}

impl Profile {
    /// Sum of every node's forward and backward: one micro-batch's compute.
    pub fn total(&self) -> f64 {
        self.forward.iter().chain(&self.backward).sum()
    }
}

/// How to run a profile: the `pipetrain` binary, the user's configuration (its file and
/// its text), and how many steps to run and skip.
pub struct ProfileRun<'a> {
    /// The `pipetrain` executable.
    pub worker: &'a Path,
    /// The configuration file (relative paths in it stay relative to its folder).
    pub config: &'a Path,
    /// Optimizer steps run; the first `warmup` are left out of the averages.
    pub steps: usize,
    /// Steps not counted.
    pub warmup: usize,
}

/// The three runs of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunKind {
    /// Split backward, ONNX Runtime's profiler on: how the time divides among nodes.
    Profiled,
    /// Split backward, no profiler: the passes' true times (the profiler's own cost
    /// left out).
    Timed,
    /// One graph for forward and backward (what one stage of an unsplit schedule runs).
    Fused,
    /// [`RunKind::Fused`] in two replicas at once: how much two actions slow each other.
    FusedPair,
}

/// Profiles `tg`'s model at `threads` threads and `micro_batch` samples per micro-batch:
/// the nodes' shares from ONNX Runtime's profile, scaled to the passes' times measured
/// without the profiler.
///
/// # Errors
/// `Plan` when a profile run fails or its files cannot be read.
pub fn measure(
    run: &ProfileRun<'_>,
    tg: &TrainingGraph,
    threads: usize,
    micro_batch: usize,
) -> Result<Profile> {
    let what = format!("profiling at {threads} thread(s), micro-batches of {micro_batch}");
    let fail = |reason: String| Error::Plan {
        what: what.clone(),
        reason,
    };
    let counting = Counting {
        steps: run.steps,
        micro_batches: global_batch(run.config)? / micro_batch,
        warmup: run.warmup,
    };
    let (forward, backward, unmatched) =
        in_folder(run, (threads, micro_batch), RunKind::Profiled, |dir| {
            read_profile(dir, tg, counting)
        })
        .map_err(&fail)?;
    let timed = in_folder(run, (threads, micro_batch), RunKind::Timed, |dir| {
        pass_seconds(&dir.join("trace.json"), run.warmup)
    })
    .map_err(&fail)?;
    let fused = in_folder(run, (threads, micro_batch), RunKind::Fused, |dir| {
        pass_seconds(&dir.join("trace.json"), run.warmup)
    })
    .map_err(&fail)?;
    let rescale = |v: Vec<f64>, to: f64, of: f64| -> Vec<f64> {
        let k = if of > 0.0 { to / of } else { 0.0 };
        v.into_iter().map(|x| x * k).collect()
    };
    let profiled_fwd: f64 = forward.iter().sum();
    let profiled_bwd: f64 = backward.iter().sum();
    let values: usize = tg.params.iter().map(|p| p.meta.numel()).sum();
    Ok(Profile {
        threads,
        micro_batch,
        forward: rescale(forward, timed.forward, profiled_fwd),
        backward: rescale(backward, timed.backward, profiled_bwd),
        fused: fused.forward + fused.backward,
        step_per_value: timed.step / values.max(1) as f64,
        action_gap: fused.gap,
        unmatched,
    })
}

/// How much two one-stage actions running at once (two replicas, each on cores of its
/// own) slow each other: their mean forward-and-backward time over one alone's, less 1.
///
/// # Errors
/// `Plan` when a run fails.
pub fn contention(run: &ProfileRun<'_>, alone: &Profile) -> Result<f64> {
    let key = (alone.threads, alone.micro_batch);
    let pair = in_folder(run, key, RunKind::FusedPair, |dir| {
        pass_seconds(&dir.join("trace.json"), run.warmup)
    })
    .map_err(|reason| Error::Plan {
        what: "measuring two replicas at once".into(),
        reason,
    })?;
    Ok(((pair.forward + pair.backward) / alone.fused - 1.0).max(0.0))
}

/// Runs the profile config of `kind` in a folder of its own and reads it with `read`.
fn in_folder<T>(
    run: &ProfileRun<'_>,
    (threads, micro_batch): (usize, usize),
    kind: RunKind,
    read: impl FnOnce(&Path) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let dir = std::env::temp_dir().join(format!(
        "pipetrain-plan-{}-{threads}-{micro_batch}-{kind:?}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let outcome = profile_config(run, (threads, micro_batch), kind)
        .map_err(|e| e.to_string())
        .and_then(|config| {
            let ran = run_worker(run.worker, &config, &dir);
            let _ = std::fs::remove_file(&config);
            ran
        })
        .and_then(|()| read(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// The user's configuration with one stage, one replica, `micro_batch` samples per
/// micro-batch (the global batch kept), the split backward (so forward and backward run
/// in sessions of their own), ONNX Runtime's profiler on, and nothing written but the
/// profile: next to the user's file, so its relative paths hold.
fn profile_config(
    run: &ProfileRun<'_>,
    (threads, micro_batch): (usize, usize),
    kind: RunKind,
) -> Result<PathBuf> {
    let text = std::fs::read_to_string(run.config).map_err(Error::io(run.config))?;
    let cfg = crate::config::TrainConfig::parse(&text, run.config)?;
    let global = cfg.global_batch();
    if micro_batch == 0 || global % micro_batch != 0 {
        return Err(Error::Plan {
            what: "profile".into(),
            reason: format!(
                "micro-batches of {micro_batch} do not divide the global batch {global}"
            ),
        });
    }
    let mut t: toml::Table = toml::from_str(&text).map_err(|e| Error::Config {
        path: run.config.to_path_buf(),
        field: String::new(),
        rule: e.to_string(),
    })?;
    for key in [
        "output_path",
        "model_with_loss_func_path",
        "model_with_training_graph_path",
        "checkpoints_dir",
        "checkpoint_period",
        "checkpoint_to_load_path",
        "log_dir",
        "evaluation_period",
        "eval_data",
        "world_size",
        "enable_adasum",
        "deepspeed_zero_stage",
        "recompute",
        "histogram_names",
        "debug",
    ] {
        t.remove(key);
    }
    let int = |v: usize| toml::Value::Integer(v as i64);
    t.insert("batch_size".into(), int(micro_batch));
    let replicas = if kind == RunKind::FusedPair { 2 } else { 1 };
    if global % (micro_batch * replicas) != 0 {
        return Err(Error::Plan {
            what: "profile".into(),
            reason: format!("{replicas} replicas of micro-batches of {micro_batch} do not divide the global batch {global}"),
        });
    }
    let micro_batches = global / (micro_batch * replicas);
    t.insert("gradient_accumulation_steps".into(), int(micro_batches));
    // Counted in micro-batches, as ONNX Runtime's TrainingRunner counts them.
    let micro_steps = run.steps * micro_batches;
    t.insert("num_train_steps".into(), int(micro_steps));
    t.insert("display_loss_steps".into(), int(micro_steps));
    t.insert("data_parallel_size".into(), int(replicas));
    t.insert("pipeline_parallel_size".into(), int(1));
    t.insert("horizontal_parallel_size".into(), int(1));
    let mut pipeline = toml::Table::new();
    let schedule = match kind {
        RunKind::Fused | RunKind::FusedPair => "1f1b",
        RunKind::Profiled | RunKind::Timed => "zb_h1",
    };
    pipeline.insert("schedule".into(), schedule.into());
    t.insert("pipeline".into(), pipeline.into());
    let runtime = t
        .entry("runtime")
        .or_insert_with(|| toml::Table::new().into());
    if let Some(r) = runtime.as_table_mut() {
        r.insert("profile".into(), (kind == RunKind::Profiled).into());
        r.insert("intra_op_threads".into(), int(threads));
    }
    let name = format!(
        ".pipetrain-plan-{}-{threads}-{micro_batch}-{kind:?}.toml",
        std::process::id()
    );
    let path = run.config.parent().unwrap_or(Path::new(".")).join(name);
    let text = toml::to_string(&t).map_err(|e| Error::Plan {
        what: "profile".into(),
        reason: e.to_string(),
    })?;
    std::fs::write(&path, text).map_err(Error::io(&path))?;
    Ok(path)
}

/// The configuration's global batch.
fn global_batch(config: &Path) -> Result<usize> {
    Ok(crate::config::TrainConfig::load(config)?.global_batch())
}

/// Runs `pipetrain train CONFIG --trace trace.json` in `dir`.
fn run_worker(worker: &Path, config: &Path, dir: &Path) -> std::result::Result<(), String> {
    let config = std::path::absolute(config).map_err(|e| e.to_string())?;
    let out = Command::new(worker)
        .arg("train")
        .arg(&config)
        .arg("--trace")
        .arg("trace.json")
        .current_dir(dir)
        .output()
        .map_err(|e| format!("{}: {e}", worker.display()))?;
    if out.status.success() {
        return Ok(());
    }
    // Its error, not the log lines before it.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let error = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| stderr.trim());
    Err(format!("the profile run failed ({}): {error}", out.status))
}

/// A one-stage run's mean seconds per micro-batch for its forward and its backward
/// (`B`, or `I` and `W` together), and per step for its update.
#[derive(Debug, Clone, Copy, Default)]
struct Passes {
    forward: f64,
    backward: f64,
    step: f64,
    /// Mean seconds per compute action of the step that no action accounts for.
    gap: f64,
}

/// [`Passes`] from a run's trace, the first `warmup` steps left out.
fn pass_seconds(trace: &Path, warmup: usize) -> std::result::Result<Passes, String> {
    use pipetrain_schedules::ActionKind as K;
    let text = std::fs::read(trace).map_err(|e| format!("{}: {e}", trace.display()))?;
    let run: pipetrain_actors::RunTrace =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", trace.display()))?;
    let counted = run.steps.len().saturating_sub(warmup);
    if counted == 0 {
        return Err(format!(
            "{}: no step recorded after warm-up",
            trace.display()
        ));
    }
    let mut p = Passes::default();
    let mut micro_batches = 0usize;
    let events = run.steps[warmup..]
        .iter()
        .filter_map(|replicas| replicas.first())
        .flat_map(|t| t.ranks.iter().flatten());
    for e in events {
        let secs = (e.end_ns - e.start_ns) as f64 * 1e-9;
        match e.action.kind() {
            K::Forward => {
                p.forward += secs;
                micro_batches += 1;
            }
            K::Backward | K::BackwardInput | K::BackwardWeight => p.backward += secs,
            K::OptimizerStep => p.step += secs,
            _ => {}
        }
    }
    let mbs = micro_batches.max(1) as f64;
    let starts: Vec<u64> = run.steps[warmup..]
        .iter()
        .filter_map(|replicas| replicas.first())
        .filter_map(|t| t.ranks.iter().flatten().map(|e| e.start_ns).min())
        .collect();
    let gap = match starts.len() {
        0 | 1 => 0.0,
        n => {
            let period = (starts[n - 1] - starts[0]) as f64 * 1e-9 / (n - 1) as f64;
            let busy = (p.forward + p.backward + p.step) / counted as f64;
            let actions = 2.0 * mbs / counted as f64;
            ((period - busy) / actions).max(0.0)
        }
    };
    Ok(Passes {
        forward: p.forward / mbs,
        backward: p.backward / mbs,
        step: p.step / counted as f64,
        gap,
    })
}
