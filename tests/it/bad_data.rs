//! Bad data is named before it trains: token ids outside their embedding table, labels
//! outside the classes (other than `ignore_index`), NaN or infinity in float inputs, and
//! arrays of another element type than the model's input or the loss takes. Each error
//! names the file, the array, the row and the value, though the bad row is far from the
//! first batch; `data.check = false` skips the value checks.
//!
//! The models are the exported GPT-2, ViT and BERT fixtures, with one value of their data
//! changed.

use crate::common;

use std::path::{Path, PathBuf};

use pipetrain::config::TrainConfig;
use pipetrain::data::{read_npz, write_npz};
use pipetrain::tensor::Tensor;

fn fixture(family: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(family)
        .join(file)
}

/// The fixture's data with `change` applied to array `array`, written to `dir`.
fn changed(
    family: &str,
    dir: &Path,
    array: &str,
    change: impl FnOnce(&Tensor) -> Tensor,
) -> PathBuf {
    let mut arrays = read_npz(&fixture(family, "data.npz")).unwrap();
    let t = change(&arrays[array]);
    arrays.insert(array.into(), t);
    let named: Vec<(&str, &Tensor)> = arrays.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let path = dir.join(format!("{family}_{array}.npz"));
    write_npz(&path, &named).unwrap();
    path
}

/// `t` with flat element `at` set to `v` (integer arrays).
fn with_i64(t: &Tensor, at: usize, v: i64) -> Tensor {
    let mut data = t.to_i64_vec().unwrap();
    data[at] = v;
    Tensor::i64(t.shape.clone(), data).unwrap()
}

