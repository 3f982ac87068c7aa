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
        let file = Opened {
            cfg,
            config_path,
            arrays: &arrays,
        };
        if cfg.layout.is_unset() {
            return Err(file.bad(
                "data.layout",
                "missing: say which arrays feed which model inputs".into(),
            ));
        }
        let rows = file.rows()?;
        let order = file.batch_order(rows, global_batch)?;
        if global_batch > rows {
            return Err(file.bad(
                "batch_size",
                format!("batches of {global_batch} rows from {rows} rows of data"),
            ));
        }
        Ok(Batches {
            layout: cfg.layout.clone(),
            order,
            batch_size: global_batch,
            rows,
            source: match cfg.synth {
                Some(_) => "data.synth".into(),
                None => cfg.path.clone(),
            },
            arrays,
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

/// A data file's arrays as read, checked against the configuration that names them.
struct Opened<'a> {
    cfg: &'a DataConfig,
    config_path: &'a Path,
    arrays: &'a HashMap<String, Tensor>,
}

impl Opened<'_> {
    /// The configuration error of `field`.
    fn bad(&self, field: &str, rule: String) -> Error {
        Error::Config {
            path: self.config_path.to_path_buf(),
            field: field.into(),
            rule,
        }
    }

    /// The array `name` that `field` names.
    fn get(&self, field: &str, name: &str) -> Result<&Tensor> {
        self.arrays.get(name).ok_or_else(|| {
            let mut have: Vec<&String> = self.arrays.keys().collect();
            have.sort();
            let file = self.cfg.path.display();
            self.bad(
                field,
                format!("{file} has no array `{name}` (it has {have:?})"),
            )
        })
    }

    /// The rows of the layout's arrays, which must agree (a next-token array: int64
    /// `[rows, T + 1]`).
    fn rows(&self) -> Result<usize> {
        let used: Vec<(&str, &str)> = match &self.cfg.layout {
            DataLayout::Arrays { feeds } => feeds
                .values()
                .map(|a| ("data.layout.feeds", a.as_str()))
                .collect(),
            DataLayout::NextToken { array, .. } => vec![("data.layout.array", array.as_str())],
        };
        let mut rows = None;
        for (field, name) in used {
            let t = self.get(field, name)?;
            let n = *t
                .shape
                .first()
                .ok_or_else(|| self.bad(field, format!("array `{name}` is a scalar")))?;
            if let Some(r) = rows.filter(|&r| r != n) {
                let rule = format!("array `{name}` has {n} rows, other arrays {r}");
                return Err(self.bad(field, rule));
            }
            rows = Some(n);
            let next_token = matches!(self.cfg.layout, DataLayout::NextToken { .. });
            if next_token && (t.shape.len() != 2 || t.shape[1] < 2 || t.as_i64().is_none()) {
                let rule = format!(
                    "array `{name}` must be int64 [rows, T + 1], got {:?} {:?}",
                    t.dtype(),
                    t.shape
                );
                return Err(self.bad(field, rule));
            }
        }
        Ok(rows.unwrap_or(0))
    }

    /// The rows of each step from `data.batch_order`, when named: integer `[steps,
    /// batch]`, indices within the data's `rows`, `global_batch` of them a step.
    fn batch_order(&self, rows: usize, global_batch: usize) -> Result<Option<Vec<Vec<usize>>>> {
        let Some(name) = &self.cfg.batch_order else {
            return Ok(None);
        };
        let field = "data.batch_order";
        let t = self.get(field, name)?;
        let v = t
            .to_i64_vec()
            .filter(|_| t.shape.len() == 2)
            .ok_or_else(|| {
                self.bad(
                    field,
                    format!("array `{name}` must be an integer [steps, batch] array"),
                )
            })?;
        if let Some(&r) = v.iter().find(|&&r| r < 0 || r as usize >= rows) {
            return Err(self.bad(
                field,
                format!("row index {r} is outside the {rows} rows of data"),
            ));
        }
        let width = t.shape[1];
        if width != global_batch && !v.is_empty() {
            return Err(self.bad(
                "batch_size",
                format!(
                    "batch_size x gradient_accumulation_steps x data_parallel_size = {global_batch} must equal the {width} rows per step of data.batch_order"
                ),
            ));
        }
        Ok(Some(
            v.chunks(width.max(1))
                .map(|c| c.iter().map(|&r| r as usize).collect())
                .collect(),
        ))
    }
}
