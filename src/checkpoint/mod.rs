//! Checkpoints: a run's state on disk, so that it outlives its process.
//!
//! # Layout
//! - `shard`: one stage's files, safetensors keyed by the ONNX initializer names
//!   (parameters; optimizer state as `<state>/<parameter>`), written and synced.
//! - `snapshot`: a stage's state encoded in memory for those files (pooled buffers).
//! - `manifest`: the JSON file written last that makes a folder a checkpoint: step,
//!   layout, optimizer, learning-rate and data position, loss scaler, fingerprints of
//!   the model and of the settings a resumed run must share, every shard's length and
//!   CRC-32.
//! - `store`: the checkpoints folder: temporary folder, manifest, atomic rename,
//!   keep-N retention ([`DirCheckpointer`]); finding the newest complete checkpoint.
//! - `load`: reading one back, checked and indexed by name ([`LoadedCheckpoint`]), so
//!   any (data, pipeline) layout takes its own tensors: a checkpoint written at
//!   (dp, pp) = (1, 2) resumes at (2, 1) or (1, 4) with no conversion step.
//! - `settings`: which settings must not change on resume, and the check.
//! - `inspect`: `pipetrain checkpoint inspect` and `pipetrain export --checkpoint`.
//!
//! Writes go through `pipetrain_actors`' checkpoint round: each stage actor snapshots its
//! state into a [`pipetrain_actors::SaveJob`] (this module's [`save_job`]); the
//! coordinator writes the jobs on blocking threads while training goes on, then calls
//! [`DirCheckpointer`]'s commit.

mod inspect;
mod load;
mod manifest;
mod settings;
mod shard;
mod snapshot;
mod store;

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

pub use inspect::{export, inspect};
pub use load::LoadedCheckpoint;
pub use manifest::{
    model_fingerprint, now_unix_s, DataPosition, Layout, LrInfo, Manifest, ModelInfo,
    OptimizerInfo, ScalerInfo, Settings, FORMAT, FORMAT_VERSION, MANIFEST,
};
pub use settings::{check_resume, settings_of};
pub use shard::{buffers_file, optimizer_file, params_file, state_key};
pub use snapshot::SnapshotBuffers;
pub use store::{
    folder_name, latest_complete, list, remove_unfinished, slow_write, to_delete, DirCheckpointer,
    Listed, ManifestFn,
};

use pipetrain_actors::SaveJob;

/// The one `__metadata__` key of pipetrain's shard files.
pub(crate) const META_KEY: &str = "pipetrain";

use crate::graph::tensor_parallel::ShardSpec;
use crate::optim::{Optimizer, ParamLayout};
use crate::{Error, Result};

/// What one stage saves.
pub struct StageState<'a> {
    /// Its parameters' names and shapes.
    pub layout: &'a ParamLayout,
    /// Their values, flat.
    pub params: &'a [f32],
    /// Their optimizer (its state is saved).
    pub optimizer: &'a dyn Optimizer,
    /// Running statistics: name, shape, values.
    pub stats: &'a [(String, &'a [usize], &'a [f32])],
    /// The tensor shard this is (`None`: the stage is not split).
    pub shard: Option<SavedShard<'a>>,
    /// With the optimizer state sharded across data-parallel replicas (ZeRO stage 1):
    /// this replica's rank and the tensors (layout indices) its optimizer holds. Rank 0
    /// saves the parameters and its part of the state; the others only their part.
    pub zero: Option<(usize, Range<usize>)>,
}

/// What a tensor shard of a stage saves: its part of every split parameter (and of its
/// optimizer state), and, shard 0 only, the replicated ones. The loader puts the parts
/// back together, so a checkpoint holds whole tensors for any layout to take.
#[derive(Clone, Copy)]
pub struct SavedShard<'a> {
    /// This shard.
    pub rank: usize,
    /// The split parameters (of the whole model) and how they are split.
    pub specs: &'a std::collections::BTreeMap<String, (ShardSpec, Vec<usize>)>,
}

impl SavedShard<'_> {
    /// Whether this shard saves parameter `name`.
    fn saves(&self, name: &str) -> bool {
        self.rank == 0 || self.specs.contains_key(name)
    }
}

