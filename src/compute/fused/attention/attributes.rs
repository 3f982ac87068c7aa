//! An attention call's attributes (see the parent module's doc) and the views of its
//! `Q`, `K`, `V` they give.

use ort::operator::KernelContext;

use super::View;

/// The attributes of a call (see the parent module's doc).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attributes {
    pub(crate) scale: f32,
    pub(crate) causal: bool,
    /// `lse = 1`: the forward's second output is each query row's log-sum-exp of its
    /// scores, `[B, H, T]`, not `P`; the backward takes it and `O` (see the module doc).
    pub(crate) lse: bool,
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    pub(crate) out: [usize; 4],
    /// Q, K and V as parts of one packed `[B, T, W]` tensor (`PackedAttention`): heads
    /// and head size, and where each part starts on the last axis.
    pub(crate) packed: Option<([usize; 2], [usize; 3])>,
}

impl Attributes {
    pub(crate) fn of(info: &KernelContext<'_>, op: &str) -> ort::Result<Self> {
        let perm = |name: &str| -> ort::Result<[usize; 4]> {
            let v = info
                .get::<Vec<i64>>(name)
                .unwrap_or_else(|| vec![0, 1, 2, 3]);
            let mut p = [0usize; 4];
            let mut seen = [false; 4];
            for (i, &a) in v.iter().enumerate().take(4) {
                if (0..4).contains(&a) && !seen[a as usize] {
                    seen[a as usize] = true;
                    p[i] = a as usize;
                }
            }
            if v.len() != 4 || seen.contains(&false) {
                return Err(ort::Error::new(format!(
                    "{op}: attribute {name} = {v:?} (want a permutation of 0..4)"
                )));
            }
            Ok(p)
        };
        Ok(Self {
            scale: info.get::<f32>("scale").unwrap_or(1.0),
            causal: info.get::<i64>("causal").unwrap_or(0) != 0,
            lse: info.get::<i64>("lse").unwrap_or(0) != 0,
            q: perm("q_perm")?,
            k: perm("k_perm")?,
            v: perm("v_perm")?,
            out: perm("out_perm")?,
            packed: Self::packed(info, op)?,
        })
    }

    /// The shape of what the forward keeps for the backward over scores `[b, h, t, s]`:
    /// `P` itself, or with `lse` each row's log-sum-exp, `[b, h, t]`.
    pub(crate) fn kept(&self, [b, h, t, s]: [usize; 4]) -> Vec<i64> {
        let dims: &[usize] = if self.lse { &[b, h, t] } else { &[b, h, t, s] };
        dims.iter().map(|&d| d as i64).collect()
    }

    /// The `heads_dim` and `offsets` attributes of `PackedAttention`, `None` elsewhere.
    fn packed(info: &KernelContext<'_>, op: &str) -> ort::Result<Option<([usize; 2], [usize; 3])>> {
        let (Some(hd), Some(offsets)) = (
            info.get::<Vec<i64>>("heads_dim"),
            info.get::<Vec<i64>>("offsets"),
        ) else {
            return Ok(None);
        };
        match (&hd[..], &offsets[..]) {
            (&[h, d], &[q, k, v]) if [h, d, q, k, v].iter().all(|&x| x >= 0) => Ok(Some((
                [h as usize, d as usize],
                [q as usize, k as usize, v as usize],
            ))),
            _ => Err(ort::Error::new(format!(
                "{op}: heads_dim {hd:?} and offsets {offsets:?} (want 2 and 3 values >= 0)"
            ))),
        }
    }
}

/// The logical views of `Q`, `K` (turned), `V` and their agreement: `[B, H, T, D]`,
/// `[B, H, D, S]`, `[B, H, S, E]`.
pub(crate) fn views(op: &str, a: &Attributes, shapes: [&[i64]; 3]) -> ort::Result<[View; 3]> {
    let bad = || {
        ort::Error::new(format!(
            "{op}: Q {:?}, K {:?}, V {:?} with permutations {:?}, {:?}, {:?} are not \
             [B, H, T, D], [B, H, D, S], [B, H, S, E] (S >= T if causal)",
            shapes[0], shapes[1], shapes[2], a.q, a.k, a.v
        ))
    };
    let view = |i: usize, perm: [usize; 4]| match a.packed {
        Some((hd, offsets)) => View::part(shapes[i], hd, offsets[i], perm),
        None => View::of(shapes[i], perm),
    };
    let (Some(q), Some(k), Some(v)) = (view(0, a.q), view(1, a.k), view(2, a.v)) else {
        return Err(bad());
    };
    // A causal mask needs a key for every query (query `i` sees keys up to `i + S - T`).
    let agree = q.dims[..2] == k.dims[..2]
        && k.dims[..2] == v.dims[..2]
        && q.dims[3] == k.dims[2]
        && k.dims[3] == v.dims[2]
        && (!a.causal || k.dims[3] >= q.dims[2]);
    if !agree {
        return Err(bad());
    }
    Ok([q, k, v])
}
