//! TFRecord framing, the container of TensorFlow event files: each record is
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes | data | u32 masked CRC-32C of data
//! ```
//!
//! as `tensorflow/core/lib/io/record_writer.cc` writes it and TensorBoard's reader checks it.
//! The CRC comes from the `crc32c` crate (hardware CRC instructions where the processor
//! has them); the masking, a rotation plus a constant so that a CRC stored inside checked
//! data does not make the check trivial, is TensorFlow's `crc32c::Mask`.

use std::io::{self, Write};

/// TensorFlow's `kMaskDelta`.
const MASK_DELTA: u32 = 0xa282_ead8;

/// TensorFlow's masked CRC-32C of `data`.
pub(super) fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Writes `data` to `out` as one record.
///
/// # Errors
/// What `out` reports.
pub(super) fn write_record(out: &mut impl Write, data: &[u8]) -> io::Result<()> {
    // usize -> u64 cannot lose bits on any platform Rust supports (pointers are at most
    // 64 bits wide).
    let header = (data.len() as u64).to_le_bytes();
    out.write_all(&header)?;
    out.write_all(&masked_crc32c(&header).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc32c(data).to_le_bytes())
}

/// Reads every record of `bytes`, checking both checksums of each: the other half of
/// [`write_record`], for tests.
///
/// # Errors
/// Where the framing breaks: a truncated record or a checksum that does not match.
#[cfg(test)]
pub(super) fn read_records(mut bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize, at: usize, what: &str) -> Result<&'a [u8], String> {
        if bytes.len() < n {
            return Err(format!("record at byte {at}: truncated {what}"));
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    let crc = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let total = bytes.len();
    let mut records = Vec::new();
    while !bytes.is_empty() {
        let at = total - bytes.len();
        let header = take(&mut bytes, 8, at, "length")?;
        if crc(take(&mut bytes, 4, at, "length CRC")?) != masked_crc32c(header) {
            return Err(format!("record at byte {at}: length CRC mismatch"));
        }
        let len = u64::from_le_bytes(header.try_into().map_err(|_| "8 bytes")?);
        let len = usize::try_from(len).map_err(|_| format!("record at byte {at}: too long"))?;
        let data = take(&mut bytes, len, at, "data")?;
        if crc(take(&mut bytes, 4, at, "data CRC")?) != masked_crc32c(data) {
            return Err(format!("record at byte {at}: data CRC mismatch"));
        }
        records.push(data);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's check value (RFC 3720 B.4: "123456789" -> 0xE3069283) and TensorFlow's
    /// masking of it, computed by hand from `crc32c::Mask`.
    #[test]
    fn masked_crc_matches_tensorflow() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let want = 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), want);
        // The same, computed independently with TensorBoard's pure-Python masked_crc32c
        // (tensorboard.compat.tensorflow_stub.pywrap_tensorflow).
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn records_read_back_and_damage_is_caught() {
        let mut file = Vec::new();
        for data in [&b""[..], b"brain.Event:2", &[7u8; 1000]] {
            write_record(&mut file, data).unwrap();
        }
        let records = read_records(&file).unwrap();
        assert_eq!(records, [&b""[..], b"brain.Event:2", &[7u8; 1000]]);
        // Framing overhead: 16 bytes a record.
        assert_eq!(file.len(), 3 * 16 + 13 + 1000);

        let mut flipped = file.clone();
        flipped[16 + 12 + 3] ^= 1; // a data byte of the second record
        assert_eq!(
            read_records(&flipped).unwrap_err(),
            "record at byte 16: data CRC mismatch"
        );
        let mut flipped = file.clone();
        flipped[16] ^= 1; // the second record's length
        assert_eq!(
            read_records(&flipped).unwrap_err(),
            "record at byte 16: length CRC mismatch"
        );
        assert_eq!(
            read_records(&file[..file.len() - 1]).unwrap_err(),
            "record at byte 45: truncated data CRC"
        );
    }
}
