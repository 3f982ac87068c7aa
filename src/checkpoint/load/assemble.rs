//! Split tensors put back together: a checkpoint written under tensor parallelism holds
//! each shard's part of a split tensor (with how it is split in the file's metadata);
//! loading places the parts into whole tensors, so any layout resumes from them.

use super::{Entry, LoadedCheckpoint, KIND_BUFFERS, KIND_OPTIMIZER, KIND_PARAMS};
use crate::checkpoint::shard::{copy_f32, split_state_key};
use crate::graph::tensor_parallel::ShardSpec;
use crate::{Error, Result};

impl LoadedCheckpoint {
    /// Puts every split tensor back together from its shards' parts (a checkpoint
    /// written under tensor parallelism holds parts; any layout resumes from the whole).
    pub(super) fn assemble(&mut self) -> Result<()> {
        let mut parts: Vec<_> = std::mem::take(&mut self.parts).into_iter().collect();
        parts.sort_by(|a, b| a.0.cmp(&b.0));
        for ((kind, key), mut list) in parts {
            list.sort_by_key(|(_, rank, _)| *rank);
            let (spec, _, first) = list[0].clone();
            let dir = self.dir.clone();
            let bad = |reason: String| Error::Checkpoint {
                path: dir.clone(),
                reason: format!("split tensor `{key}`: {reason}"),
            };
            let ranks: Vec<usize> = list.iter().map(|(_, r, _)| *r).collect();
            if ranks != (0..spec.shards).collect::<Vec<_>>()
                || list
                    .iter()
                    .any(|(s, _, e)| *s != spec || e.shape != first.shape)
            {
                return Err(bad(format!(
                    "parts of shards {ranks:?} of {}, of differing splits or shapes",
                    spec.shards
                )));
            }
            let mut whole_shape = first.shape.clone();
            if spec.axis >= whole_shape.len() || spec.sections == 0 {
                return Err(bad(format!(
                    "split along axis {} in {} sections of a tensor of rank {}",
                    spec.axis,
                    spec.sections,
                    whole_shape.len()
                )));
            }
            whole_shape[spec.axis] *= spec.shards;
            if !spec.fits(&whole_shape) {
                return Err(bad(format!(
                    "a whole shape {whole_shape:?} that {} sections of {} shards do not divide",
                    spec.sections, spec.shards
                )));
            }
            let mut whole = vec![0f32; whole_shape.iter().product()];
            let mut part = Vec::new();
            for (_, rank, e) in &list {
                let (_, bytes) = self.entry_bytes(e);
                part.resize(bytes.len() / 4, 0.0);
                copy_f32(&mut part, bytes);
                spec.place(&part, &whole_shape, *rank, &mut whole);
            }
            let path = self.entry_bytes(&first).0.to_path_buf();
            let entry = Entry {
                file: self.files.len() + self.assembled.len(),
                shape: whole_shape,
                bytes: 0..whole.len() * 4,
            };
            self.assembled
                .push((path, bytemuck::cast_slice(&whole).to_vec()));
            if self.insert(&kind, key.clone(), entry)? {
                return Err(bad("appears whole and in parts".into()));
            }
        }
        Ok(())
    }

    /// Indexes a whole tensor of a shard of `kind`; whether it was there already.
    pub(super) fn insert(&mut self, kind: &str, name: String, entry: Entry) -> Result<bool> {
        Ok(match kind {
            KIND_PARAMS => self.params.insert(name, entry).is_some(),
            KIND_BUFFERS => self.buffers.insert(name, entry).is_some(),
            KIND_OPTIMIZER => {
                let (state, param) = split_state_key(&name).ok_or_else(|| Error::Checkpoint {
                    path: self.dir.clone(),
                    reason: format!("optimizer tensor `{name}` is not `<state>/<parameter>`"),
                })?;
                self.state
                    .insert((state.to_string(), param.to_string()), entry)
                    .is_some()
            }
            other => {
                return Err(Error::Checkpoint {
                    path: self.dir.clone(),
                    reason: format!("unknown shard kind {other:?}"),
                })
            }
        })
    }
}

/// How parameter `name` is split in a shard whose metadata is `info`, and which part
/// the shard holds: `split: {name: [axis, sections, shards, rank]}`.
pub(super) fn split_of(info: &serde_json::Value, name: &str) -> Option<(ShardSpec, usize)> {
    let v: Vec<usize> = info["split"][name]
        .as_array()?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize))
        .collect::<Option<_>>()?;
    match v[..] {
        [axis, sections, shards, rank] => Some((
            ShardSpec {
                axis,
                sections,
                shards,
            },
            rank,
        )),
        _ => None,
    }
}
