//! The harness of `tests/it/exported_models.rs`: the fixtures of
//! `tests/fixtures/models/` (small Hugging Face and torchvision models as
//! `torch.onnx.export` writes them), PyTorch's curves for them, and training them
//! through `pipetrain train` in a given layout.
//!
//! The tolerance is the float32 spread: at step `s`, pipetrain's loss (float32) is within
//! `max(k x max_{t <= s} |torch_f32(t) - torch_f64(t)|, 1e-6)` of PyTorch's float64 loss.
//! The running maximum, because rounding differences grow over the steps and PyTorch's
//! own float32 run can land close to float64 at one step by chance.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use pipetrain::config::TrainConfig;
use pipetrain::train::{train, StepReport, TrainSummary};
use serde_json::Value;

/// How a fixture feeds the model and what its loss ignores.
pub struct Family {
    pub name: &'static str,
    /// Model inputs, each an array of `data.npz` of the same name.
    pub inputs: &'static [&'static str],
    /// `labels` value that counts for nothing (masked language modelling).
    pub ignore_index: Option<i64>,
    /// Float initializers that are PyTorch buffers, not parameters.
    pub frozen: &'static [&'static str],
    /// Steps compared (of 20): BatchNorm nets turn chaotic after a few steps, where two
    /// float32 runs part ways whichever is right.
    pub steps: usize,
    /// Rows per step.
    pub batch: usize,
}

/// The fixture's first batch (rows 0-3 of its inputs and labels), by name.
pub fn first_batch(f: &Family) -> Vec<(&'static str, pipetrain::tensor::Tensor)> {
    let data = pipetrain::data::read_npz(&fixture(f.name).join("data.npz")).unwrap();
    f.inputs
        .iter()
        .chain(&["labels"])
        .map(|&n| (n, data[n].gather_rows(&[0, 1, 2, 3]).unwrap()))
        .collect()
}

