//! The profile's runs: the user's configuration made into a one-stage (or two-stage,
//! or two-replica) run that writes nothing of the user's, run by `pipetrain train` in a
//! folder of its own, and read back.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::config::ScheduleKind;
use crate::cost::Family;
use crate::{Error, Result};

use super::profile::ProfileRun;

/// The runs of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunKind {
    /// Split backward, ONNX Runtime's profiler on: how the time divides among nodes.
    Profiled,
    /// Split backward, no profiler: the passes' true times (the profiler's own cost
    /// left out).
    Timed,
    /// One graph for forward and backward (what one stage of an unsplit schedule runs).
    Fused,
    /// [`RunKind::Fused`] in two replicas at once: how much two actions slow each other.
    FusedPair,
    /// [`RunKind::FusedPair`] at ZeRO stage 2: what sharding the gradients costs.
    Zero2Pair,
    /// Two ranks under the schedule [`Family::run`] names: what cutting the model costs
    /// that family's stage actions; GPipe's also what a hand-off between stage actors
    /// takes.
    Pipeline(Family),
    /// The model cut in two by FLOPs, both stages on one rank (ZB-V at one rank): each
    /// stage's forward, input- and weight-gradient actions with nothing beside them,
    /// what the nodes' shares are set against (`shares`).
    Stages,
}

impl RunKind {
    /// What names its files.
    pub(super) fn tag(self) -> String {
        match self {
            RunKind::Pipeline(family) => format!("Pipeline{family:?}"),
            kind => format!("{kind:?}"),
        }
    }
}

/// Runs the profile config of `kind` in a folder of its own and reads it with `read`.
pub(super) fn in_folder<T>(
    run: &ProfileRun<'_>,
    (threads, micro_batch): (usize, usize),
    kind: RunKind,
    read: impl FnOnce(&Path) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let config = profile_config(run, (threads, micro_batch), kind).map_err(|e| e.to_string())?;
    let tag = format!("{threads}-{micro_batch}-{}-tp{}", kind.tag(), run.shards);
    run_and_read(run.worker, &config, &tag, read)
}

