//! Reading a checkpoint back: every shard read whole, checked against the manifest
//! (length, CRC-32) and indexed by tensor name, so that each stage of any layout takes
//! its own parameters and optimizer state by name.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::manifest::Manifest;
mod assemble;

use super::shard::{copy_f32, split_state_key};
use crate::graph::tensor_parallel::ShardSpec;
use crate::{Error, Result};
use assemble::split_of;

/// What the `kind` metadata of a shard file says it holds.
pub(crate) const KIND_PARAMS: &str = "parameters";
/// See [`KIND_PARAMS`].
pub(crate) const KIND_OPTIMIZER: &str = "optimizer";
/// See [`KIND_PARAMS`]: state that is not trained (BatchNorm's running statistics).
pub(crate) const KIND_BUFFERS: &str = "buffers";

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// A tensor shard's part of a split tensor: how it is split, which shard, where.
type Part = (ShardSpec, usize, Entry);

/// A complete checkpoint in memory, checked and indexed.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    /// Its folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    files: Vec<(PathBuf, Mmap)>,
    params: HashMap<String, Entry>,
    /// `(state, parameter)` -> bytes.
    state: HashMap<(String, String), Entry>,
    /// Buffers (running statistics) by name.
    buffers: HashMap<String, Entry>,
    /// The optimizer's step count, as every shard's metadata records it.
    step_count: Option<u64>,
    /// Tensor shards' parts of split tensors, until they are put together:
    /// `(kind, key) -> [(spec, rank, part)]`.
    parts: HashMap<(String, String), Vec<Part>>,
    /// Split tensors put back together (float32 bytes), and the files they came from.
    assembled: Vec<(PathBuf, Vec<u8>)>,
}

impl LoadedCheckpoint {
    /// Reads the checkpoint in `dir`: its manifest, then every shard, each checked
    /// against the length and CRC-32 the manifest recorded.
    ///
    /// # Errors
    /// `Checkpoint` naming the file and what is wrong: no manifest (incomplete), an
    /// unknown format version, a missing, truncated or altered shard, a shard that is not
    /// safetensors, a tensor that is not float32 or appears twice.
    pub fn open(dir: &Path) -> Result<LoadedCheckpoint> {
        let manifest = Manifest::read(dir)?;
        let mut out = LoadedCheckpoint {
            dir: dir.to_path_buf(),
            manifest,
            files: Vec::new(),
            params: HashMap::new(),
            state: HashMap::new(),
            buffers: HashMap::new(),
            step_count: None,
            parts: HashMap::new(),
            assembled: Vec::new(),
        };
        for shard in out.manifest.shards.clone() {
            let path = dir.join(&shard.file);
            let bad = |reason: String| Error::Checkpoint {
                path: path.clone(),
                reason,
            };
            let file = std::fs::File::open(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
            let len = file.metadata().map_err(Error::io(&path))?.len();
            if len != shard.bytes || len == 0 {
                return Err(bad(format!(
                    "{len} bytes, the manifest says {} (truncated or altered)",
                    shard.bytes
                )));
            }
            // SAFETY: the map is only read. A complete checkpoint's files are never
            // written again (pipetrain replaces a checkpoint by renaming a new folder into
            // place); another process altering one while it loads is caught by the CRC
            // below for what was read before, as any torn read would be.
            let bytes = unsafe { Mmap::map(&file) }.map_err(|e| bad(format!("cannot map: {e}")))?;
            if bytes.len() as u64 != shard.bytes {
                return Err(bad(format!(
                    "{} bytes, the manifest says {} (truncated or altered)",
                    bytes.len(),
                    shard.bytes
                )));
            }
            let crc = crc32fast::hash(&bytes);
            if crc != shard.crc32 {
                return Err(bad(format!(
                    "CRC-32 {crc:08x}, the manifest says {:08x} (the file was altered)",
                    shard.crc32
                )));
            }
            out.index(out.files.len(), &path, &bytes)?;
            out.files.push((path, bytes));
        }
        out.assemble()?;
        Ok(out)
    }

    fn index(&mut self, file: usize, path: &Path, bytes: &[u8]) -> Result<()> {
        let bad = |reason: String| Error::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        let (header, meta) = SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let info: serde_json::Value = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(super::META_KEY))
            .and_then(|t| serde_json::from_str(t).ok())
            .ok_or_else(|| {
                bad(format!(
                    "no `{}` metadata: not a pipetrain shard",
                    super::META_KEY
                ))
            })?;
        let kind = info["kind"].as_str().unwrap_or_default().to_string();
        let steps = info["step_count"]
            .as_u64()
            .ok_or_else(|| bad("no `step_count` in its metadata".into()))?;
        if self.step_count.is_some_and(|s| s != steps) {
            return Err(bad(format!(
                "optimizer step count {steps}, other shards say {}",
                self.step_count.unwrap_or(0)
            )));
        }
        self.step_count = Some(steps);
        let start = 8 + header;
        for (name, t) in meta.tensors() {
            if t.dtype != Dtype::F32 {
                return Err(bad(format!(
                    "tensor `{name}` is {:?}; checkpoints hold float32",
                    t.dtype
                )));
            }
            let entry = Entry {
                file,
                shape: t.shape.clone(),
                bytes: start + t.data_offsets.0..start + t.data_offsets.1,
            };
            let param = match kind.as_str() {
                KIND_OPTIMIZER => split_state_key(&name).map_or(name.as_str(), |(_, p)| p),
                _ => name.as_str(),
            };
            if let Some((spec, rank)) = split_of(&info, param) {
                let key = (kind.clone(), name.clone());
                self.parts.entry(key).or_default().push((spec, rank, entry));
                continue;
            }
            if self.insert(&kind, name.clone(), entry)? {
                return Err(bad(format!("tensor `{name}` appears in two shards")));
            }
        }
        Ok(())
    }

