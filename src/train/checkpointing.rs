//! A run's checkpoints: what it resumes from, and the checkpointer that saves it.

use std::path::PathBuf;
use std::sync::Arc;

use pipetrain_actors::{CheckpointSettings, CommitState, LossScaling, ShardFile};

use crate::checkpoint::{
    latest_complete, now_unix_s, DataPosition, DirCheckpointer, Layout, LoadedCheckpoint, LrInfo,
    Manifest, ModelInfo, OptimizerInfo, ScalerInfo, Settings, FORMAT, FORMAT_VERSION,
};
use crate::config::TrainConfig;
use crate::{Error, Result};

/// The newest complete checkpoint in `cfg`'s `checkpoints_dir`: what `--resume` takes.
///
/// # Errors
/// `Config` when `checkpoints_dir` is not set; `Io` when it cannot be read.
pub fn latest_checkpoint(
    cfg: &TrainConfig,
    config_path: &std::path::Path,
) -> Result<Option<PathBuf>> {
    let dir = cfg.checkpoints_dir.as_ref().ok_or_else(|| Error::Config {
        path: config_path.to_path_buf(),
        field: "checkpoints_dir".into(),
        rule: "--resume looks for the latest checkpoint there; set it".into(),
    })?;
    Ok(latest_complete(dir)?.map(|(path, _)| path))
}

/// What a run started without `--resume` does with a `checkpoints_dir` that holds an
/// earlier run's complete checkpoints: refuse it (it would write over them), or, with
/// `fresh`, move the folder aside first. Returns where it moved it. `resume_command` is
/// the command line that would go on from them, for the message. A run that names its
/// checkpoint (`checkpoint_to_load_path`) resumes on purpose and is let through.
///
/// # Errors
/// `Config` on `checkpoints_dir` naming the newest checkpoint and both ways on; `Io`
/// when the folder cannot be read or moved.
pub fn claim_checkpoints_dir(
    cfg: &TrainConfig,
    config_path: &std::path::Path,
    fresh: bool,
    resume_command: &str,
) -> Result<Option<PathBuf>> {
    let Some(dir) = cfg.checkpoints_dir.as_ref() else {
        return Ok(None);
    };
    if cfg.checkpoint_to_load_path.is_some() {
        return Ok(None);
    }
    let Some((newest, manifest)) = latest_complete(dir)? else {
        return Ok(None);
    };
    if !fresh {
        return Err(Error::Config {
            path: config_path.to_path_buf(),
            field: "checkpoints_dir".into(),
            rule: format!(
                "{} holds an earlier run's checkpoints (the newest: {}, after {} optimizer \
                 steps), which this run would write over; go on from them with \
                 `{resume_command}`, or start again with `--fresh`, which moves them aside",
                dir.display(),
                newest.display(),
                manifest.steps_done
            ),
        });
    }
    let aside = aside_name(dir);
    std::fs::rename(dir, &aside).map_err(Error::io(dir))?;
    Ok(Some(aside))
}

/// A new sibling name for `dir`: `<dir>.before-<unix seconds>` (`-2`, `-3`, ... when taken).
fn aside_name(dir: &std::path::Path) -> PathBuf {
    // `a/b/` would name a folder inside `a/b`: the path without its trailing slash.
    let dir = dir.components().as_path();
    let base = format!("{}.before-{}", dir.display(), now_unix_s());
    (1..)
        .map(|i| match i {
            1 => PathBuf::from(&base),
            i => PathBuf::from(format!("{base}-{i}")),
        })
        .find(|p| !p.exists())
        .expect("some name is free")
}

/// The checkpoint `cfg` resumes from (`checkpoint_to_load_path`), read and checked
/// against the run: settings that must not change, and the model's tensors.
///
/// # Errors
/// `Checkpoint` naming the file and what differs or is damaged.
pub(super) fn load_resume(
    cfg: &TrainConfig,
    fingerprint: &str,
) -> Result<(Option<LoadedCheckpoint>, Vec<String>)> {
    let Some(path) = &cfg.checkpoint_to_load_path else {
        return Ok((None, Vec::new()));
    };
    let ckpt = LoadedCheckpoint::open(path)?;
    let mut warnings = Vec::new();
    for change in crate::checkpoint::check_resume(&ckpt.manifest, path, cfg, fingerprint)? {
        tracing::warn!("resuming {}: {change}", path.display());
        warnings.push(format!("resuming {}: {change}", path.display()));
    }
    let total = cfg.optimizer_steps() as u64;
    if ckpt.manifest.steps_done > total {
        return Err(Error::Checkpoint {
            path: path.clone(),
            reason: format!(
                "holds {} optimizer steps, more than the run's {total} (num_train_steps / gradient_accumulation_steps)",
                ckpt.manifest.steps_done
            ),
        });
    }
    Ok((Some(ckpt), warnings))
}

