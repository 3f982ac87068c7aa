//! Turning the arrays of a data file into per-step batches.

use std::collections::HashMap;
use std::path::Path;

use super::check::{first_bad_value, place, FeedRule};
use super::{DataConfig, DataLayout};
use crate::tensor::{Tensor, TensorMap};
use crate::{Error, Result};

/// Makes the batch of each step from an `.npz` file's arrays.
#[derive(Debug)]
pub struct Batches {
    arrays: HashMap<String, Tensor>,
    layout: DataLayout,
    order: Option<Vec<Vec<usize>>>,
    batch_size: usize,
    rows: usize,
    /// The data file (`data.synth` for generated data), for messages.
    source: std::path::PathBuf,
}

impl Batches {
    /// Reads the data file and checks that the layout's arrays are there and agree.
    ///
    /// # Errors
    /// `Io`/`Data` for the file, `Config` naming the field whose array is missing or
    /// malformed.
    pub fn open(cfg: &DataConfig, global_batch: usize, config_path: &Path) -> Result<Batches> {
        let arrays = match &cfg.synth {
            Some(spec) => super::generate(spec)?,
            None => super::read_npz(&cfg.path)?,
        };
        let bad = |field: &str, rule: String| Error::Config {
            path: config_path.to_path_buf(),
            field: field.into(),
            rule,
        };
        let get = |field: &str, name: &str| -> Result<&Tensor> {
            arrays.get(name).ok_or_else(|| {
                let mut have: Vec<&String> = arrays.keys().collect();
                have.sort();
                bad(
                    field,
                    format!(
                        "{} has no array `{name}` (it has {have:?})",
                        cfg.path.display()
                    ),
                )
            })
        };
        if cfg.layout.is_unset() {
            return Err(bad(
                "data.layout",
                "missing: say which arrays feed which model inputs".into(),
            ));
        }
        let used: Vec<(&str, &str)> = match &cfg.layout {
            DataLayout::Arrays { feeds } => feeds
                .values()
                .map(|a| ("data.layout.feeds", a.as_str()))
                .collect(),
            DataLayout::NextToken { array, .. } => vec![("data.layout.array", array.as_str())],
        };
        let mut rows = None;
        for (field, name) in used {
            let t = get(field, name)?;
            let n = *t
                .shape
                .first()
                .ok_or_else(|| bad(field, format!("array `{name}` is a scalar")))?;
            if rows.is_some_and(|r| r != n) {
                return Err(bad(
                    field,
                    format!(
                        "array `{name}` has {n} rows, other arrays {}",
                        rows.unwrap_or(0)
                    ),
                ));
            }
            rows = Some(n);
            if let DataLayout::NextToken { .. } = cfg.layout {
                if t.shape.len() != 2 || t.shape[1] < 2 || t.as_i64().is_none() {
                    return Err(bad(
                        field,
                        format!(
                            "array `{name}` must be int64 [rows, T + 1], got {:?} {:?}",
                            t.dtype(),
                            t.shape
                        ),
                    ));
                }
            }
        }
        let rows = rows.unwrap_or(0);
        let order = match &cfg.batch_order {
            Some(name) => {
                let t = get("data.batch_order", name)?;
                let v = t
                    .to_i64_vec()
                    .filter(|_| t.shape.len() == 2)
                    .ok_or_else(|| {
                        bad(
                            "data.batch_order",
                            format!("array `{name}` must be an integer [steps, batch] array"),
                        )
                    })?;
                if let Some(&r) = v.iter().find(|&&r| r < 0 || r as usize >= rows) {
                    return Err(bad(
                        "data.batch_order",
                        format!("row index {r} is outside the {rows} rows of data"),
                    ));
                }
                let w = t.shape[1];
                Some(
                    v.chunks(w.max(1))
                        .map(|c| c.iter().map(|&r| r as usize).collect::<Vec<usize>>())
                        .collect::<Vec<_>>(),
                )
            }
            None => None,
        };
        if let Some(width) = order.as_ref().and_then(|o| o.first()).map(Vec::len) {
            if width != global_batch {
                return Err(bad(
                    "batch_size",
                    format!(
                        "batch_size x gradient_accumulation_steps x data_parallel_size = {global_batch} must equal the {width} rows per step of data.batch_order"
                    ),
                ));
            }
        }
        let batch_size = global_batch;
        if batch_size > rows {
            return Err(bad(
                "batch_size",
                format!("batches of {batch_size} rows from {rows} rows of data"),
            ));
        }
        Ok(Batches {
            arrays,
            layout: cfg.layout.clone(),
            order,
            batch_size,
            rows,
            source: match cfg.synth {
                Some(_) => "data.synth".into(),
                None => cfg.path.clone(),
            },
        })
    }