    /// Optimizer updates the state has taken (skipped steps do not count).
    pub fn optimizer_steps(&self) -> u64 {
        self.step_count.unwrap_or(0)
    }

    /// Every parameter's name and shape, sorted by name.
    pub fn parameters(&self) -> Vec<(&str, &[usize])> {
        let mut v: Vec<(&str, &[usize])> = self
            .params
            .iter()
            .map(|(n, e)| (n.as_str(), e.shape.as_slice()))
            .collect();
        v.sort_unstable();
        v
    }

    /// Every buffer's (running statistic's) name and shape, sorted by name.
    pub fn buffers(&self) -> Vec<(&str, &[usize])> {
        let mut v: Vec<(&str, &[usize])> = self
            .buffers
            .iter()
            .map(|(n, e)| (n.as_str(), e.shape.as_slice()))
            .collect();
        v.sort_unstable();
        v
    }

    /// Bytes and file of parameter `name`.
    fn entry_bytes(&self, e: &Entry) -> (&Path, &[u8]) {
        match self.files.get(e.file) {
            Some((path, bytes)) => (path, &bytes[e.bytes.clone()]),
            None => {
                let (path, bytes) = &self.assembled[e.file - self.files.len()];
                (path, &bytes[e.bytes.clone()])
            }
        }
    }

    /// Checks that parameter `name` is there with `shape`.
    ///
    /// # Errors
    /// As [`LoadedCheckpoint::copy_param`].
    pub fn check_param(&self, name: &str, shape: &[usize]) -> Result<()> {
        let e = self.param_entry(name)?;
        self.check_shape(e, name, shape)
    }

    /// Checks that optimizer state `state` of `name` is there with `shape`.
    ///
    /// # Errors
    /// As [`LoadedCheckpoint::copy_state`].
    pub fn check_state(&self, state: &str, name: &str, shape: &[usize]) -> Result<()> {
        let e = self.state_entry(state, name)?;
        self.check_shape(e, name, shape)
    }

    fn param_entry(&self, name: &str) -> Result<&Entry> {
        self.params.get(name).ok_or_else(|| Error::Checkpoint {
            path: self.dir.clone(),
            reason: format!("no parameter `{name}`: a checkpoint of another model"),
        })
    }

