//! Writing `.npz` archives as `numpy.savez` does: one `.npy` entry per array, stored
//! uncompressed. `npyz` encodes the arrays, `zip` makes the archive.

use std::io::{Cursor, Write};
use std::path::Path;

use npyz::WriterBuilder;
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, ZipWriter};

use crate::onnx::write_atomically;
use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// Writes `arrays` (name, tensor) to an `.npz` archive at `path`, atomically: through a
/// temporary file renamed over `path`, so a failed write leaves no half-written archive.
/// [`crate::data::read_npz`] and `numpy.load` read it back.
///
/// # Errors
/// `Data` naming the array when one cannot be encoded or two share a name; `Io` when the
/// file cannot be written.
pub fn write_npz(path: &Path, arrays: &[(&str, &Tensor)]) -> Result<()> {
    let bad = |what: &str, reason: String| Error::Data {
        path: path.to_path_buf(),
        what: what.into(),
        reason,
    };
    let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
    for (i, (name, tensor)) in arrays.iter().enumerate() {
        if arrays[..i].iter().any(|(n, _)| n == name) {
            return Err(bad(name, "two arrays of this name".into()));
        }
        let bytes = encode_npy(tensor).map_err(|e| bad(name, e.to_string()))?;
        let options = SimpleFileOptions::default()
            .compression_method(CompressionMethod::Stored)
            .large_file(bytes.len() as u64 >= u64::from(u32::MAX));
        zip.start_file(format!("{name}.npy"), options)
            .and_then(|()| zip.write_all(&bytes).map_err(Into::into))
            .map_err(|e| bad(name, e.to_string()))?;
    }
    let archive = zip
        .finish()
        .map_err(|e| bad("file", e.to_string()))?
        .into_inner();
    write_atomically(path, &archive)
}

/// The bytes of one `.npy` array (C order, little-endian).
fn encode_npy(t: &Tensor) -> std::io::Result<Vec<u8>> {
    fn encode<T: npyz::AutoSerialize + Copy>(shape: &[usize], v: &[T]) -> std::io::Result<Vec<u8>> {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let mut out = Vec::new();
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&shape)
            .writer(&mut out)
            .begin_nd()?;
        w.extend(v.iter().copied())?;
        w.finish()?;
        Ok(out)
    }
    match &t.data {
        TensorData::F32(v) => encode(&t.shape, v),
        TensorData::F64(v) => encode(&t.shape, v),
        TensorData::I64(v) => encode(&t.shape, v),
        TensorData::I32(v) => encode(&t.shape, v),
        TensorData::Bool(v) => encode(&t.shape, v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::read_npz;

    #[test]
    fn read_npz_reads_back_every_type() {
        let dir = std::env::temp_dir().join(format!("pipetrain-npz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("all.npz");
        let arrays = [
            (
                "f",
                Tensor::f32(vec![2, 3], vec![1.0, -2.5, 3.0, 0.0, 1e-8, 7.0]).unwrap(),
            ),
            (
                "d",
                Tensor::f64(vec![2], vec![std::f64::consts::PI, -1.0]).unwrap(),
            ),
            (
                "i",
                Tensor::i64(vec![3, 1], vec![i64::MIN, 0, i64::MAX]).unwrap(),
            ),
            (
                "n",
                Tensor::new(vec![2], TensorData::I32(vec![-7, 9])).unwrap(),
            ),
            (
                "b",
                Tensor::new(vec![2, 2], TensorData::Bool(vec![true, false, false, true])).unwrap(),
            ),
            ("s", Tensor::f32(vec![], vec![4.5]).unwrap()),
            ("e", Tensor::i64(vec![0, 4], vec![]).unwrap()),
        ];
        let refs: Vec<(&str, &Tensor)> = arrays.iter().map(|(n, t)| (*n, t)).collect();
        write_npz(&path, &refs).unwrap();
        let back = read_npz(&path).unwrap();
        assert_eq!(back.len(), arrays.len());
        for (name, t) in &arrays {
            assert_eq!(&back[*name], t, "{name}");
        }
        // A repeated name is refused before anything is written.
        let twice = [("x", &arrays[0].1), ("x", &arrays[1].1)];
        assert!(matches!(
            write_npz(&dir.join("twice.npz"), &twice),
            Err(Error::Data { what, .. }) if what == "x"
        ));
        assert!(!dir.join("twice.npz").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