/// How `pipetrain train` builds the fixture's training graph on the CPU: PyTorch's loss
/// on its logits, every kernel pipetrain has.
pub fn train_options(f: &Family) -> pipetrain::graph::TrainOptions {
    pipetrain::graph::TrainOptions {
        inputs: Default::default(),
        loss: pipetrain::graph::LossSpec::SoftmaxCrossEntropy {
            prediction: "logits".into(),
            label: "labels".into(),
            ignore_index: f.ignore_index,
            class_axis: None,
            normalize: Default::default(),
        },
        trainable: None,
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    }
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// PyTorch's losses of the fixture's run with `optimizer` (`float64`, `float32`) and
/// its learning rate.
pub fn reference(f: &Family, optimizer: &str) -> (Vec<f64>, Vec<f64>, f64) {
    let text = std::fs::read_to_string(fixture(f.name).join("curves.json")).unwrap();
    let c: Value = serde_json::from_str(&text).unwrap();
    let curve = |kind: &str| -> Vec<f64> {
        c["curves"][optimizer][kind]
            .as_array()
            .unwrap_or_else(|| panic!("{}: curves.{optimizer}.{kind} missing", f.name))
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let lr = c["lr"][optimizer].as_f64().unwrap();
    (curve("float64"), curve("float32"), lr)
}

/// The layout of a run: pipeline stages, data-parallel replicas, and micro-batches per
/// replica; the global batch is always the fixture's 4 rows.
#[derive(Clone, Copy)]
pub struct Layout {
    pub pp: usize,
    pub dp: usize,
    pub micro_batches: usize,
    /// The pipeline schedule (`interleaved_1f1b` with 2 virtual stages a rank).
    pub schedule: &'static str,
}

pub const ONE: Layout = Layout {
    pp: 1,
    dp: 1,
    micro_batches: 1,
    schedule: "1f1b",
};

/// `pp` stages under `schedule`, `micro_batches` micro-batches, one replica.
pub const fn piped(pp: usize, micro_batches: usize, schedule: &'static str) -> Layout {
    Layout {
        pp,
        dp: 1,
        micro_batches,
        schedule,
    }
}

/// Trains the fixture's `model.onnx` for `steps` optimizer steps; each step's loss.
pub fn train_fixture(
    f: &Family,
    optimizer: &str,
    lr: f64,
    layout: Layout,
    steps: usize,
) -> Vec<f64> {
    train_model(f, "model.onnx", optimizer, lr, layout, steps)
}

/// Trains the fixture's model file `model` for `steps` optimizer steps; each step's loss.
pub fn train_model(
    f: &Family,
    model: &str,
    optimizer: &str,
    lr: f64,
    layout: Layout,
    steps: usize,
) -> Vec<f64> {
    let run = Run {
        model,
        optimizer,
        lr,
        layout,
        steps,
        extra: "",
    };
    train_run(f, &run)
}

/// One `pipetrain train` run of a fixture.
pub struct Run<'a> {
    /// The model file in the fixture's folder.
    pub model: &'a str,
    /// `sgd` or `adamw`.
    pub optimizer: &'a str,
    /// Learning rate.
    pub lr: f64,
    /// Parallel layout and schedule.
    pub layout: Layout,
    /// Optimizer steps to the end of the run (counting steps a resumed run skips).
    pub steps: usize,
    /// Top-level configuration lines added (checkpoints, say).
    pub extra: &'a str,
}

/// Trains `run`; the loss of each step it trains.
pub fn train_run(f: &Family, run: &Run) -> Vec<f64> {
    train_summary(f, run).0
}

/// Trains `run`; the loss of each step it trains, and the run's summary (its trained
/// parameters and running statistics).
pub fn train_summary(f: &Family, run: &Run) -> (Vec<f64>, TrainSummary) {
    let (reports, summary) = train_reports(f, run);
    (reports.iter().map(|r| r.loss).collect(), summary)
}

/// Trains `run`; each step's report and the run's summary.
pub fn train_reports(f: &Family, run: &Run) -> (Vec<StepReport>, TrainSummary) {
    let Run {
        model,
        optimizer,
        lr,
        layout,
        steps,
        extra,
    } = *run;
    let dir = fixture(f.name);
    let per_micro_batch = f.batch / (layout.dp * layout.micro_batches);
    let feeds: Vec<String> = f
        .inputs
        .iter()
        .chain(&["labels"])
        .map(|n| format!("{n} = \"{n}\""))
        .collect();
    let ignore = f.ignore_index.map_or(String::new(), |i| {
        format!("ignore_index = {i}\nnormalize = \"tokens\"\n")
    });
    let frozen: Vec<String> = f.frozen.iter().map(|n| format!("\"{n}\"")).collect();
    let virtual_stages = if layout.schedule == "interleaved_1f1b" {
        2
    } else {
        1
    };
    let text = format!(
        "model_path = {model:?}\nbatch_size = {per_micro_batch}\n\
         gradient_accumulation_steps = {m}\npipeline_parallel_size = {pp}\n\
         data_parallel_size = {dp}\nnum_train_steps = {passes}\ndisplay_loss_steps = 1000\n{extra}\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"labels\"\n{ignore}\n\
         [params]\nfrozen = [{frozen}]\n\n\
         [pipeline]\nschedule = \"{schedule}\"\nvirtual_stages = {virtual_stages}\n\n\
         [data]\npath = {data:?}\nlayout = {{ kind = \"arrays\", feeds = {{ {feeds} }} }}\n\n\
         [optimizer]\nkind = \"{optimizer}\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = {lr}\n",
        model = dir.join(model),
        data = dir.join("data.npz"),
        m = layout.micro_batches,
        pp = layout.pp,
        dp = layout.dp,
        passes = steps * layout.micro_batches,
        feeds = feeds.join(", "),
        frozen = frozen.join(", "),
        schedule = layout.schedule,
    );
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    // A model given by its path (outside the fixture) is named by its file.
    let model_file = std::path::Path::new(model)
        .file_name()
        .unwrap()
        .to_string_lossy();
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "exported_{}_{model_file}_{optimizer}_pp{}_dp{}_{}_{}.toml",
        f.name,
        layout.pp,
        layout.dp,
        layout.schedule,
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, &text).unwrap();
    let cfg = TrainConfig::parse(&text, &path).unwrap();
    let mut reports = Vec::new();
    let summary = train(&super::runtime(), &cfg, &path, false, |r| {
        reports.push(r.clone())
    })
    .unwrap_or_else(|e| panic!("{} ({optimizer}, pp {}): {e}", f.name, layout.pp));
    (reports, summary)
}