/// Snapshots one stage's parameters and optimizer state (encoded here: one copy, into
/// buffers of `buffers`) into a job that writes and syncs
/// `dir/stage-NNN.params.safetensors` and, when the optimizer keeps state,
/// `dir/stage-NNN.optimizer.safetensors` (and its running statistics in
/// `dir/stage-NNN.buffers.safetensors`).
///
/// The job runs at the normal priority. A lower one looks kinder to the training beside
/// it, but ONNX Runtime's idle intra-op threads spin rather than sleep: a low-priority
/// writer then hardly runs, the next checkpoint waits for it, and the training with it
/// (measured on the peers' mlp: a checkpoint every 10 steps cost 27-35% of steps/s at
/// nice 19, 18% at the normal priority, before the writes went around the page cache).
///
/// # Errors
/// `Data` when the tensors cannot be encoded.
pub fn save_job(
    stage: usize,
    dir: &Path,
    state: StageState<'_>,
    slow: Option<Duration>,
    buffers: &SnapshotBuffers,
) -> Result<SaveJob> {
    let StageState {
        layout,
        params,
        optimizer,
        stats,
        shard,
        zero,
    } = state;
    let names = layout.names();
    let saved: Vec<usize> = (0..layout.count())
        .filter(|&i| shard.is_none_or(|s| s.saves(&names[i])))
        .collect();
    let split = split_of(layout, shard);
    let meta = |kind: &str| metadata(kind, stage, optimizer.step_count(), &split);
    let file = |name: String| {
        let name = match shard {
            Some(s) => name.replacen(".", &format!(".shard-{}.", s.rank), 1),
            None => name,
        };
        match zero {
            Some((rank, _)) if rank > 0 => name.replacen(".", &format!(".zero-{rank}."), 1),
            _ => name,
        }
    };
    let encode = |entries: &[snapshot::F32Entry<'_>], kind: &str, name: String| {
        let bytes = snapshot::encode(entries, meta(kind), &dir.join(&name), buffers)?;
        Ok::<_, Error>((name, bytes))
    };
    // Data-parallel rank 0 of a sharded optimizer, or an unsharded one, saves the
    // parameters and running statistics.
    let first = zero.as_ref().is_none_or(|(rank, _)| *rank == 0);
    let params = match first {
        true => {
            let param_entries = entries(layout, &saved, params, str::to_string);
            Some(encode(
                &param_entries,
                load::KIND_PARAMS,
                file(params_file(stage)),
            )?)
        }
        false => None,
    };
    let (held, state_layout) = match &zero {
        Some((_, tensors)) => (tensors.clone(), layout.part(tensors.clone())),
        None => (0..layout.count(), layout.clone()),
    };
    let state_saved: Vec<usize> = (saved.iter())
        .filter(|i| held.contains(i))
        .map(|i| i - held.start)
        .collect();
    let state = optimizer.state();
    let optim = match state.is_empty() {
        true => None,
        false => {
            let entries: Vec<_> = (state.iter())
                .flat_map(|(kind, buf)| {
                    entries(&state_layout, &state_saved, buf, |n| state_key(kind, n))
                })
                .collect();
            Some(encode(
                &entries,
                load::KIND_OPTIMIZER,
                file(optimizer_file(stage)),
            )?)
        }
    };
    let stats = match stats.is_empty() || shard.is_some_and(|s| s.rank != 0) || !first {
        true => None,
        false => Some(encode(stats, load::KIND_BUFFERS, buffers_file(stage))?),
    };
    let dir = dir.to_path_buf();
    Ok(Box::new(move || {
        let mut files = Vec::new();
        for (name, bytes) in params.into_iter().chain(optim).chain(stats) {
            files.push(shard::write_shard(&dir, &name, stage, &bytes, slow)?);
        }
        Ok(files)
    }))
}

/// The split parameters a shard holds parts of: `name -> [axis, sections, shards,
/// rank]`, for the loader (empty when the stage is not split).
fn split_of(
    layout: &ParamLayout,
    shard: Option<SavedShard<'_>>,
) -> serde_json::Map<String, serde_json::Value> {
    let Some(s) = shard else {
        return serde_json::Map::new();
    };
    let part = |n: &String| {
        let (spec, _) = s.specs.get(n)?;
        let v = serde_json::json!([spec.axis, spec.sections, spec.shards, s.rank]);
        Some((n.clone(), v))
    };
    layout.names().iter().filter_map(part).collect()
}

/// A file's metadata: one key holding sorted JSON. Safetensors keeps `__metadata__` in a
/// hash map, so several keys would come out in a different order each time, and the
/// same state would not give the same bytes.
fn metadata(
    kind: &str,
    stage: usize,
    step_count: u64,
    split: &serde_json::Map<String, serde_json::Value>,
) -> HashMap<String, String> {
    let mut info = serde_json::json!({
        "kind": kind,
        "stage": stage,
        "step_count": step_count,
    });
    if !split.is_empty() {
        info["split"] = serde_json::Value::Object(split.clone());
    }
    HashMap::from([(META_KEY.to_string(), info.to_string())])
}

