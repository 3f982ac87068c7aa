//! What the coordinators of a distributed run gather over the bus, as bytes: lists of
//! `(a, b, value)` triples (replica, micro-batch or stage, a loss or a sum of squares).
//! Values may be NaN or infinite (an overflow is exactly what must reach everyone), which
//! JSON cannot carry, so the encoding is plain little-endian binary.

use crate::error::ActorError;

/// A list of triples.
pub(crate) type Triples = Vec<(usize, usize, f64)>;

/// Appends `list` to `out`: a u32 count, then `(u32, u32, f64)` per triple.
pub(crate) fn put(out: &mut Vec<u8>, list: &[(usize, usize, f64)]) {
    out.extend((list.len() as u32).to_le_bytes());
    for &(a, b, v) in list {
        out.extend((a as u32).to_le_bytes());
        out.extend((b as u32).to_le_bytes());
        out.extend(v.to_le_bytes());
    }
}

/// Reads a list written by [`put`] from `bytes` at `at`, moving `at` past it.
pub(crate) fn take(bytes: &[u8], at: &mut usize) -> Result<Triples, ActorError> {
    let bad = || ActorError::Settings {
        reason: "a malformed message on the control bus".into(),
    };
    let mut read = |n: usize| -> Result<&[u8], ActorError> {
        let s = bytes.get(*at..*at + n).ok_or_else(bad)?;
        *at += n;
        Ok(s)
    };
    let count = u32::from_le_bytes(read(4)?.try_into().map_err(|_| bad())?) as usize;
    if count > bytes.len() / 16 + 1 {
        return Err(bad());
    }
    let mut list = Vec::with_capacity(count);
    for _ in 0..count {
        let a = u32::from_le_bytes(read(4)?.try_into().map_err(|_| bad())?) as usize;
        let b = u32::from_le_bytes(read(4)?.try_into().map_err(|_| bad())?) as usize;
        let v = f64::from_le_bytes(read(8)?.try_into().map_err(|_| bad())?);
        list.push((a, b, v));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triples_round_trip_with_non_finite_values() {
        let a = vec![(0, 1, 2.5), (3, 4, f64::INFINITY)];
        let b = vec![(7, 0, f64::NAN)];
        let mut bytes = Vec::new();
        put(&mut bytes, &a);
        put(&mut bytes, &b);
        let mut at = 0;
        assert_eq!(take(&bytes, &mut at).unwrap(), a);
        let back = take(&bytes, &mut at).unwrap();
        assert!(back[0].2.is_nan() && at == bytes.len());
        assert!(take(&bytes[..5], &mut 0).is_err());
        assert!(take(&[255, 255, 255, 255], &mut 0).is_err());
    }
}