/// Every step within `k` times the float32 spread of PyTorch's float64 run.
pub fn assert_within_spread(what: &str, ours: &[f64], f64s: &[f64], f32s: &[f64], k: f64) {
    assert!(
        ours.len() <= f64s.len(),
        "{what}: more steps than the reference"
    );
    let mut spread: f64 = 0.0;
    let mut worst: f64 = 0.0;
    for (s, ((&a, &b), &c)) in ours.iter().zip(f64s).zip(f32s).enumerate() {
        spread = spread.max((c - b).abs());
        let tol = (k * spread).max(1e-6);
        let err = (a - b).abs();
        worst = worst.max(err / tol);
        assert!(
            err <= tol,
            "{what}: step {s}: loss {a} vs PyTorch float64 {b} (off {err:.2e}; tolerance {tol:.2e}, \
             PyTorch float32 is off {:.2e})",
            (c - b).abs()
        );
    }
    eprintln!(
        "{what}: {} steps, worst {worst:.2} of the tolerance",
        ours.len()
    );
}

/// How much PyTorch's float64 loss moves, step by step, when its weights are nudged by
/// 1e-7 relative (`curves.json` `sensitivity.<optimizer>.perturbed_1e_7_vs_float64`): how
/// chaotic the run is, whatever the arithmetic.
pub fn sensitivity(f: &Family, optimizer: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(fixture(f.name).join("curves.json")).unwrap();
    let c: Value = serde_json::from_str(&text).unwrap();
    c["sensitivity"][optimizer]["perturbed_1e_7_vs_float64"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no sensitivity for {optimizer}", f.name))
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// Every step within 4 times the float32 spread of PyTorch's float64 run, or within what
/// nudging PyTorch's float64 weights by 1e-7 relative moves its loss there
/// (`sensitivity`), whichever is larger.
pub fn assert_within_sensitivity(what: &str, ours: &[f64], f: &Family, optimizer: &str) {
    let (f64s, f32s, _) = reference(f, optimizer);
    let nudged = sensitivity(f, optimizer);
    let mut spread: f64 = 0.0;
    for (s, (&a, (&b, &c))) in ours.iter().zip(f64s.iter().zip(&f32s)).enumerate() {
        spread = spread.max((c - b).abs());
        let tol = (4.0 * spread).max(nudged[s]).max(1e-6);
        assert!(
            (a - b).abs() <= tol,
            "{what}: step {s}: loss {a} vs PyTorch float64 {b} (off {:.2e}; tolerance {tol:.2e}: \
             PyTorch float32 is off {:.2e}, a 1e-7 nudge of its weights moves it {:.2e})",
            (a - b).abs(),
            (c - b).abs(),
            nudged[s]
        );
    }
    eprintln!(
        "{what}: {} steps within the spread or the sensitivity",
        ours.len()
    );
}

/// SGD and AdamW at pp = 1 for 20 steps, each within the float32 spread.
pub fn matches_pytorch(f: &Family) {
    for optimizer in ["sgd", "adamw"] {
        let (f64s, f32s, lr) = reference(f, optimizer);
        let ours = train_fixture(f, optimizer, lr, ONE, f.steps.min(f64s.len()));
        assert_within_spread(&format!("{} {optimizer}", f.name), &ours, &f64s, &f32s, 4.0);
    }
}

/// SGD at `layout` within the float32 spread of PyTorch's whole batch.
pub fn layout_matches_pytorch(f: &Family, layout: Layout) {
    let (f64s, f32s, lr) = reference(f, "sgd");
    let ours = train_fixture(f, "sgd", lr, layout, f64s.len());
    let what = format!(
        "{} sgd pp {} dp {} {}",
        f.name, layout.pp, layout.dp, layout.schedule
    );
    assert_within_spread(&what, &ours, &f64s, &f32s, 4.0);
}

// The fixtures' families.

pub const GPT2: Family = Family {
    name: "gpt2",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
/// `torch.nn` recurrent nets (`tools/fixtures/export_models.py`): a two-layer LSTM, and a
/// bidirectional GRU then a ReLU RNN.
pub const LSTM: Family = Family {
    name: "lstm",
    ..GPT2
};
pub const GRU: Family = Family {
    name: "gru",
    ..GPT2
};
/// A learned deformation sampled by `F.grid_sample` (`tools/fixtures/export_models.py`).
pub const GRID_SAMPLE: Family = Family {
    name: "grid_sample",
    ..VIT
};
pub const LLAMA: Family = Family {
    name: "llama",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
/// Causal LMs exported with the README's call (`tools/fixtures/export_causal_lms.py`,
/// transformers 4.46): the exporter adds `onnx::Neg_1`, `num_logits_to_keep`.
pub const PHI: Family = Family {
    name: "phi",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const QWEN2: Family = Family {
    name: "qwen2",
    ..PHI
};
pub const MISTRAL: Family = Family {
    name: "mistral",
    ..PHI
};
pub const GEMMA: Family = Family {
    name: "gemma",
    ..PHI
};
pub const BERT: Family = Family {
    name: "bert",
    inputs: &["input_ids", "attention_mask"],
    ignore_index: Some(-100),
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const BERT_CLASSIFIER: Family = Family {
    name: "bert_classifier",
    inputs: &["input_ids", "attention_mask"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const BART: Family = Family {
    name: "bart",
    inputs: &["input_ids", "decoder_input_ids"],
    ignore_index: None,
    frozen: &["final_logits_bias"],
    steps: 20,
    batch: 4,
};
pub const MOBILENET_V3: Family = Family {
    name: "mobilenet_v3",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 10,
    batch: 4,
};
pub const MOBILENET_V2: Family = Family {
    name: "mobilenet_v2",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 2,
    batch: 4,
};
pub const VIT: Family = Family {
    name: "vit",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const CONVNEXT: Family = Family {
    name: "convnext",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const RESNET18: Family = Family {
    name: "resnet18",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 2,
    batch: 4,
};
/// BatchNorm nets at 64 x 64 pixels, batch 8 (`tools/fixtures/export_batchnorm.py`):
/// PyTorch's own float32 run stays close to float64 for these steps.
pub const RESNET18_64: Family = Family {
    name: "resnet18_64",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 8,
    batch: 8,
};
pub const MOBILEVIT: Family = Family {
    name: "mobilevit",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 4,
    batch: 8,
};

/// Families exported with `tools/export_for_training.py` (`tools/fixtures/export_families.py`):
/// their buffers, frozen parameters and padding rows are in the models' metadata, and
/// nothing is listed here.
pub const GPTJ: Family = Family {
    name: "gptj",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
    batch: 4,
};
pub const DEBERTA_V2: Family = Family {
    name: "deberta_v2",
    inputs: &["input_ids", "attention_mask"],
    ignore_index: Some(-100),
    ..GPTJ
};
pub const WAV2VEC2: Family = Family {
    name: "wav2vec2",
    inputs: &["input_values"],
    ..GPTJ
};
pub const CONVNEXT_V2: Family = Family {
    name: "convnext_v2",
    inputs: &["pixel_values"],
    ..GPTJ
};
pub const SWIN: Family = Family {
    name: "swin",
    inputs: &["pixel_values"],
    ..GPTJ
};
pub const MARIAN: Family = Family {
    name: "marian",
    inputs: &["input_ids", "decoder_input_ids"],
    ..GPTJ
};
pub const MBART: Family = Family {
    name: "mbart",
    inputs: &["input_ids", "decoder_input_ids"],
    ..GPTJ
};
