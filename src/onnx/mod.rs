//! ONNX protobuf types and model files.
//!
//! `proto` is generated once from `onnx.proto` (see `tools/gen-onnx-proto.sh`), so the
//! build needs no `protoc`.

#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use prost::bytes::Bytes;
use prost::Message;

use crate::{Error, Result};
use proto::{tensor_proto::DataLocation, ModelProto};

/// The highest IR version ONNX Runtime 1.31 accepts; models are written with at most this.
pub const MAX_IR_VERSION: i64 = 13;

/// Reads an ONNX model, resolving initializers stored in external data files (their
/// bytes are mapped into the model, see `resolve_external_data`; the model no longer
/// refers to the files by name).
///
/// # Errors
/// `Io` when the file cannot be read, `NotOnnx` when its bytes are not an ONNX model
/// (truncated, another format, no graph, no IR version), `ExternalData` when an external
/// tensor's file, offset or length is wrong.
pub fn load_model(path: &Path) -> Result<ModelProto> {
    let bytes = fs::read(path).map_err(Error::io(path))?;
    let mut model = decode_model(&bytes, path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    resolve_external_data(&mut model, dir, path)?;
    Ok(model)
}

/// Decodes model bytes; `path` is only used in errors.
///
/// # Errors
/// `NotOnnx` as for [`load_model`].
pub fn decode_model(bytes: &[u8], path: &Path) -> Result<ModelProto> {
    let not_onnx = |reason: String| Error::NotOnnx {
        path: path.to_path_buf(),
        reason,
    };
    let model = ModelProto::decode(bytes).map_err(|e| not_onnx(e.to_string()))?;
    // Protobuf decoding accepts many byte strings that are not models at all (an empty
    // file decodes to an empty message), so insist on what every ONNX model has.
    if model.ir_version <= 0 {
        return Err(not_onnx("no IR version (is this an ONNX file?)".into()));
    }
    let Some(graph) = &model.graph else {
        return Err(not_onnx("the model has no graph".into()));
    };
    if graph.node.is_empty() {
        return Err(not_onnx("the graph has no nodes".into()));
    }
    if model.opset_import.is_empty() {
        return Err(not_onnx("the model imports no operator set".into()));
    }
    Ok(model)
}

/// Points each initializer stored in an external data file at its bytes.
///
/// Each file is memory-mapped once and its tensors are slices of the map (`Bytes` shares
/// it): the weights are read from the page cache as graph building and the stages use
/// them, no process holds a private copy, and ranks of one machine reading the same files
/// share their pages. A tensor at an offset not aligned for its elements is copied out
/// instead, so that it can still be viewed as numbers.
fn resolve_external_data(model: &mut ModelProto, dir: &Path, path: &Path) -> Result<()> {
    let Some(graph) = model.graph.as_mut() else {
        return Ok(());
    };
    let mut maps: HashMap<PathBuf, Bytes> = HashMap::new();
    for tensor in &mut graph.initializer {
        if tensor.data_location != DataLocation::External as i32 {
            continue;
        }
        let bad = |reason: String| Error::ExternalData {
            path: path.to_path_buf(),
            tensor: tensor.name.clone(),
            reason,
        };
        let field = |key: &str| {
            tensor
                .external_data
                .iter()
                .find(|e| e.key == key)
                .map(|e| e.value.clone())
        };
        let location = field("location").ok_or_else(|| bad("no `location` entry".into()))?;
        let parse = |key: &str| -> Result<Option<u64>> {
            field(key)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| bad(format!("`{key}` is not a byte count: {v}")))
                })
                .transpose()
        };
        let offset = parse("offset")?.unwrap_or(0);
        let length = parse("length")?;
        if Path::new(&location).is_absolute() || location.contains("..") {
            return Err(bad(format!(
                "location `{location}` must be a relative path inside the model's folder"
            )));
        }
        let file_path: PathBuf = dir.join(&location);
        let map = match maps.get(&file_path) {
            Some(m) => m.clone(),
            None => {
                let m = map_file(&file_path)
                    .map_err(|e| bad(format!("{}: {e}", file_path.display())))?;
                maps.insert(file_path.clone(), m.clone());
                m
            }
        };
        let size = map.len() as u64;
        let length = length.unwrap_or(size.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(bad(format!(
                "{}: offset {offset} + length {length} is past its end ({size} bytes)",
                file_path.display()
            )));
        }
        let data = map.slice(offset as usize..(offset + length) as usize);
        // 8 bytes suit every element type pipetrain views in place.
        tensor.raw_data = if offset % 8 == 0 {
            data
        } else {
            Bytes::copy_from_slice(&data)
        };
        tensor.external_data.clear();
        tensor.data_location = DataLocation::Default as i32;
    }
    Ok(())
}

/// The whole file, memory-mapped (an empty file: no bytes, as mapping it fails).
fn map_file(path: &Path) -> std::io::Result<Bytes> {
    let file = fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: the map is read-only and private to this process. Model files are not
    // written while a run reads them (pipetrain writes models atomically, by renaming a
    // new file into place, which leaves this mapping's file as it was); a file truncated
    // under a running process is outside what any reader of mapped files can guard.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    Ok(Bytes::from_owner(map))
}

/// Writes a model atomically: to a temporary file beside `path`, then renamed over it, so
/// a failed write never leaves a half-written model that looks good.
///
/// # Errors
/// `Io` when the folder cannot be written.
pub fn save_model(model: &ModelProto, path: &Path) -> Result<()> {
    write_atomically(path, &model.encode_to_vec())
}

/// Writes any file atomically (through a temporary file and a rename), as
/// [`save_model`] does: traces, drawings, checkpoints.
///
/// # Errors
/// `Io` when the folder cannot be written.
pub fn save_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, bytes)
}

/// Writes bytes to `path` through a temporary file and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.unwrap_or_else(|| "out".into()),
        std::process::id()
    ));
    fs::write(&tmp, bytes).map_err(Error::io(&tmp))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::Io {
            path: path.to_path_buf(),
            source: e.into(),
        }
    })
}

/// The version of the default (`ai.onnx`) operator set a model imports.
pub fn default_opset(model: &ModelProto) -> Option<i64> {
    model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
}
