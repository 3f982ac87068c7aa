//! Reading one shard file into samples, refusing anything the layout does not allow.
//!
//! The framing is checked before any tensor is decoded ([`frames`]), so a data set can be
//! counted without decoding it; [`parse_shard`] then decodes every feature and checks
//! that each sample has the first sample's features, element types and shapes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::onnx::proto::TensorProto;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One sample: feature name (the `TensorProto`'s `name`) -> its tensor (no batch axis).
pub type Sample = BTreeMap<String, Tensor>;

/// The feature label used when an error concerns a whole sample rather than one feature.
pub(crate) const WHOLE_SAMPLE: &str = "(whole sample)";

/// Reads and decodes every sample of the shard at `path`.
///
/// # Errors
/// `Io` when the file cannot be read; `BadShard` naming the file, sample and feature for
/// a truncated record, a length past the file's end, bytes that are not a `TensorProto`,
/// or a feature whose set, element type or shape differs from the first sample's.
pub fn read_shard(path: &Path) -> Result<Vec<Sample>> {
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    parse_shard(path, &bytes)
}

/// Decodes the samples of a shard's bytes; `path` names the file in errors.
///
/// # Errors
/// As [`read_shard`], less `Io`.
pub fn parse_shard(path: &Path, bytes: &[u8]) -> Result<Vec<Sample>> {
    let frames = frames(path, bytes)?;
    let mut samples: Vec<Sample> = Vec::with_capacity(frames.len());
    for (i, features) in frames.iter().enumerate() {
        let sample = decode_sample(path, i, features)?;
        if let Some(first) = samples.first() {
            check_like(path, i, &sample, first)?;
        }
        samples.push(sample);
    }
    Ok(samples)
}

/// The shard files of `dir` as ONNX Runtime's `GetAllDataFiles` lists them: regular files
/// (links followed) whose name ends in `.pb` and does not start with `.`, sorted.
///
/// # Errors
/// `Io` when the folder cannot be listed.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(Error::io(dir))? {
        let path = entry.map_err(Error::io(dir))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or(".");
        if !name.starts_with('.') && name.ends_with(".pb") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A shard's sample count and byte size, from its 4-byte sample lengths alone (seeking
/// past each sample's features), so that a folder of large shards is counted without
/// reading it.
///
/// # Errors
/// `Io`; `BadShard` for stray bytes after the last sample or a sample length past the end
/// of the file (then the file is read to say which feature it ends in, as [`frames`]).
pub(crate) fn count_samples(path: &Path) -> Result<(usize, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).map_err(Error::io(path))?;
    let len = file.metadata().map_err(Error::io(path))?.len();
    let (mut pos, mut count) = (0u64, 0usize);
    let mut word = [0u8; 4];
    while pos < len {
        let whole = len - pos >= 4
            && file
                .seek(SeekFrom::Start(pos))
                .and_then(|_| file.read_exact(&mut word))
                .is_ok();
        pos += 4 + u64::from(u32::from_le_bytes(word));
        if !whole || pos > len {
            // The precise error (which feature the file ends in) comes from the framing.
            let bytes = std::fs::read(path).map_err(Error::io(path))?;
            frames(path, &bytes)?;
            return Err(Error::BadShard {
                path: path.to_path_buf(),
                sample: count,
                feature: WHOLE_SAMPLE.into(),
                reason: "the file changed while it was counted".into(),
            });
        }
        count += 1;
    }
    Ok((count, len))
}

/// The records of a shard, split but not decoded: per sample, each feature's
/// `TensorProto` bytes.
///
/// # Errors
/// `BadShard` for stray bytes after the last sample, a sample or feature length that
/// runs past the end of the file or of its sample, or a sample without features.
pub(crate) fn frames<'a>(path: &Path, bytes: &'a [u8]) -> Result<Vec<Vec<&'a [u8]>>> {
    let bad = |sample: usize, feature: String, reason: String| Error::BadShard {
        path: path.to_path_buf(),
        sample,
        feature,
        reason,
    };
    let mut samples = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let s = samples.len();
        let Some(size) = le_u32(&bytes[pos..]) else {
            return Err(bad(
                s,
                WHOLE_SAMPLE.into(),
                format!(
                    "{} stray bytes at the end of the file, where a 4-byte sample length should be",
                    bytes.len() - pos
                ),
            ));
        };
        pos += 4;
        let end = pos + size;
        let body = &bytes[pos..end.min(bytes.len())];
        let cut = end > bytes.len();
        let mut features = Vec::new();
        let mut p = 0;
        while p < body.len() {
            let k = features.len();
            let Some(fsize) = le_u32(&body[p..]) else {
                let reason = if cut {
                    "the file ends inside this feature's 4-byte length".to_string()
                } else {
                    format!("the {size}-byte sample ends inside this feature's 4-byte length")
                };
                return Err(bad(s, format!("#{k}"), reason));
            };
            p += 4;
            if p + fsize > body.len() {
                let name = partial_name(&body[p..]).unwrap_or_else(|| format!("#{k}"));
                let reason = if cut {
                    format!(
                        "the file ends inside this feature: its record needs {fsize} bytes, {} remain (the sample's length says {size})",
                        body.len() - p
                    )
                } else {
                    format!("its {fsize}-byte record runs past the end of its {size}-byte sample")
                };
                return Err(bad(s, name, reason));
            }
            features.push(&body[p..p + fsize]);
            p += fsize;
        }
        if cut {
            return Err(bad(
                s,
                WHOLE_SAMPLE.into(),
                format!(
                    "the sample length says {size} bytes, but the file ends after {}",
                    body.len()
                ),
            ));
        }
        if features.is_empty() {
            return Err(bad(
                s,
                WHOLE_SAMPLE.into(),
                "a sample without features".into(),
            ));
        }
        samples.push(features);
        pos = end;
    }
    Ok(samples)
}