/// Facts of the run that every manifest repeats.
pub(super) struct RunFacts {
    pub layout: Layout,
    pub model: ModelInfo,
    pub optimizer: OptimizerInfo,
    pub settings: Settings,
    pub global_batch: usize,
    pub batch_order: Option<String>,
    pub order_len: Option<usize>,
    pub data_rows: usize,
}

impl RunFacts {
    /// The facts of `cfg`'s run over `batches`.
    /// `(order_len, rows)`: the steps of the data's batch order, and its rows (none and
    /// 0 for an embedder's data).
    pub fn new(
        cfg: &TrainConfig,
        (order_len, data_rows): (Option<usize>, usize),
        model: ModelInfo,
        state: Vec<String>,
        stages: usize,
    ) -> RunFacts {
        RunFacts {
            layout: Layout {
                data_parallel_size: cfg.data_parallel_size,
                pipeline_parallel_size: cfg.pipeline_parallel_size,
                virtual_stages: cfg.pipeline.virtual_stages,
                stages,
                schedule: serde_json::to_value(cfg.pipeline.schedule)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
            },
            settings: crate::checkpoint::settings_of(cfg, &model.fingerprint),
            model,
            optimizer: OptimizerInfo {
                config: cfg.optimizer.clone(),
                state,
            },
            global_batch: cfg.global_batch(),
            batch_order: cfg.data.batch_order.clone(),
            order_len,
            data_rows,
        }
    }

    /// Where the data stands after `steps_done` steps.
    fn data_position(&self, steps_done: u64) -> DataPosition {
        let sample_offset = steps_done * self.global_batch as u64;
        let (row, epoch) = match self.order_len {
            Some(n) => (Some(steps_done % n as u64), steps_done / n.max(1) as u64),
            None => (None, sample_offset / self.data_rows.max(1) as u64),
        };
        DataPosition {
            next_step: steps_done,
            global_batch: self.global_batch,
            sample_offset,
            batch_order: self.batch_order.clone(),
            batch_order_row: row,
            epoch,
            shuffle_seed: None,
        }
    }
}

/// The checkpoint settings of `cfg` (none without `checkpoints_dir`): a checkpoint after
/// every `checkpoint_period` steps and after the last.
///
/// # Errors
/// `Io` when the checkpoints folder cannot be made.
pub(super) fn checkpointer(
    cfg: &TrainConfig,
    facts: RunFacts,
) -> Result<Option<CheckpointSettings>> {
    let Some(root) = &cfg.checkpoints_dir else {
        return Ok(None);
    };
    let lr = cfg.lr_schedule.clone();
    let total = cfg.optimizer_steps() as u64;
    let mode = match cfg.grad_policy().scaling {
        LossScaling::Static(_) => "static",
        LossScaling::Dynamic(_) => "dynamic",
    };
    let make = move |state: CommitState, shards: Vec<ShardFile>| Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        pipetrain_version: env!("CARGO_PKG_VERSION").into(),
        steps_done: state.steps_done,
        created_unix_s: now_unix_s(),
        layout: facts.layout.clone(),
        model: facts.model.clone(),
        optimizer: facts.optimizer.clone(),
        lr_schedule: LrInfo {
            config: lr.clone(),
            step: state.steps_done,
            total_steps: total,
            next_lr: lr.lr_at(state.steps_done, total),
        },
        data: facts.data_position(state.steps_done),
        loss_scaler: ScalerInfo {
            mode: mode.into(),
            state: state.scaler,
        },
        settings: facts.settings.clone(),
        shards,
    };
    let store = DirCheckpointer::new(root, cfg.max_num_checkpoints, Arc::new(make))?;
    Ok(Some(CheckpointSettings {
        every: cfg.checkpoint_period.map_or(u64::MAX, |p| p as u64),
        checkpointer: Arc::new(store),
    }))
}
