//! Which initializers train (`[params]`): not the buffers the exporter wrote as
//! initializers, and not the embedding rows PyTorch's `padding_idx` leaves as they are.
//!
//! ONNX does not tell parameters from buffers: `torch.onnx.export` writes both as
//! initializers (BART's `final_logits_bias`, for one). The dynamo exporter
//! (`dynamo=True`) says which is which in each initializer's value info
//! (`pkg.torch.export.graph_signature.InputSpec.kind`: `PARAMETER` or `BUFFER`), and
//! what it calls a buffer does not train; so do the buffers and frozen parameters that
//! `tools/export_for_training.py` records in the model's metadata (`graph::declared`,
//! with the padding rows). Otherwise every floating-point initializer but BatchNorm's
//! running statistics trains unless it is listed in `frozen`.
//!
//! `nn.Embedding(padding_idx=p)` zeroes row `p` at initialization and never gives it a
//! gradient from the lookup; the ONNX export keeps only a `Gather`, so the row would
//! train. A trained table read by a `Gather` of integer ids whose one all-zero row at
//! initialization is that padding row: its gradient from the `Gather` is kept zero
//! (other uses of the table, such as a tied language-model head, still reach it, as in
//! PyTorch). Rows can also be listed, and the detection turned off.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::graph::ir::{attr_i, Graph};
use crate::graph::training::InitValue;
use crate::onnx::proto::ModelProto;
use crate::tensor::DType;
use crate::{Error, Result};

/// Which initializers and embedding rows are not trained (`[params]` in a
/// configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamOptions {
    /// Floating-point initializers that are not parameters (PyTorch buffers).
    #[serde(default)]
    pub frozen: Vec<String>,
    /// Find padding rows: the one all-zero row of a trained table looked up by `Gather`
    /// (default true).
    #[serde(default = "yes")]
    pub detect_padding_rows: bool,
    /// Rows to freeze by table (initializer) name, beside the detected ones.
    #[serde(default)]
    pub frozen_rows: BTreeMap<String, Vec<i64>>,
}

fn yes() -> bool {
    true
}

impl Default for ParamOptions {
    fn default() -> ParamOptions {
        ParamOptions {
            frozen: Vec::new(),
            detect_padding_rows: true,
            frozen_rows: BTreeMap::new(),
        }
    }
}

/// The rows to freeze by table: the listed ones, and the detected padding rows of the
/// trained `params` (name, initial value) that `g` looks up along axis 0.
pub fn rows_to_freeze(
    g: &Graph,
    params: &[(String, InitValue)],
    opts: &ParamOptions,
) -> BTreeMap<String, Vec<i64>> {
    let mut out = opts.frozen_rows.clone();
    if !opts.detect_padding_rows {
        return out;
    }
    for n in g.nodes.iter().filter(|n| n.op_type == "Gather") {
        let table = n.input[0].as_str();
        if attr_i(n, "axis").unwrap_or(0) != 0 || out.contains_key(table) {
            continue;
        }
        let Some((_, init)) = params.iter().find(|(p, _)| p == table) else {
            continue;
        };
        if let Some(row) = single_zero_row(init) {
            tracing::info!(
                "embedding `{table}`: row {row} is all zeros at initialization, PyTorch's \
                 padding row (`padding_idx`); its lookups give it no gradient (set \
                 [params] detect_padding_rows = false to train it)"
            );
            out.insert(table.to_string(), vec![row]);
        }
    }
    out
}

/// The index of the only all-zero row of a float32 matrix with several rows (read in
/// place: an embedding table can be most of a model).
fn single_zero_row(t: &InitValue) -> Option<i64> {
    let shape = t.view().shape;
    if shape.len() != 2 || shape[0] < 2 || shape[1] == 0 {
        return None;
    }
    let values = t.as_f32()?;
    let mut zero_rows = values
        .chunks(shape[1])
        .enumerate()
        .filter(|(_, r)| r.iter().all(|&v| v == 0.0))
        .map(|(i, _)| i as i64);
    let first = zero_rows.next()?;
    zero_rows.next().is_none().then_some(first)
}

