//! Data checked against what the model takes, before it trains: float values finite,
//! integer labels within the classes (or `ignore_index`), token ids within the rows of
//! the table they index. A bad value is named with its file (or step), array, row and
//! value, instead of failing inside ONNX Runtime or surfacing steps later as a
//! non-finite gradient.
//!
//! A data file in memory is checked once, whole ([`super::Batches::check`]); batches
//! read as the run goes (shards, an embedder's) are checked as they come
//! ([`CheckedBatches`]).

use crate::tensor::{DType, Tensor, TensorMap};
use crate::{Error, Result};

use super::StepBatches;

/// What one model input (or the loss's label) takes.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedRule {
    /// The model input or label.
    pub feed: String,
    /// Integer values must lie within this range.
    pub index: Option<IndexRule>,
}

/// Integer values within `[0, below)`, or equal to `except`.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexRule {
    /// One past the largest value.
    pub below: i64,
    /// A value that is always allowed (`ignore_index`).
    pub except: Option<i64>,
    /// What the values index, for the message ("the 100 classes of `logits`").
    pub of: String,
}

/// The first value of `t` that `rule` refuses: its row, its position within the row,
/// and why.
pub fn first_bad_value(t: &Tensor, rule: &FeedRule) -> Option<(usize, Vec<usize>, String)> {
    let row_len: usize = t.shape.iter().skip(1).product();
    let at = |i: usize| -> (usize, Vec<usize>) {
        let (row, mut rest) = (i / row_len.max(1), i % row_len.max(1));
        let mut pos = vec![0; t.shape.len().saturating_sub(1)];
        for (p, &d) in pos.iter_mut().zip(&t.shape[1..]).rev() {
            *p = rest % d.max(1);
            rest /= d.max(1);
        }
        (row, pos)
    };
    let found = |i: usize, why: String| {
        let (row, pos) = at(i);
        Some((row, pos, why))
    };
    match t.dtype() {
        DType::F32 => {
            let v = t.as_f32()?;
            let i = v.iter().position(|x| !x.is_finite())?;
            found(i, format!("{} (float inputs must be finite)", v[i]))
        }
        DType::F64 => {
            let v = t.as_f64()?;
            let i = v.iter().position(|x| !x.is_finite())?;
            found(i, format!("{} (float inputs must be finite)", v[i]))
        }
        DType::I64 | DType::I32 => {
            let r = rule.index.as_ref()?;
            let v = t.to_i64_vec()?;
            let ok = |x: i64| (0..r.below).contains(&x) || Some(x) == r.except;
            let i = v.iter().position(|&x| !ok(x))?;
            let except = r.except.map_or(String::new(), |e| format!(", nor {e}"));
            found(
                i,
                format!("{} is outside [0, {}){except}: {}", v[i], r.below, r.of),
            )
        }
        DType::Bool => None,
    }
}

/// `row 17`, or `row 17, position [5]` for rows of several values.
pub fn place(row: usize, pos: &[usize]) -> String {
    match pos {
        [] => format!("row {row}"),
        _ => format!("row {row}, position {pos:?}"),
    }
}

/// Checks each batch as it is read (data not held in memory whole): a bad value stops
/// the run before its step trains, named by step, input, row and value.
pub struct CheckedBatches {
    inner: Box<dyn StepBatches>,
    rules: Vec<FeedRule>,
    /// Where the batches come from, for messages (a shard folder, "the embedder").
    source: std::path::PathBuf,
}

impl CheckedBatches {
    /// `inner`'s batches, each checked against `rules`.
    pub fn new(
        inner: Box<dyn StepBatches>,
        rules: Vec<FeedRule>,
        source: std::path::PathBuf,
    ) -> CheckedBatches {
        CheckedBatches {
            inner,
            rules,
            source,
        }
    }

    fn check(&self, step: usize, batch: TensorMap) -> Result<TensorMap> {
        for rule in &self.rules {
            let Some(t) = batch.get(&rule.feed) else {
                continue;
            };
            if let Some((row, pos, why)) = first_bad_value(t, rule) {
                return Err(Error::Data {
                    path: self.source.clone(),
                    what: format!("step {step}'s batch, input `{}`", rule.feed),
                    reason: format!("{}: {why}", place(row, &pos)),
                });
            }
        }
        Ok(batch)
    }
}

impl StepBatches for CheckedBatches {
    fn batch(&self, step: usize) -> Result<TensorMap> {
        self.check(step, self.inner.batch(step)?)
    }

    fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        self.check(step, self.inner.part(step, part, parts)?)
    }

    fn check_all(&self, _: &[FeedRule]) -> Result<bool> {
        Ok(true)
    }
}