    /// Checks every value of the arrays that feed the inputs `rules` name (see
    /// [`super::check`]): the first bad one is an error naming the file, array, row and
    /// value. A next-token array is checked as a whole against both its rules.
    ///
    /// # Errors
    /// `Data` for the first value a rule refuses.
    pub fn check(&self, rules: &[FeedRule]) -> Result<()> {
        for rule in rules {
            let array = match &self.layout {
                DataLayout::Arrays { feeds } => feeds.get(&rule.feed),
                DataLayout::NextToken {
                    array,
                    input,
                    label,
                } => (rule.feed == *input || rule.feed == *label).then_some(array),
            };
            let Some((name, t)) = array.and_then(|a| Some((a, self.arrays.get(a)?))) else {
                continue;
            };
            if let Some((row, pos, why)) = first_bad_value(t, rule) {
                return Err(Error::Data {
                    path: self.source.clone(),
                    what: format!("array `{name}` (feeding `{}`)", rule.feed),
                    reason: format!("{}: {why}", place(row, &pos)),
                });
            }
        }
        Ok(())
    }

    /// Rows per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Rows of data.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Steps in the batch order, when steps follow one.
    pub fn order_len(&self) -> Option<usize> {
        self.order.as_ref().map(Vec::len)
    }

    /// The batch of step `step` (the order repeats when the steps outnumber it).
    ///
    /// # Errors
    /// `BadTensor` only if the arrays changed shape since `open` (they cannot).
    pub fn batch(&self, step: usize) -> Result<TensorMap> {
        self.of_rows(&self.rows_of(step))
    }

    /// Part `part` of `parts` equal parts of step `step`'s batch (a micro-batch of one
    /// replica); the batch must divide evenly (checked by the configuration).
    ///
    /// # Errors
    /// As [`Batches::batch`].
    pub fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        let rows = self.rows_of(step);
        let len = rows.len() / parts.max(1);
        let start = (part * len).min(rows.len());
        self.of_rows(&rows[start..(start + len).min(rows.len())])
    }

    /// The data rows of step `step`'s batch.
    fn rows_of(&self, step: usize) -> Vec<usize> {
        match &self.order {
            Some(o) => o[step % o.len()].clone(),
            None => (0..self.batch_size)
                .map(|i| (step * self.batch_size + i) % self.rows)
                .collect(),
        }
    }

    fn of_rows(&self, rows: &[usize]) -> Result<TensorMap> {
        let mut out = TensorMap::new();
        match &self.layout {
            DataLayout::Arrays { feeds } => {
                for (input, array) in feeds {
                    out.insert(input.clone(), self.arrays[array].gather_rows(rows)?);
                }
            }
            DataLayout::NextToken {
                array,
                input,
                label,
            } => {
                let t = self.arrays[array].gather_rows(rows)?;
                let (b, w) = (t.shape[0], t.shape[1]);
                let v = t.as_i64().unwrap_or_default();
                let shifted = |off: usize| -> Vec<i64> {
                    (0..b)
                        .flat_map(|r| v[r * w + off..r * w + off + w - 1].iter().copied())
                        .collect()
                };
                out.insert(input.clone(), Tensor::i64(vec![b, w - 1], shifted(0))?);
                out.insert(label.clone(), Tensor::i64(vec![b, w - 1], shifted(1))?);
            }
        }
        Ok(out)
    }
}

impl super::StepBatches for Batches {
    fn batch(&self, step: usize) -> Result<TensorMap> {
        Batches::batch(self, step)
    }

    fn part(&self, step: usize, part: usize, parts: usize) -> Result<TensorMap> {
        Batches::part(self, step, part, parts)
    }

    fn check_all(&self, rules: &[FeedRule]) -> Result<bool> {
        self.check(rules).map(|()| true)
    }
}