/// The error of training `family` on `data` for a step (it must fail).
fn error(family: &str, inputs: &[&str], data: &Path, extra: &str) -> String {
    let feeds: Vec<String> = inputs
        .iter()
        .chain(&["labels"])
        .map(|n| format!("{n} = \"{n}\""))
        .collect();
    let ignore = match family {
        "bert" => "ignore_index = -100\n",
        _ => "",
    };
    let text = format!(
        "model_path = {model:?}\nbatch_size = 4\nnum_train_steps = 1\n\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"labels\"\n{ignore}\n\
         [data]\npath = {data:?}\nlayout = {{ kind = \"arrays\", feeds = {{ {feeds} }} }}\n{extra}\n\
         [optimizer]\nkind = \"sgd\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 0.01\n",
        model = fixture(family, "model.onnx"),
        feeds = feeds.join(", "),
    );
    let path = data.with_extension("toml");
    std::fs::write(&path, &text).unwrap();
    let cfg = TrainConfig::parse(&text, &path).unwrap();
    match pipetrain::train::train(&common::runtime(), &cfg, &path, false, |_| {}) {
        Ok(_) => panic!("{family}: trained on {}", data.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_names(err: &str, words: &[&str]) {
    for w in words {
        assert!(err.contains(w), "`{w}` not in: {err}");
    }
}

/// A token id of 500 for GPT-2's 100-row vocabulary, in row 37 (the first step reads
/// rows 0-3).
#[test]
fn a_token_id_outside_the_embedding_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = changed("gpt2", dir.path(), "input_ids", |t| {
        with_i64(t, 37 * 16 + 5, 500)
    });
    let err = error("gpt2", &["input_ids"], &data, "");
    assert_names(
        &err,
        &[
            "gpt2_input_ids.npz",
            "array `input_ids`",
            "row 37, position [5]",
            "500 is outside [0, 100)",
            "`transformer.wte.weight`",
        ],
    );
}

/// A bad token id in `input_ids` and a bad label in `labels`: the model's input is named,
/// in every run (the arrays are checked in the graph's input order, then the label).
#[test]
fn the_same_array_is_named_in_every_run() {
    let dir = tempfile::tempdir().unwrap();
    let ids = changed("gpt2", dir.path(), "input_ids", |t| {
        with_i64(t, 37 * 16 + 5, 500)
    });
    let mut arrays = read_npz(&ids).unwrap();
    let labels = with_i64(&arrays["labels"], 37 * 16 + 5, 700);
    arrays.insert("labels".into(), labels);
    let named: Vec<(&str, &Tensor)> = arrays.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let both = dir.path().join("both.npz");
    write_npz(&both, &named).unwrap();
    for _ in 0..6 {
        let err = error("gpt2", &["input_ids"], &both, "");
        assert_names(&err, &["array `input_ids`", "500 is outside [0, 100)"]);
    }
}

/// A label of -3 among valid ones: refused (as is 100 for 100 classes), naming the
/// classes; BERT's -100 is its `ignore_index`, and the message says so.
#[test]
fn labels_outside_the_classes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = changed("gpt2", dir.path(), "labels", |t| {
        with_i64(t, 50 * 16 + 2, -3)
    });
    let err = error("gpt2", &["input_ids"], &data, "");
    assert_names(
        &err,
        &[
            "array `labels`",
            "row 50, position [2]",
            "-3 is outside [0, 100)",
            "classes of `logits`",
        ],
    );
    let data = changed("bert", dir.path(), "labels", |t| with_i64(t, 79 * 16, 100));
    let err = error("bert", &["input_ids", "attention_mask"], &data, "");
    assert_names(
        &err,
        &["row 79, position [0]", "100 is outside [0, 100), nor -100"],
    );
    // ViT: labels [batch] against logits [batch, 10], classes on axis 1.
    let data = changed("vit", dir.path(), "labels", |t| with_i64(t, 61, 10));
    let err = error("vit", &["pixel_values"], &data, "");
    assert_names(
        &err,
        &["array `labels`", "row 61:", "10 is outside [0, 10)"],
    );
}

/// NaN and infinity in ViT's pixels are named; with `data.check = false` they are not
/// looked for.
#[test]
fn non_finite_inputs_are_named_unless_checks_are_off() {
    let dir = tempfile::tempdir().unwrap();
    let at = 42 * 3 * 32 * 32 + 2 * 32 * 32 + 7;
    let data = changed("vit", dir.path(), "pixel_values", |t| {
        let mut v = t.as_f32().unwrap().to_vec();
        v[at] = f32::NAN;
        Tensor::f32(t.shape.clone(), v).unwrap()
    });
    let err = error("vit", &["pixel_values"], &data, "");
    assert_names(
        &err,
        &[
            "array `pixel_values`",
            "row 42, position [2, 0, 7]",
            "NaN (float inputs must be finite)",
        ],
    );
    // Unchecked, the step on rows 0-3 trains; a run over row 42 would meet the NaN later.
    let cfg = error_free_config("vit", &data);
    assert!(cfg.is_ok(), "with data.check = false: {cfg:?}");
}

/// Trains ViT on `data` for one step with `data.check = false`.
fn error_free_config(family: &str, data: &Path) -> Result<(), String> {
    let text = format!(
        "model_path = {model:?}\nbatch_size = 4\nnum_train_steps = 1\n\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"labels\"\n\n\
         [data]\npath = {data:?}\ncheck = false\n\
         layout = {{ kind = \"arrays\", feeds = {{ pixel_values = \"pixel_values\", labels = \"labels\" }} }}\n\n\
         [optimizer]\nkind = \"sgd\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 0.01\n",
        model = fixture(family, "model.onnx"),
    );
    let path = data.with_extension("unchecked.toml");
    let cfg = TrainConfig::parse(&text, &path).unwrap();
    pipetrain::train::train(&common::runtime(), &cfg, &path, false, |_| {})
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Float labels for a cross-entropy, and float64 pixels for a float32 input: named by
/// type, before ONNX Runtime sees them.
#[test]
fn arrays_of_another_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = changed("vit", dir.path(), "labels", |t| {
        let v = t.to_i64_vec().unwrap().iter().map(|&x| x as f32).collect();
        Tensor::f32(t.shape.clone(), v).unwrap()
    });
    let err = error("vit", &["pixel_values"], &data, "");
    assert_names(
        &err,
        &["feeding `labels`", "it is f32", "integer class indices"],
    );
    let data = changed("vit", dir.path(), "pixel_values", |t| {
        let v = t.as_f32().unwrap().iter().map(|&x| f64::from(x)).collect();
        Tensor::f64(t.shape.clone(), v).unwrap()
    });
    let err = error("vit", &["pixel_values"], &data, "");
    assert_names(
        &err,
        &[
            "feeding `pixel_values`",
            "it is f64",
            "input `pixel_values` is f32",
        ],
    );
}