    fn state_entry(&self, state: &str, name: &str) -> Result<&Entry> {
        self.state
            .get(&(state.to_string(), name.to_string()))
            .ok_or_else(|| Error::Checkpoint {
                path: self.dir.clone(),
                reason: format!(
                    "no optimizer state `{state}` of `{name}`: saved by another optimizer ({})",
                    self.manifest.optimizer.state.join(", ")
                ),
            })
    }

    fn check_shape(&self, e: &Entry, name: &str, shape: &[usize]) -> Result<()> {
        if e.shape != shape {
            let (path, _) = self.entry_bytes(e);
            return Err(Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{name}` has shape {:?}, the model's is {shape:?}: a checkpoint of another model",
                    e.shape
                ),
            });
        }
        Ok(())
    }

    /// Copies parameter `name`, which must have `shape`, into `dst`.
    ///
    /// # Errors
    /// `Checkpoint` when the checkpoint has no such parameter or another shape: a
    /// checkpoint of another model.
    pub fn copy_param(&self, name: &str, shape: &[usize], dst: &mut [f32]) -> Result<()> {
        self.copy(self.param_entry(name)?, name, shape, dst)
    }

    /// Copies buffer `name` (a running statistic) into `dst`.
    ///
    /// # Errors
    /// `Checkpoint` when it is missing (a checkpoint written before pipetrain kept
    /// running statistics) or of another shape.
    pub fn copy_buffer(&self, name: &str, shape: &[usize], dst: &mut [f32]) -> Result<()> {
        let e = self.buffers.get(name).ok_or_else(|| Error::Checkpoint {
            path: self.dir.clone(),
            reason: format!("no buffer `{name}` (BatchNorm running statistic)"),
        })?;
        self.copy(e, name, shape, dst)
    }

    /// Copies optimizer state `state` of parameter `name` into `dst`.
    ///
    /// # Errors
    /// `Checkpoint` when it is missing (another optimizer) or of another shape.
    pub fn copy_state(
        &self,
        state: &str,
        name: &str,
        shape: &[usize],
        dst: &mut [f32],
    ) -> Result<()> {
        let e = self
            .state
            .get(&(state.to_string(), name.to_string()))
            .ok_or_else(|| Error::Checkpoint {
                path: self.dir.clone(),
                reason: format!(
                    "no optimizer state `{state}` of `{name}`: saved by another optimizer ({})",
                    self.manifest.optimizer.state.join(", ")
                ),
            })?;
        self.copy(e, name, shape, dst)
    }

    fn copy(&self, e: &Entry, name: &str, shape: &[usize], dst: &mut [f32]) -> Result<()> {
        let (path, bytes) = self.entry_bytes(e);
        if e.shape != shape || bytes.len() != dst.len() * 4 {
            return Err(Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{name}` has shape {:?}, the model's is {shape:?}: a checkpoint of another model",
                    e.shape
                ),
            });
        }
        copy_f32(dst, bytes);
        Ok(())
    }

    /// Checks that the checkpoint holds exactly the model's trainable tensors
    /// (`(name, shape)`), naming the first difference.
    ///
    /// # Errors
    /// `Checkpoint` naming a tensor missing from either side or of another shape.
    pub fn check_model(&self, params: &[(String, Vec<usize>)]) -> Result<()> {
        let bad = |reason: String| Error::Checkpoint {
            path: self.dir.clone(),
            reason: format!("{reason}: a checkpoint of another model"),
        };
        for (name, shape) in params {
            match self.params.get(name) {
                None => return Err(bad(format!("no parameter `{name}`"))),
                Some(e) if &e.shape != shape => {
                    return Err(bad(format!(
                        "parameter `{name}` has shape {:?}, the model's is {shape:?}",
                        e.shape
                    )))
                }
                Some(_) => {}
            }
        }
        if let Some((name, _)) = self
            .parameters()
            .into_iter()
            .find(|(n, _)| !params.iter().any(|(p, _)| p == n))
        {
            return Err(bad(format!("parameter `{name}` is not one of the model's")));
        }
        Ok(())
    }

    /// Bytes of all shards.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b.len() as u64).sum()
    }
}