/// The initializers to train: `trainable` (each must be an initializer), else every
/// floating-point initializer but BatchNormalization's running statistics; less the
/// `opts.frozen` names.
pub(crate) fn trainable_names(
    g: &Graph,
    trainable: Option<&[String]>,
    opts: &ParamOptions,
    buffers: &HashSet<String>,
) -> Result<Vec<String>> {
    for n in &opts.frozen {
        if g.initializer(n).is_none() {
            return Err(Error::MissingValue {
                role: "frozen initializer ([params] frozen)",
                name: n.clone(),
                hint: "; it must be an initializer of the model".into(),
            });
        }
    }
    let names = match trainable {
        Some(names) => {
            for n in names {
                if g.initializer(n).is_none() {
                    return Err(Error::MissingValue {
                        role: "trainable parameter",
                        name: n.clone(),
                        hint: "; it must be an initializer of the model".into(),
                    });
                }
            }
            names.to_vec()
        }
        None => {
            let stats = running_statistics(g);
            if !stats.is_empty() {
                tracing::info!(
                    "{} BatchNormalization running statistics are state, not parameters: \
                     training normalizes with batch statistics and updates them as PyTorch's \
                     train() does; evaluation and the trained model normalize with them",
                    stats.len()
                );
            }
            let mut declared: Vec<&str> = g
                .initializers
                .iter()
                .map(|t| t.name.as_str())
                .filter(|n| buffers.contains(*n) && !stats.contains(n))
                .collect();
            if !declared.is_empty() {
                declared.sort_unstable();
                tracing::info!(
                    "{} initializers the exporter declared buffers are not trained: {}",
                    declared.len(),
                    declared.join(", ")
                );
            }
            g.initializers
                .iter()
                .filter(|t| DType::from_onnx(t.data_type).is_some_and(|d| d.is_float()))
                .filter(|t| !stats.contains(t.name.as_str()) && !buffers.contains(&t.name))
                .map(|t| t.name.clone())
                .collect()
        }
    };
    Ok(names
        .into_iter()
        .filter(|n| !opts.frozen.contains(n))
        .collect())
}

/// The value-info key under which the dynamo exporter records what an initializer is.
const INPUT_KIND: &str = "pkg.torch.export.graph_signature.InputSpec.kind";

/// The initializers the exporter declared to be something other than parameters that
/// train: the dynamo exporter's `BUFFER`s and `CONSTANT_TENSOR`s, and the buffers and
/// frozen parameters `tools/export_for_training.py` records (`graph::declared`); empty
/// for exporters that do not say.
pub(crate) fn declared_buffers(model: &ModelProto) -> HashSet<String> {
    let mut out: HashSet<String> = super::declared::Declared::of(model)
        .not_trained()
        .cloned()
        .collect();
    let Some(g) = model.graph.as_ref() else {
        return out;
    };
    out.extend(dynamo_buffers(g));
    out
}

/// The dynamo exporter's declarations, from each initializer's value info.
fn dynamo_buffers(g: &crate::onnx::proto::GraphProto) -> Vec<String> {
    g.value_info
        .iter()
        .chain(&g.input)
        .filter(|v| {
            v.metadata_props
                .iter()
                .any(|p| p.key == INPUT_KIND && p.value != "PARAMETER" && p.value != "USER_INPUT")
        })
        .map(|v| v.name.clone())
        .collect()
}

/// The initializers a `BatchNormalization` reads as its running mean or variance.
fn running_statistics(g: &Graph) -> HashSet<&str> {
    g.nodes
        .iter()
        .filter(|n| n.op_type == "BatchNormalization")
        .flat_map(|n| n.input.iter().skip(3).take(2))
        .filter(|v| g.initializer(v).is_some())
        .map(String::as_str)
        .collect()
}
