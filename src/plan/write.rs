//! A candidate as a configuration: the user's file with the layout's keys set, every
//! other setting (and comment-free formatting aside, every value) kept.

use std::path::{Path, PathBuf};

use crate::config::ScheduleKind;
use crate::graph::Recompute;
use crate::{Error, Result};

use super::{plan_error, PlanRow};

/// The keys that make a run write files of the user's (the model, checkpoints, logs) or
/// evaluate: left out of the planner's own runs.
pub(super) const SIDE_EFFECTS: &[&str] = &[
    "output_path",
    "model_with_loss_func_path",
    "model_with_training_graph_path",
    "checkpoints_dir",
    "checkpoint_period",
    "checkpoint_to_load_path",
    "log_dir",
    "evaluation_period",
    "eval_data",
];

/// A configuration's text as a TOML table.
///
/// # Errors
/// `Config` when `text` (read from `path`) is not TOML.
pub(super) fn table(text: &str, path: &Path) -> Result<toml::Table> {
    toml::from_str(text).map_err(|e| Error::Config {
        path: path.to_path_buf(),
        field: String::new(),
        rule: e.to_string(),
    })
}

/// `text` (a configuration read from `from`) with `row`'s layout, its relative paths
/// made absolute when it will be read from another folder (`to`'s). Where `steps` is
/// given (a measured run), it runs that many optimizer steps and writes nothing; where
/// `threads` is (a job of several processes on one machine, each of which would take
/// every core), each session runs that many intra-op threads.
///
/// # Errors
/// `Config` when `text` is not TOML.
pub fn candidate_text(
    text: &str,
    (from, to): (&Path, &Path),
    row: &PlanRow,
    (steps, threads): (Option<usize>, Option<usize>),
) -> Result<String> {
    let mut t = table(text, from)?;
    let c = &row.candidate;
    if steps.is_some() {
        // A measured run writes nothing of the user's: no model, checkpoints or logs.
        for key in SIDE_EFFECTS {
            t.remove(*key);
        }
    }
    let int = |v: usize| toml::Value::Integer(v as i64);
    t.insert("data_parallel_size".into(), int(c.dp));
    t.insert("horizontal_parallel_size".into(), int(c.tp));
    t.insert("pipeline_parallel_size".into(), int(c.pp));
    if t.contains_key("world_size") {
        t.insert("world_size".into(), int(c.dp * c.tp * c.pp));
    }
    t.insert("batch_size".into(), int(c.micro_batch));
    // Step counts are in micro-batches (ONNX Runtime's TrainingRunner's): kept at the
    // same optimizer steps.
    let m0 = t
        .get("gradient_accumulation_steps")
        .and_then(|v| v.as_integer())
        .unwrap_or(1)
        .max(1) as usize;
    for key in ["num_train_steps", "display_loss_steps"] {
        let was = t.get(key).and_then(|v| v.as_integer()).map(|v| v as usize);
        let optimizer_steps = match (key, steps) {
            ("num_train_steps", Some(s)) => Some(s),
            _ => was.map(|w| w / m0),
        };
        if let Some(o) = optimizer_steps.filter(|&o| o > 0) {
            t.insert(key.into(), int(o * c.micro_batches));
        }
    }
    t.insert("gradient_accumulation_steps".into(), int(c.micro_batches));
    let recompute = match c.recompute {
        Recompute::None => "none",
        Recompute::Stage => "stage",
    };
    t.insert("recompute".into(), recompute.into());
    match c.zero {
        0 => t.remove("deepspeed_zero_stage"),
        z => t.insert("deepspeed_zero_stage".into(), int(z as usize)),
    };
    let mut pipeline = toml::Table::new();
    pipeline.insert("schedule".into(), c.schedule.name().into());
    if c.schedule == ScheduleKind::Interleaved1f1b {
        pipeline.insert("virtual_stages".into(), int(c.virtual_stages));
    }
    if !row.cuts.is_empty() {
        let cuts: Vec<toml::Value> = row.cuts.iter().map(|s| s.as_str().into()).collect();
        let mut partition = toml::Table::new();
        partition.insert("cut_at".into(), cuts.into());
        pipeline.insert("partition".into(), partition.into());
    }
    t.insert("pipeline".into(), pipeline.into());
    if let Some(n) = threads {
        let runtime = t
            .entry("runtime")
            .or_insert_with(|| toml::Table::new().into());
        if let Some(r) = runtime.as_table_mut() {
            r.insert("intra_op_threads".into(), int(n));
        }
    }
    let folder = |p: &Path| std::path::absolute(p.parent().unwrap_or(Path::new("."))).ok();
    if folder(from) != folder(to) {
        absolute_paths(&mut t, from.parent().unwrap_or(Path::new(".")));
    }
    toml::to_string(&t).map_err(|e| plan_error("the plan's configuration", e.to_string()))
}

/// Writes `row`'s configuration (from the user's at `config`, `threads` intra-op
/// threads a session where given) to `out`, its first line saying how the plan chose
/// it (`chosen`: "the layout it predicted fastest", say).
///
/// # Errors
/// `Io` when a file cannot be read or written.
pub fn write_config(
    config: &Path,
    row: &PlanRow,
    threads: Option<usize>,
    (out, chosen): (&Path, &str),
) -> Result<()> {
    let text = std::fs::read_to_string(config).map_err(Error::io(config))?;
    let body = candidate_text(&text, (config, out), row, (None, threads))?;
    let header = format!("# Written by `pipetrain plan`: {chosen}.\n");
    crate::onnx::save_bytes(out, format!("{header}{body}").as_bytes())
}

/// Makes the configuration's relative file paths absolute, against `base`.
fn absolute_paths(t: &mut toml::Table, base: &Path) {
    let fix = |v: &mut toml::Value| {
        if let Some(s) = v.as_str() {
            let p = PathBuf::from(s);
            if p.is_relative() && !s.is_empty() {
                let joined = std::path::absolute(base.join(p)).unwrap_or_default();
                *v = joined.display().to_string().into();
            }
        }
    };
    for key in [
        "model_path",
        "init_path",
        "output_path",
        "model_with_loss_func_path",
        "model_with_training_graph_path",
        "checkpoints_dir",
        "checkpoint_to_load_path",
        "log_dir",
    ] {
        if let Some(v) = t.get_mut(key) {
            fix(v);
        }
    }
    for data in ["data", "eval_data"] {
        let Some(d) = t.get_mut(data).and_then(|d| d.as_table_mut()) else {
            continue;
        };
        if let Some(v) = d.get_mut("path") {
            fix(v);
        }
        if let Some(s) = d.get_mut("shards").and_then(|s| s.as_table_mut()) {
            for key in ["train_data_dir", "test_data_dir"] {
                if let Some(v) = s.get_mut(key) {
                    fix(v);
                }
            }
        }
    }
}
