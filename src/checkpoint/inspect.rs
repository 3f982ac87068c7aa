//! What `pipetrain checkpoint inspect` prints, and `pipetrain export --checkpoint`.

use std::fmt::Write as _;
use std::path::Path;

use super::load::LoadedCheckpoint;
use super::manifest::{model_fingerprint, Manifest, MANIFEST};
use super::store::list;
use crate::graph::export_inference_model;
use crate::onnx::{load_model, save_model};
use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// A description of `dir`: one checkpoint (a folder with a manifest: step, layout,
/// optimizer, data position, loss scaler, every tensor with its shape and size), or a
/// checkpoints folder (each checkpoint, complete or not, and why).
///
/// # Errors
/// `Checkpoint` when `dir` is a damaged checkpoint; `Io` when it cannot be read.
pub fn inspect(dir: &Path) -> Result<String> {
    if dir.join(MANIFEST).exists() {
        return inspect_one(dir);
    }
    let mut out = String::new();
    let listed = list(dir)?;
    if listed.is_empty() {
        let _ = writeln!(out, "{}: no checkpoints", dir.display());
    }
    for l in listed {
        let _ = match l.manifest {
            Ok(m) => writeln!(
                out,
                "{}  complete  step {}  {} shard file(s), {:.1} MiB",
                l.path.display(),
                m.steps_done,
                m.shards.len(),
                m.shards.iter().map(|s| s.bytes).sum::<u64>() as f64 / (1 << 20) as f64
            ),
            Err(e) => writeln!(out, "{}  NOT LOADABLE  {e}", l.path.display()),
        };
    }
    Ok(out)
}

fn inspect_one(dir: &Path) -> Result<String> {
    let ckpt = LoadedCheckpoint::open(dir)?;
    let m: &Manifest = &ckpt.manifest;
    let mut o = String::new();
    let _ = writeln!(o, "checkpoint   {}", dir.display());
    let _ = writeln!(
        o,
        "format       {} v{} (pipetrain {})",
        m.format, m.format_version, m.pipetrain_version
    );
    let _ = writeln!(o, "steps done   {}", m.steps_done);
    let l = &m.layout;
    let _ = writeln!(
        o,
        "layout       data x pipeline = {} x {} ({} stages, {} virtual per rank, {})",
        l.data_parallel_size, l.pipeline_parallel_size, l.stages, l.virtual_stages, l.schedule
    );
    let _ = writeln!(
        o,
        "model        {} ({} tensors, {} parameters, fingerprint {})",
        match &m.model.spec {
            Some(spec) => format!("built-in {}", spec.kind()),
            None => m.model.path.display().to_string(),
        },
        m.model.tensors,
        m.model.parameters,
        &m.model.fingerprint[..m.model.fingerprint.len().min(16)]
    );
    let _ = writeln!(
        o,
        "optimizer    {} | updates taken {} | state: {}",
        serde_json::to_string(&m.optimizer.config).unwrap_or_default(),
        ckpt.optimizer_steps(),
        if m.optimizer.state.is_empty() {
            "none".to_string()
        } else {
            m.optimizer.state.join(", ")
        }
    );
    let _ = writeln!(
        o,
        "lr           next {:.6e} (step {} of {})",
        m.lr_schedule.next_lr, m.lr_schedule.step, m.lr_schedule.total_steps
    );
    let d = &m.data;
    let _ = writeln!(
        o,
        "data         next step {}, {} samples consumed, epoch {}{}",
        d.next_step,
        d.sample_offset,
        d.epoch,
        match (&d.batch_order, d.batch_order_row) {
            (Some(name), Some(row)) => format!(", batch order `{name}` row {row}"),
            _ => String::new(),
        }
    );
    let _ = writeln!(
        o,
        "loss scaler  {} scale {} ({} stable steps)",
        m.loss_scaler.mode, m.loss_scaler.state.scale, m.loss_scaler.state.stable_steps
    );
    let _ = writeln!(o, "files");
    for s in &m.shards {
        let _ = writeln!(
            o,
            "  stage {:>3}  {:<36} {:>12} bytes  crc32 {:08x}",
            s.stage, s.file, s.bytes, s.crc32
        );
    }
    let _ = writeln!(o, "tensors");
    for (name, shape) in ckpt.parameters() {
        let n: usize = shape.iter().product();
        let _ = writeln!(o, "  {name:<40} f32 {shape:?}  {} bytes", n * 4);
    }
    let _ = writeln!(o, "total        {} bytes of shards", ckpt.bytes());
    Ok(o)
}

/// Writes the inference model of a checkpoint: `model` (default: the model the
/// checkpoint was trained from, as its manifest records) with the checkpoint's weights.
///
/// # Errors
/// `Checkpoint` when the checkpoint is damaged or belongs to another model (its
/// fingerprint or tensors differ); `Io` or `NotOnnx` for the model file.
pub fn export(dir: &Path, model: Option<&Path>, output: &Path) -> Result<()> {
    let ckpt = LoadedCheckpoint::open(dir)?;
    let model_path = model.unwrap_or(&ckpt.manifest.model.path);
    let proto = match (&ckpt.manifest.model.spec, model) {
        (Some(spec), None) => crate::models::build(spec)?,
        _ => load_model(model_path)?,
    };
    let fingerprint = model_fingerprint(&proto);
    if fingerprint != ckpt.manifest.model.fingerprint {
        return Err(Error::Checkpoint {
            path: dir.join(MANIFEST),
            reason: format!(
                "was trained from another model than {} (its structure's fingerprint differs)",
                model_path.display()
            ),
        });
    }
    let mut trained: Vec<(String, Tensor)> = Vec::new();
    let params = ckpt.parameters().into_iter().map(|p| (p, false));
    let buffers = ckpt.buffers().into_iter().map(|b| (b, true));
    for ((name, shape), buffer) in params.chain(buffers) {
        let mut values = vec![0.0f32; shape.iter().product()];
        match buffer {
            true => ckpt.copy_buffer(name, shape, &mut values)?,
            false => ckpt.copy_param(name, shape, &mut values)?,
        }
        trained.push((
            name.to_string(),
            Tensor::new(shape.to_vec(), TensorData::F32(values))?,
        ));
    }
    let views: Vec<(&str, &Tensor)> = trained.iter().map(|(n, t)| (n.as_str(), t)).collect();
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
    }
    let mut exported = export_inference_model(&proto, &views)?;
    let steps = (
        ckpt.manifest.steps_done,
        ckpt.manifest.lr_schedule.total_steps,
    );
    crate::graph::mark_trained_steps(&mut exported, steps);
    save_model(&exported, output)
}
