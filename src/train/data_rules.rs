//! The data checked against the model before the run builds its graphs: each input's
//! element type, and (unless `data.check = false`) the values ([`crate::data::FeedRule`]):
//! token ids within the rows of the table a `Gather` looks them up in, and a
//! cross-entropy's labels within the prediction's classes or `ignore_index`.

use std::path::{Path, PathBuf};

use crate::config::TrainConfig;
use crate::data::{CheckedBatches, FeedRule, IndexRule, StepBatches};
use crate::graph::{declared_type, Graph, LossSpec};
use crate::onnx::proto::ModelProto;
use crate::tensor::{DType, TensorMap};
use crate::{Error, Result};

/// Ops between a model input and the `Gather` that looks it up which keep its values.
const KEEPS_VALUES: [&str; 6] = [
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Identity",
    "Cast",
];

/// Where the run's data comes from, for messages.
fn source(cfg: &TrainConfig, fed: bool) -> PathBuf {
    match (&cfg.data.shards, fed) {
        (_, true) => "the embedder's batches".into(),
        (Some(s), _) => s.train_data_dir.clone(),
        (None, _) if cfg.data.synth.is_some() => "data.synth".into(),
        (None, _) => cfg.data.path.clone(),
    }
}

/// Checks `example` (a first micro-batch) against the model's input types, then the
/// data's values against what the model takes: all of a data file now, other batches
/// as they are read (the returned source checks them).
///
/// # Errors
/// `Data` naming the source, the input or array, and the value (or type) refused.
pub(super) fn checked_batches(
    cfg: &TrainConfig,
    model: &ModelProto,
    batches: Box<dyn StepBatches>,
    example: &TensorMap,
    fed: bool,
) -> Result<Box<dyn StepBatches>> {
    let g = Graph::from_model(model)?;
    let from = source(cfg, fed);
    check_types(&g, &cfg.loss, example, &from)?;
    if !cfg.data.check {
        return Ok(batches);
    }
    let rules = feed_rules(&g, &cfg.loss, example);
    match batches.check_all(&rules)? {
        true => Ok(batches),
        false => Ok(Box::new(CheckedBatches::new(batches, rules, from))),
    }
}

/// Each fed tensor has the element type its model input declares, and a cross-entropy's
/// label is an integer array.
fn check_types(g: &Graph, loss: &LossSpec, example: &TensorMap, from: &Path) -> Result<()> {
    let name = |d: DType| format!("{d:?}").to_lowercase();
    for (feed, t) in example {
        let declared = g
            .inputs
            .iter()
            .find(|v| v.name == *feed)
            .and_then(declared_type)
            .and_then(|(code, _)| DType::from_onnx(code));
        let cross_entropy_label =
            matches!(loss, LossSpec::SoftmaxCrossEntropy { label, .. } if label == feed);
        let refused = match declared {
            Some(want) if want != t.dtype() => {
                Some(format!("the model's input `{feed}` is {}", name(want)))
            }
            _ if cross_entropy_label && !matches!(t.dtype(), DType::I64 | DType::I32) => Some(
                format!("`{feed}` is the label of a softmax cross-entropy, which takes integer class indices (int64)"),
            ),
            _ => None,
        };
        if let Some(rule) = refused {
            return Err(Error::Data {
                path: from.to_path_buf(),
                what: format!("the data feeding `{feed}`"),
                reason: format!("it is {}, but {rule}", name(t.dtype())),
            });
        }
    }
    Ok(())
}

/// The value rules of the fed inputs: integer inputs that index tables, and the label, in
/// a fixed order (the example is a hash map).
fn feed_rules(g: &Graph, loss: &LossSpec, example: &TensorMap) -> Vec<FeedRule> {
    let mut rules: Vec<FeedRule> = example
        .keys()
        .map(|feed| FeedRule {
            feed: feed.clone(),
            index: table_rows(g, feed).map(|(table, rows)| IndexRule {
                below: rows,
                except: None,
                of: format!("the {rows} rows of `{table}`, which it indexes"),
            }),
        })
        .collect();
    // The model's inputs in the graph's order, then the label and any other array: the
    // first bad value is reported against the same array in every run.
    rules.sort_by_cached_key(|r| {
        let at = g.inputs.iter().position(|v| v.name == r.feed);
        (at.unwrap_or(usize::MAX), r.feed.clone())
    });
    if let LossSpec::SoftmaxCrossEntropy {
        prediction,
        label,
        ignore_index,
        class_axis,
        ..
    } = loss
    {
        let label_rank = example.get(label).map(|t| t.shape.clone());
        let classes = label_rank.and_then(|ls| classes(g, prediction, *class_axis, &ls));
        if let (Some(rule), Some(n)) = (rules.iter_mut().find(|r| r.feed == *label), classes) {
            rule.index = Some(IndexRule {
                below: n,
                except: *ignore_index,
                of: format!("the {n} classes of `{prediction}`"),
            });
        }
    }
    rules
}

/// The smallest table a `Gather` looks `input`'s values up in (directly or through ops
/// that keep the values): its name and rows.
fn table_rows(g: &Graph, input: &str) -> Option<(String, i64)> {
    let mut reach = vec![input.to_string()];
    let mut best: Option<(String, i64)> = None;
    while let Some(v) = reach.pop() {
        for n in g.nodes.iter().filter(|n| n.input.contains(&v)) {
            if KEEPS_VALUES.contains(&n.op_type.as_str()) && n.input[0] == v {
                reach.extend(n.output.iter().cloned());
            } else if n.op_type == "Gather" && n.input.get(1) == Some(&v) {
                let axis = n
                    .attribute
                    .iter()
                    .find(|a| a.name == "axis")
                    .map_or(0, |a| a.i);
                let Some(t) = g.initializer(&n.input[0]) else {
                    continue;
                };
                let rank = t.dims.len() as i64;
                let axis = if axis < 0 { axis + rank } else { axis };
                if let Some(&rows) = t.dims.get(axis as usize) {
                    if best.as_ref().is_none_or(|(_, r)| rows < *r) {
                        best = Some((n.input[0].clone(), rows));
                    }
                }
            }
        }
    }
    best
}

/// The number of classes of `prediction` as the model declares it, on the axis the loss
/// takes them from for labels of shape `label` (see `graph/loss/label.rs`); `None` when
/// that dimension is symbolic.
fn classes(g: &Graph, prediction: &str, class_axis: Option<i64>, label: &[usize]) -> Option<i64> {
    let (_, dims) = g
        .outputs
        .iter()
        .find(|v| v.name == prediction)
        .and_then(declared_type)?;
    let rank = dims.len();
    if rank < 2 {
        return None;
    }
    let fits = |skip: usize| -> bool {
        let without: Vec<Option<i64>> = dims
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != skip)
            .map(|(_, d)| *d)
            .collect();
        without.len() == label.len()
            && without
                .iter()
                .zip(label)
                .skip(1)
                .all(|(d, &l)| d.is_none_or(|d| d == l as i64))
    };
    let axis = match class_axis {
        Some(a) if a < 0 => (a + rank as i64) as usize,
        Some(a) => a as usize,
        None if rank >= 3 && fits(rank - 1) && !fits(1) => rank - 1,
        None => 1,
    };
    dims.get(axis).copied().flatten()
}