/// Decodes one sample's feature records.
pub(crate) fn decode_sample(path: &Path, sample: usize, features: &[&[u8]]) -> Result<Sample> {
    let bad = |feature: String, reason: String| Error::BadShard {
        path: path.to_path_buf(),
        sample,
        feature,
        reason,
    };
    let mut out = Sample::new();
    for (k, bytes) in features.iter().enumerate() {
        let proto = TensorProto::decode(*bytes).map_err(|e| {
            let name = partial_name(bytes).unwrap_or_else(|| format!("#{k}"));
            bad(name, format!("not a valid TensorProto: {e}"))
        })?;
        if proto.name.is_empty() {
            return Err(bad(
                format!("#{k}"),
                "the TensorProto has no name, so it feeds no input".into(),
            ));
        }
        let tensor = Tensor::from_proto(&proto).map_err(|e| {
            let reason = match e {
                Error::BadTensor { reason, .. } => reason,
                other => other.to_string(),
            };
            bad(proto.name.clone(), reason)
        })?;
        if out.insert(proto.name.clone(), tensor).is_some() {
            return Err(bad(proto.name, "appears twice in the sample".into()));
        }
    }
    Ok(out)
}

/// Checks that `got` (sample `sample` of `path`) has the features of `first`, with the
/// same element types and shapes.
///
/// # Errors
/// `BadShard` naming the first feature that differs.
pub(crate) fn check_like(path: &Path, sample: usize, got: &Sample, first: &Sample) -> Result<()> {
    let bad = |feature: &str, reason: String| Error::BadShard {
        path: path.to_path_buf(),
        sample,
        feature: feature.to_string(),
        reason,
    };
    if let Some(name) = first.keys().find(|n| !got.contains_key(*n)) {
        return Err(bad(name, "missing (the first sample has it)".into()));
    }
    if let Some(name) = got.keys().find(|n| !first.contains_key(*n)) {
        return Err(bad(name, "not in the first sample".into()));
    }
    for (name, t) in got {
        let want = &first[name];
        if t.dtype() != want.dtype() || t.shape != want.shape {
            return Err(bad(
                name,
                format!(
                    "{:?} {:?}, but the first sample's is {:?} {:?}",
                    t.dtype(),
                    t.shape,
                    want.dtype(),
                    want.shape
                ),
            ));
        }
    }
    Ok(())
}

/// A little-endian `u32` at the start of `b`, as a length.
fn le_u32(b: &[u8]) -> Option<usize> {
    let word: [u8; 4] = b.get(..4)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(word)).ok()
}

/// The `name` (field 8) of a possibly cut-off `TensorProto`, when the bytes hold it whole:
/// lets errors about a damaged record still say which feature it was.
fn partial_name(mut b: &[u8]) -> Option<String> {
    while !b.is_empty() {
        let (key, n) = varint(b)?;
        b = &b[n..];
        match key & 7 {
            0 => b = &b[varint(b)?.1..],
            1 => b = b.get(8..)?,
            5 => b = b.get(4..)?,
            2 => {
                let (len, n) = varint(b)?;
                let len = usize::try_from(len).ok()?;
                let field = b.get(n..n.checked_add(len)?)?;
                if key >> 3 == 8 {
                    return String::from_utf8(field.to_vec()).ok();
                }
                b = &b[n + len..];
            }
            _ => return None,
        }
    }
    None
}

/// A protobuf varint at the start of `b`: its value and byte count.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_name_survives_a_cut_in_the_raw_data() {
        let t = Tensor::f32(vec![4], vec![1.0; 4]).unwrap();
        let bytes = t.to_proto("pixels").encode_to_vec();
        assert_eq!(
            partial_name(&bytes[..bytes.len() - 3]).as_deref(),
            Some("pixels")
        );
        assert_eq!(partial_name(&bytes[..3]), None);
    }
}