/// The tensors `saved` (indices into `layout`) of `buf`, named `key(parameter name)`.
fn entries<'a>(
    layout: &'a ParamLayout,
    saved: &[usize],
    buf: &'a [f32],
    key: impl Fn(&str) -> String,
) -> Vec<snapshot::F32Entry<'a>> {
    let (names, shapes) = (layout.names(), layout.shapes());
    let entry = |&i: &usize| (key(&names[i]), shapes[i].as_slice(), layout.slice(buf, i));
    saved.iter().map(entry).collect()
}

/// Restores one stage's parameters and optimizer state from `ckpt`, by name.
///
/// # Errors
/// `Checkpoint` when a tensor is missing or of another shape; `BadTensor` when the
/// optimizer refuses the state. Nothing is changed on error.
pub fn restore_stage(
    ckpt: &LoadedCheckpoint,
    (layout, held): (&ParamLayout, Option<Range<usize>>),
    params: &mut [f32],
    optimizer: &mut dyn Optimizer,
    shard: Option<SavedShard<'_>>,
) -> Result<()> {
    let kinds: Vec<&'static str> = optimizer.state().iter().map(|(k, _)| *k).collect();
    // The tensors whose optimizer state this optimizer holds (ZeRO: its part).
    let held = held.unwrap_or(0..layout.count());
    // Everything is checked before anything is copied: all or nothing.
    for i in 0..layout.count() {
        let name = &layout.names()[i];
        let shape = whole_shape(shard, name).unwrap_or(&layout.shapes()[i]);
        ckpt.check_param(name, shape)?;
        for kind in kinds.iter().filter(|_| held.contains(&i)) {
            ckpt.check_state(kind, name, shape)?;
        }
    }
    let values = layout.values_of(held.clone());
    let mut buffers = Vec::with_capacity(kinds.len());
    for kind in &kinds {
        let mut buf = vec![0.0f32; values.len()];
        for i in held.clone() {
            let r = layout.range(i);
            let dst = &mut buf[r.start - values.start..r.end - values.start];
            copy_part(ckpt, Some(kind), layout, i, dst, shard)?;
        }
        buffers.push(buf);
    }
    let state: Vec<(&str, &[f32])> = kinds
        .iter()
        .zip(&buffers)
        .map(|(k, b)| (*k, b.as_slice()))
        .collect();
    optimizer.load_state(ckpt.optimizer_steps(), &state)?;
    for i in 0..layout.count() {
        let r = layout.range(i);
        copy_part(ckpt, None, layout, i, &mut params[r], shard)?;
    }
    Ok(())
}

/// The whole shape of parameter `name` when `shard` holds a part of it.
fn whole_shape<'a>(shard: Option<SavedShard<'a>>, name: &str) -> Option<&'a [usize]> {
    shard
        .and_then(|s| s.specs.get(name))
        .map(|(_, whole)| whole.as_slice())
}

/// Copies parameter `i` of `layout` (or its optimizer state `state`) from `ckpt` into
/// `dst`: the tensor itself, or this shard's part of it when it is split.
fn copy_part(
    ckpt: &LoadedCheckpoint,
    state: Option<&str>,
    layout: &ParamLayout,
    i: usize,
    dst: &mut [f32],
    shard: Option<SavedShard<'_>>,
) -> Result<()> {
    let (name, shape) = (&layout.names()[i], &layout.shapes()[i]);
    let copy = |shape: &[usize], dst: &mut [f32]| match state {
        Some(kind) => ckpt.copy_state(kind, name, shape, dst),
        None => ckpt.copy_param(name, shape, dst),
    };
    match shard.and_then(|s| s.specs.get(name.as_str()).map(|x| (s.rank, x))) {
        None => copy(shape, dst),
        Some((rank, (spec, whole))) => {
            let mut all = vec![0.0f32; whole.iter().product()];
            copy(whole, &mut all)?;
            dst.copy_from_slice(&spec.slice(&all, whole, rank));
            Ok(())
        }
    }
}

/// Restores only one stage's parameters from `ckpt`, by name.
///
/// # Errors
/// `Checkpoint` when a tensor is missing or of another shape. Nothing is changed on
/// error.
pub fn restore_params(
    ckpt: &LoadedCheckpoint,
    layout: &ParamLayout,
    params: &mut [f32],
) -> Result<()> {
    for i in 0..layout.count() {
        ckpt.check_param(&layout.names()[i], &layout.shapes()[i])?;
    }
    for i in 0..layout.count() {
        let r = layout.range(i);
        ckpt.copy_param(&layout.names()[i], &layout.shapes()[i], &mut params[r])?;
    }
    Ok(())
}