/// Runs the configuration written at `config` (removed after) by `pipetrain train` in a
/// temporary folder named by `tag`, reads the folder with `read`, then removes it.
pub(super) fn run_and_read<T>(
    worker: &Path,
    config: &Path,
    tag: &str,
    read: impl FnOnce(&Path) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let dir = std::env::temp_dir().join(format!("pipetrain-plan-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let outcome = std::fs::create_dir_all(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))
        .and_then(|()| run_worker(worker, config, &dir))
        .and_then(|()| read(&dir));
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// The user's configuration with one stage, one replica, `micro_batch` samples per
/// micro-batch (the global batch kept), the split backward (so forward and backward run
/// in sessions of their own), ONNX Runtime's profiler on, and nothing written but the
/// profile: next to the user's file, so its relative paths hold.
pub(super) fn profile_config(
    run: &ProfileRun<'_>,
    (threads, micro_batch): (usize, usize),
    kind: RunKind,
) -> Result<PathBuf> {
    let text = std::fs::read_to_string(run.config).map_err(Error::io(run.config))?;
    let global = run.global_batch;
    if micro_batch == 0 || global % micro_batch != 0 {
        return Err(Error::Plan {
            what: "profile".into(),
            reason: format!(
                "micro-batches of {micro_batch} do not divide the global batch {global}"
            ),
        });
    }
    let mut t = super::write::table(&text, run.config)?;
    for key in super::write::SIDE_EFFECTS.iter().chain(&[
        "world_size",
        "enable_adasum",
        "deepspeed_zero_stage",
        "recompute",
        "histogram_names",
        "debug",
    ]) {
        t.remove(*key);
    }
    let int = |v: usize| toml::Value::Integer(v as i64);
    t.insert("batch_size".into(), int(micro_batch));
    let replicas = match kind {
        RunKind::FusedPair | RunKind::Zero2Pair => 2,
        _ => 1,
    };
    if kind == RunKind::Zero2Pair {
        t.insert("deepspeed_zero_stage".into(), toml::Value::Integer(2));
    }
    let stages = match kind {
        RunKind::Pipeline(_) => 2,
        RunKind::Stages => 1,
        _ => run.stages,
    };
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
    t.insert("pipeline_parallel_size".into(), int(stages));
    t.insert("horizontal_parallel_size".into(), int(run.shards));
    let mut pipeline = toml::Table::new();
    let schedule = match kind {
        RunKind::Fused | RunKind::FusedPair | RunKind::Zero2Pair => "1f1b",
        RunKind::Profiled | RunKind::Timed => "zb_h1",
        RunKind::Stages => ScheduleKind::ZbV.name(),
        RunKind::Pipeline(family) => {
            let (schedule, virtual_stages) = family.run();
            if virtual_stages > 1 {
                pipeline.insert("virtual_stages".into(), int(virtual_stages));
            }
            schedule.name()
        }
    };
    pipeline.insert("schedule".into(), schedule.into());
    let cut_into = match kind {
        RunKind::Pipeline(family) => Some(family.run_stages()),
        RunKind::Stages => Some(ScheduleKind::ZbV.stages(stages, 1)),
        _ => None,
    };
    let cut = run.cuts.iter().find(|c| Some(c.stages) == cut_into);
    if let Some(cut) = cut {
        let names: Vec<toml::Value> = cut.names.iter().map(|n| n.as_str().into()).collect();
        let mut partition = toml::Table::new();
        partition.insert("cut_at".into(), names.into());
        pipeline.insert("partition".into(), partition.into());
    }
    t.insert("pipeline".into(), pipeline.into());
    let runtime = t
        .entry("runtime")
        .or_insert_with(|| toml::Table::new().into());
    if let Some(r) = runtime.as_table_mut() {
        r.insert("profile".into(), (kind == RunKind::Profiled).into());
        r.insert("intra_op_threads".into(), int(threads));
    }
    let name = format!(
        ".pipetrain-plan-{}-{threads}-{micro_batch}-{}-tp{}.toml",
        std::process::id(),
        kind.tag(),
        run.shards
    );
    let path = run.config.parent().unwrap_or(Path::new(".")).join(name);
    let text = toml::to_string(&t).map_err(|e| Error::Plan {
        what: "profile".into(),
        reason: e.to_string(),
    })?;
    std::fs::write(&path, text).map_err(Error::io(&path))?;
    Ok(path)
}

/// Runs `pipetrain train CONFIG --trace trace.json --metrics metrics.jsonl` in `dir`.
fn run_worker(worker: &Path, config: &Path, dir: &Path) -> std::result::Result<(), String> {
    let config = std::path::absolute(config).map_err(|e| e.to_string())?;
    let out = Command::new(worker)
        .arg("train")
        .arg(&config)
        .arg("--trace")
        .arg("trace.json")
        .arg("--metrics")
        .arg("metrics.jsonl")
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
    Err(format!("the run failed ({}): {error}", out.status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;

    #[test]
    fn each_family_s_run_is_its_schedule_on_two_ranks_cut_where_the_profile_says() {
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gpt2_tiny.toml");
        let global = TrainConfig::load(&config).unwrap().global_batch();
        let cut = |stages: usize, names: &[&str]| crate::cost::RunCut {
            stages,
            bounds: Vec::new(),
            names: names.iter().map(|n| n.to_string()).collect(),
        };
        let cuts = [cut(2, &["h"]), cut(4, &["e", "h", "l"])];
        let run = ProfileRun {
            worker: Path::new("pipetrain"),
            config: &config,
            steps: 3,
            warmup: 1,
            global_batch: global,
            pipelines: true,
            shards: 1,
            stages: 1,
            cuts: &cuts,
        };
        let written = |kind| {
            let path = profile_config(&run, (1, global / 2), kind).unwrap();
            let written = TrainConfig::load(&path);
            std::fs::remove_file(&path).unwrap();
            written.unwrap()
        };
        let cut_at = |cfg: &TrainConfig| match &cfg.pipeline.partition {
            Some(crate::graph::Partition::CutAt(names)) => names.join(" "),
            other => format!("{other:?}"),
        };
        for family in Family::ALL {
            let cfg = written(RunKind::Pipeline(family));
            let (schedule, virtual_stages) = family.run();
            assert_eq!(cfg.pipeline.schedule, schedule, "{family:?}");
            assert_eq!(cfg.pipeline.virtual_stages, virtual_stages, "{family:?}");
            assert_eq!(cfg.pipeline_parallel_size, 2);
            assert_eq!(cfg.global_batch(), global);
            let want = match cfg.stages() {
                2 => "h",
                _ => "e h l",
            };
            assert_eq!(cut_at(&cfg), want, "{family:?}");
        }
        // The one-rank run of two stages too; the one-stage runs cut nothing.
        assert_eq!(cut_at(&written(RunKind::Stages)), "h");
        assert_eq!(cut_at(&written(RunKind::Timed)), "None");
    }
}
