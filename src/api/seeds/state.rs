//! ORT's `CheckpointState`: what a [`Module`] and [`Optimizer`] start from, and saving
//! them as a pipetrain checkpoint.

use std::path::{Path, PathBuf};

use pipetrain_actors::GradPolicy;

use super::module::{Module, Optimizer};
use crate::checkpoint::{self, LoadedCheckpoint, Manifest};
use crate::optim::LrSchedule;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The state a [`Module`] and [`Optimizer`] start from: a pipetrain checkpoint
/// (parameters and optimizer state by name), initial weights from a safetensors file,
/// or the model's own initializers.
pub struct CheckpointState {
    pub(super) loaded: Option<LoadedCheckpoint>,
    pub(super) init: Option<(PathBuf, std::collections::HashMap<String, Tensor>)>,
}

impl CheckpointState {
    /// The model's own initializers (what ORT's artifacts' first checkpoint holds).
    pub fn initial() -> CheckpointState {
        CheckpointState {
            loaded: None,
            init: None,
        }
    }

    /// Initial weights from a safetensors file (as `init_path`), or the model's own when
    /// `None`.
    ///
    /// # Errors
    /// `Io` / `Data` naming the file.
    pub fn from_init(path: Option<&Path>) -> Result<CheckpointState> {
        let init = match path {
            Some(p) => Some((p.to_path_buf(), crate::data::read_safetensors(p)?)),
            None => None,
        };
        Ok(CheckpointState { loaded: None, init })
    }

    /// A checkpoint folder written by `pipetrain train` or [`CheckpointState::save`].
    ///
    /// # Errors
    /// `Checkpoint` naming what is missing or damaged.
    pub fn load(dir: &Path) -> Result<CheckpointState> {
        Ok(CheckpointState {
            loaded: Some(LoadedCheckpoint::open(dir)?),
            init: None,
        })
    }

    /// Writes the module's parameters and the optimizer's state to `dir` as a pipetrain
    /// checkpoint (a new folder: written beside, then renamed into place).
    ///
    /// # Errors
    /// `Io` naming a file that cannot be written.
    pub fn save(module: &Module, optimizer: &Optimizer, dir: &Path) -> Result<()> {
        let tmp = dir.with_extension("tmp-save");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(Error::io(&tmp))?;
        // The stage is locked while its state is written (and not after: the manifest
        // reads it too).
        let shards = {
            let stage = module.stage();
            let (layout, params, opt) = stage.state();
            let job = checkpoint::save_job(
                0,
                &tmp,
                checkpoint::StageState {
                    layout,
                    params,
                    optimizer: opt,
                    stats: &[],
                    shard: None,
                    zero: None,
                },
                None,
                &Default::default(),
            )?;
            job().map_err(|e| Error::Checkpoint {
                path: tmp.clone(),
                reason: e.to_string(),
            })?
        };
        let manifest = manifest(module, optimizer, shards);
        manifest.write_synced(&tmp)?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(Error::io(dir))?;
        }
        std::fs::rename(&tmp, dir).map_err(Error::io(dir))
    }
}

/// The manifest of a checkpoint of `module` and `optimizer` holding `shards`.
fn manifest(
    module: &Module,
    optimizer: &Optimizer,
    shards: Vec<pipetrain_actors::ShardFile>,
) -> Manifest {
    let cfg = optimizer.config.clone();
    let params = module.stage().host_parameters();
    Manifest {
        format: checkpoint::FORMAT.into(),
        format_version: checkpoint::FORMAT_VERSION,
        pipetrain_version: env!("CARGO_PKG_VERSION").into(),
        steps_done: module.steps,
        created_unix_s: checkpoint::now_unix_s(),
        layout: checkpoint::Layout {
            data_parallel_size: 1,
            pipeline_parallel_size: 1,
            virtual_stages: 1,
            stages: 1,
            schedule: "1f1b".into(),
        },
        model: checkpoint::ModelInfo {
            path: module.model_path.clone(),
            spec: None,
            fingerprint: module.fingerprint.clone(),
            tensors: params.len(),
            parameters: params.iter().map(|(_, t)| t.len() as u64).sum(),
        },
        optimizer: checkpoint::OptimizerInfo {
            config: cfg.clone(),
            state: module.stage().optimizer_state_names(),
        },
        lr_schedule: checkpoint::LrInfo {
            config: LrSchedule {
                lr: optimizer.lr,
                ..LrSchedule::default()
            },
            step: module.steps,
            total_steps: module.steps,
            next_lr: optimizer.lr,
        },
        data: checkpoint::DataPosition {
            next_step: module.steps,
            global_batch: 0,
            sample_offset: 0,
            batch_order: None,
            batch_order_row: None,
            epoch: 0,
            shuffle_seed: None,
        },
        loss_scaler: checkpoint::ScalerInfo {
            mode: "static".into(),
            state: GradPolicy::default().scaling.initial_state(),
        },
        settings: checkpoint::Settings::new(
            [
                ("model".to_string(), serde_json::json!(module.fingerprint)),
                (
                    "loss".to_string(),
                    serde_json::to_value(&module.loss).unwrap_or_default(),
                ),
            ]
            .into(),
            Default::default(),
        ),
        shards,
    }
}
