//! NumPy `.npy` arrays and `.npz` archives of them (as `numpy.savez` writes).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use crate::tensor::{Tensor, TensorData};
use crate::{Error, Result};

/// Reads every array of an `.npz` file, by name (without the `.npy` suffix).
///
/// # Errors
/// `Io` when the file cannot be read; `Data` naming the array when an entry is not a
/// supported `.npy` array (little-endian f4, f8, i4, i8 or bool, C order).
pub fn read_npz(path: &Path) -> Result<HashMap<String, Tensor>> {
    let file = std::fs::File::open(path).map_err(Error::io(path))?;
    let bad = |what: &str, reason: String| Error::Data {
        path: path.to_path_buf(),
        what: what.into(),
        reason,
    };
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| bad("file", format!("not an npz (zip) archive: {e}")))?;
    let mut out = HashMap::new();
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| bad("file", e.to_string()))?;
        let name = entry.name().trim_end_matches(".npy").to_string();
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry
            .read_to_end(&mut bytes)
            .map_err(|e| bad(&name, format!("cannot decompress: {e}")))?;
        let t = parse_npy(&bytes).map_err(|reason| bad(&name, reason))?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Parses the bytes of one `.npy` array.
///
/// # Errors
/// A description of what is wrong with the header or the data.
pub fn parse_npy(bytes: &[u8]) -> std::result::Result<Tensor, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy array (bad magic)".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = bytes
        .get(start..start + header_len)
        .ok_or("truncated header")?;
    let header = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header
            .find(&format!("'{key}':"))
            .ok_or(format!("header has no '{key}'"))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = field("descr")?;
    let descr = descr
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or("");
    if field("fortran_order")?.starts_with("True") {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let shape_text = field("shape")?;
    let inner = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("malformed shape")?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad dimension `{s}`"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let body = &bytes[start + header_len..];
    let n: usize = shape.iter().product();
    let need = |w: usize| -> std::result::Result<&[u8], String> {
        body.get(..n * w).ok_or(format!(
            "data holds {} bytes, shape {shape:?} needs {}",
            body.len(),
            n * w
        ))
    };
    fn le<T, const N: usize>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N)
            .map(|c| f(c.try_into().expect("N bytes")))
            .collect()
    }
    let data = match descr {
        "<f4" => TensorData::F32(le(need(4)?, f32::from_le_bytes)),
        "<f8" => TensorData::F64(le(need(8)?, f64::from_le_bytes)),
        "<i4" => TensorData::I32(le(need(4)?, i32::from_le_bytes)),
        "<i8" => TensorData::I64(le(need(8)?, i64::from_le_bytes)),
        "|b1" => TensorData::Bool(need(1)?.iter().map(|&b| b != 0).collect()),
        other => return Err(format!("unsupported dtype `{other}`")),
    };
    Ok(Tensor { shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, shape: &str, body: &[u8]) -> Vec<u8> {
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(body);
        out
    }

    #[test]
    fn parses_the_header_and_data() {
        let body: Vec<u8> = [1.5f32, -2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = parse_npy(&npy("<f4", "(2, 3)", &body)).unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.as_f32().unwrap()[..2], [1.5, -2.0]);
        let s = parse_npy(&npy("<i8", "(3,)", &[7u8; 24])).unwrap();
        assert_eq!(s.shape, vec![3]);
    }

    #[test]
    fn short_data_and_unknown_types_are_errors() {
        assert!(parse_npy(&npy("<f4", "(2, 3)", &[0u8; 8]))
            .unwrap_err()
            .contains("needs 24"));
        assert!(parse_npy(&npy("<c8", "(1,)", &[0u8; 8]))
            .unwrap_err()
            .contains("unsupported dtype"));
        assert!(parse_npy(b"PK\x03\x04 not numpy")
            .unwrap_err()
            .contains("magic"));
    }
}
