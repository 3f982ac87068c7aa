//! The scores between attention's two products: their scale, and their mask (added, or
//! a causal `Where`), as [`Finder::at`] takes them in.

use super::Finder;
use crate::graph::ir::attr_i;
use crate::tensor::{DType, Tensor};

/// How the scores are masked before the softmax.
#[derive(Clone, Copy)]
pub(super) enum Mask<'g> {
    None,
    /// `+ mask`, the value named.
    Added(&'g str),
    /// A constant causal pattern given some other way (`Where`).
    Causal,
}

/// Masked scores at most this: their probabilities are exactly 0 in float32 (`exp`
/// underflows) for any scores within 1e7 of each other.
const MASKED: f64 = -1e8;

/// Whether `mask` is causal for `scores` (`[B, H, T, S]`): `[T, S]` matrices (one, or one
/// per batch row or head, all alike), 0 where key `j <= i + S - T` and at most [`MASKED`]
/// (or `-inf`) elsewhere, as PyTorch models build it.
pub(super) fn causal(mask: &Tensor, scores: &[usize]) -> bool {
    let shape = &mask.shape;
    let n = shape.len();
    if n < 2 || scores.len() != 4 {
        return false;
    }
    let (t, s) = (shape[n - 2], shape[n - 1]);
    if t != scores[2] || s != scores[3] || s < t {
        return false;
    }
    let values = mask.to_f64_vec();
    values.chunks_exact(t * s).all(|matrix| {
        (0..t).all(|i| {
            let row = &matrix[i * s..(i + 1) * s];
            let seen = i + s - t + 1;
            row[..seen].iter().all(|&m| m == 0.0) && row[seen..].iter().all(|&m| m <= MASKED)
        })
    })
}

impl<'g> Finder<'g> {
    /// The scores `x` scaled by a one-value constant (`x * c`, `c * x`, `x / c`) where
    /// that is their only reader: the scale (1 without) and the scaled scores.
    pub(super) fn scale(&self, x: &'g str, chain: &mut Vec<usize>) -> Option<(f64, &'g str)> {
        let next = self.only(x)?;
        if !self.is(next, "Mul") && !self.is(next, "Div") {
            return Some((1.0, x));
        }
        let n = &self.g.nodes[next];
        let other = usize::from(n.input[0] == x);
        let c = self.scalar(&n.input[other])?;
        let scale = match n.op_type.as_str() {
            "Mul" => c,
            _ if other == 1 => 1.0 / c,
            _ => return None,
        };
        chain.push(next);
        Some((scale, &n.output[0]))
    }

    /// The scores `x` (of shape `scores`) masked where that is their only reader: the
    /// mask and the masked scores. An added mask must broadcast to the scores, be
    /// float32, and not depend on a trained parameter. A `Where(cond, x, fill)` (Hugging
    /// Face's eager GPT-2, through a `Cast` to float32 that copies) is taken where `cond`
    /// is a constant causal pattern and `fill` at most [`MASKED`]: after the softmax it
    /// is the added mask `cond ? 0 : fill` (both give exactly 0 where masked), which the
    /// kernel has as its own.
    pub(super) fn mask(
        &self,
        x: &'g str,
        scores: &[usize],
        chain: &mut Vec<usize>,
    ) -> Option<(Mask<'g>, &'g str)> {
        let mut next = self.only(x)?;
        let mut x = x;
        let n = &self.g.nodes[next];
        if self.is(next, "Cast") && attr_i(n, "to") == Some(1) {
            chain.push(next);
            x = n.output[0].as_str();
            next = self.only(x)?;
        }
        let n = &self.g.nodes[next];
        let same_shape = self
            .metas
            .get(&n.output[0])
            .is_some_and(|o| o.shape == scores);
        if self.is(next, "Where") {
            let cond = self.consts.get(&n.input[0])?;
            let fill = self.scalar(&n.input[2])?;
            let open = |k: &f64| if *k != 0.0 { 0.0 } else { fill };
            let added = Tensor::f64(
                cond.shape.clone(),
                cond.to_f64_vec().iter().map(open).collect(),
            );
            let fits = n.input[1] == x && fill <= MASKED && same_shape;
            (fits && added.is_ok_and(|m| causal(&m, scores))).then_some(())?;
            chain.push(next);
            return Some((Mask::Causal, &n.output[0]));
        }
        if !self.is(next, "Add") {
            return Some((Mask::None, x));
        }
        let m = n.input[usize::from(n.input[0] == x)].as_str();
        let fits = m != x && same_shape && self.broadcasts(m, scores) && !self.graded.contains(m);
        if !fits {
            return None;
        }
        chain.push(next);
        Some((Mask::Added(m), &n.output[0]))
    }

    /// Whether `mask` is float32 and broadcasts to `scores` (rank 4 at most).
    fn broadcasts(&self, mask: &str, scores: &[usize]) -> bool {
        let Some(m) = self.metas.get(mask) else {
            return false;
        };
        let lead = scores.len().saturating_sub(m.shape.len());
        m.dtype == DType::F32
            && m.shape.len() <= scores.len()
            && m.shape
                .iter()
                .zip(&scores[lead..])
                .all(|(&d, &s)| d == 1 || d == s)
    }
}
