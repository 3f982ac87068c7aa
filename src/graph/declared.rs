//! What an export says of its initializers beyond ONNX, and what `check` suspects where
//! it says nothing.
//!
//! `tools/export_for_training.py` (the repository's export helper) records, in the model's
//! metadata, the float initializers that are PyTorch buffers (`pipetrain.buffers`), the
//! parameters with `requires_grad = False` (`pipetrain.frozen`) and each embedding's
//! `padding_idx` row (`pipetrain.padding_rows`, a table's row even where it is not zero
//! at initialization). None of them trains, and a padding row gets no gradient from its
//! lookups: the model trains as PyTorch trains it with nothing listed by hand.
//!
//! A plain TorchScript export marks none of that. [`suspected_buffers`] names the float
//! initializers that look like buffers or frozen tables: names PyTorch models give their
//! buffers, and sinusoidal position tables (each row's sines and cosines pair up).

use std::collections::{BTreeMap, BTreeSet};

use crate::graph::ir::Graph;
use crate::onnx::proto::ModelProto;
use crate::tensor::{DType, Tensor, TensorView, ViewData};

/// The metadata keys of `tools/export_for_training.py`.
pub const BUFFERS_KEY: &str = "pipetrain.buffers";
/// Parameters with `requires_grad = False`.
pub const FROZEN_KEY: &str = "pipetrain.frozen";
/// `{table: [rows]}`: embeddings' `padding_idx` rows.
pub const PADDING_ROWS_KEY: &str = "pipetrain.padding_rows";

/// What the export declared (all empty for exports that say nothing).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Declared {
    /// Float initializers that are buffers.
    pub buffers: BTreeSet<String>,
    /// Parameters that do not train.
    pub frozen: BTreeSet<String>,
    /// Padding rows by table.
    pub padding_rows: BTreeMap<String, Vec<i64>>,
}

impl Declared {
    /// The declarations in `model`'s metadata; a value that is not the JSON its key
    /// holds is skipped with a warning (the rest of the model is still good).
    pub fn of(model: &ModelProto) -> Declared {
        let mut d = Declared::default();
        for p in &model.metadata_props {
            let parsed = match p.key.as_str() {
                BUFFERS_KEY => serde_json::from_str(&p.value).map(|v| d.buffers = v),
                FROZEN_KEY => serde_json::from_str(&p.value).map(|v| d.frozen = v),
                PADDING_ROWS_KEY => serde_json::from_str(&p.value).map(|v| d.padding_rows = v),
                _ => Ok(()),
            };
            if let Err(e) = parsed {
                tracing::warn!("model metadata `{}` is not what it should hold: {e}", p.key);
            }
        }
        d
    }

    /// Whether the export declared anything.
    pub fn any(&self) -> bool {
        !(self.buffers.is_empty() && self.frozen.is_empty() && self.padding_rows.is_empty())
    }

    /// Every initializer declared not to train.
    pub fn not_trained(&self) -> impl Iterator<Item = &String> {
        self.buffers.iter().chain(&self.frozen)
    }
}

/// Names PyTorch models give their buffers (Hugging Face's and torchvision's), as they
/// end an initializer's name.
const BUFFER_NAMES: [&str; 7] = [
    "final_logits_bias",
    "inv_freq",
    "position_ids",
    "token_type_ids",
    "num_batches_tracked",
    "_float_tensor",
    "relative_position_index",
];

/// Float initializers of `g` that may be buffers or frozen tables a TorchScript export
/// does not mark, with why: `(name, reason)`. Those in `known` (declared, or listed not
/// to train) are left out.
pub fn suspected_buffers(g: &Graph, known: &BTreeSet<String>) -> Vec<(String, &'static str)> {
    g.initializers
        .iter()
        .filter(|t| DType::from_onnx(t.data_type).is_some_and(DType::is_float))
        .filter(|t| !known.contains(&t.name))
        .filter_map(|t| {
            let last = t.name.rsplit(['.', '/']).next().unwrap_or(&t.name);
            if BUFFER_NAMES.contains(&last) {
                return Some((t.name.clone(), "named as PyTorch names buffers"));
            }
            let table = match crate::tensor::proto_view(t) {
                Some(view) => sinusoidal(view),
                None => sinusoidal(Tensor::from_proto(t).ok()?.view()),
            };
            table.then(|| (t.name.clone(), "a sinusoidal position table"))
        })
        .collect()
}

/// Whether `t` is a `[positions, width]` table of sines and cosines: column `j` and
/// column `j + width / 2` of every row square-sum to 1 (Transformer positions as Marian
/// and others keep them, as parameters that do not train).
fn sinusoidal(t: TensorView<'_>) -> bool {
    let [rows, width] = t.shape[..] else {
        return false;
    };
    if rows < 2 || width < 2 || width % 2 != 0 {
        return false;
    }
    // Read in place, row by row: a weight matrix fails at its first row.
    let at = |i: usize| -> f64 {
        match t.data {
            ViewData::F32(v) => f64::from(v[i]),
            ViewData::F64(v) => v[i],
            _ => f64::NAN,
        }
    };
    let half = width / 2;
    (0..rows).all(|r| {
        let row = r * width;
        (0..half).all(|j| (at(row + j).powi(2) + at(row + j + half).powi(2) - 1.0).abs() < 1e-4)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::proto::StringStringEntryProto;

    #[test]
    fn the_export_helpers_metadata_is_read_and_bad_values_skipped() {
        let entry = |k: &str, v: &str| StringStringEntryProto {
            key: k.into(),
            value: v.into(),
        };
        let model = ModelProto {
            metadata_props: vec![
                entry(BUFFERS_KEY, r#"["final_logits_bias"]"#),
                entry(FROZEN_KEY, "not json"),
                entry(PADDING_ROWS_KEY, r#"{"model.shared.weight": [1]}"#),
                entry("pipetrain.exporter", "torch 2.15.0"),
            ],
            ..Default::default()
        };
        let d = Declared::of(&model);
        assert_eq!(d.buffers, BTreeSet::from(["final_logits_bias".to_string()]));
        assert!(d.frozen.is_empty());
        assert_eq!(d.padding_rows["model.shared.weight"], vec![1]);
        assert!(d.any());
    }

    #[test]
    fn a_sinusoidal_table_is_recognized_and_a_random_one_is_not() {
        let (rows, width) = (6, 8);
        let mut v = vec![0.0f32; rows * width];
        for p in 0..rows {
            for j in 0..width / 2 {
                let angle = p as f32 / 10f32.powf(j as f32);
                v[p * width + j] = angle.sin();
                v[p * width + j + width / 2] = angle.cos();
            }
        }
        let table = Tensor::f32(vec![rows, width], v.clone()).unwrap();
        assert!(sinusoidal(table.view()));
        v[3] += 0.1;
        assert!(!sinusoidal(
            Tensor::f32(vec![rows, width], v).unwrap().view()
        ));
    }
}
