//! Models as users bring them: small random-initialized Hugging Face `transformers` and
//! torchvision models exported by `torch.onnx.export` (`tests/fixtures/models/`, made by
//! `tools/fixtures/export_models.py`), trained through `pipetrain train` and compared
//! with PyTorch's own training of the same weights on the same batches.
//!
//! The tolerance is the float32 spread: at step `s`, pipetrain's loss (float32) is within
//! `max(4 x max_{t <= s} |torch_f32(t) - torch_f64(t)|, 1e-6)` of PyTorch's float64 loss.
//! The running maximum, because rounding differences grow over the steps and PyTorch's
//! own float32 run can land close to float64 at one step by chance.

mod common;

use std::path::PathBuf;

use pipetrain::config::TrainConfig;
use pipetrain::train::train;
use serde_json::Value;

/// How a fixture feeds the model and what its loss ignores.
struct Family {
    name: &'static str,
    /// Model inputs, each an array of `data.npz` of the same name.
    inputs: &'static [&'static str],
    /// `labels` value that counts for nothing (masked language modelling).
    ignore_index: Option<i64>,
    /// Float initializers that are PyTorch buffers, not parameters.
    frozen: &'static [&'static str],
    /// Steps compared (of 20): BatchNorm nets turn chaotic after a few steps, where two
    /// float32 runs part ways whichever is right.
    steps: usize,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// PyTorch's losses of the fixture's run with `optimizer` (`float64`, `float32`) and
/// its learning rate.
fn reference(f: &Family, optimizer: &str) -> (Vec<f64>, Vec<f64>, f64) {
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
struct Layout {
    pp: usize,
    dp: usize,
    micro_batches: usize,
    /// The pipeline schedule (`interleaved_1f1b` with 2 virtual stages a rank).
    schedule: &'static str,
}

const ONE: Layout = Layout {
    pp: 1,
    dp: 1,
    micro_batches: 1,
    schedule: "1f1b",
};

/// `pp` stages under `schedule`, `micro_batches` micro-batches, one replica.
const fn piped(pp: usize, micro_batches: usize, schedule: &'static str) -> Layout {
    Layout {
        pp,
        dp: 1,
        micro_batches,
        schedule,
    }
}

/// Trains the fixture's `model.onnx` for `steps` optimizer steps; each step's loss.
fn train_fixture(f: &Family, optimizer: &str, lr: f64, layout: Layout, steps: usize) -> Vec<f64> {
    train_model(f, "model.onnx", optimizer, lr, layout, steps)
}

/// Trains the fixture's model file `model` for `steps` optimizer steps; each step's loss.
fn train_model(
    f: &Family,
    model: &str,
    optimizer: &str,
    lr: f64,
    layout: Layout,
    steps: usize,
) -> Vec<f64> {
    let dir = fixture(f.name);
    let per_micro_batch = 4 / (layout.dp * layout.micro_batches);
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
         data_parallel_size = {dp}\nnum_train_steps = {passes}\ndisplay_loss_steps = 1000\n\n\
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
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "exported_{}_{model}_{optimizer}_pp{}_dp{}_{}.toml",
        f.name, layout.pp, layout.dp, layout.schedule
    ));
    std::fs::write(&path, &text).unwrap();
    let cfg = TrainConfig::parse(&text, &path).unwrap();
    let mut losses = Vec::new();
    train(&common::runtime(), &cfg, &path, false, |r| {
        losses.push(r.loss)
    })
    .unwrap_or_else(|e| panic!("{} ({optimizer}, pp {}): {e}", f.name, layout.pp));
    losses
}

/// Every step within `k` times the float32 spread of PyTorch's float64 run.
fn assert_within_spread(what: &str, ours: &[f64], f64s: &[f64], f32s: &[f64], k: f64) {
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

/// SGD and AdamW at pp = 1 for 20 steps, each within the float32 spread.
fn matches_pytorch(f: &Family) {
    for optimizer in ["sgd", "adamw"] {
        let (f64s, f32s, lr) = reference(f, optimizer);
        let ours = train_fixture(f, optimizer, lr, ONE, f.steps.min(f64s.len()));
        assert_within_spread(&format!("{} {optimizer}", f.name), &ours, &f64s, &f32s, 4.0);
    }
}

/// SGD at `layout` within the float32 spread of PyTorch's batch of 4.
fn layout_matches_pytorch(f: &Family, layout: Layout) {
    let (f64s, f32s, lr) = reference(f, "sgd");
    let ours = train_fixture(f, "sgd", lr, layout, f64s.len());
    let what = format!(
        "{} sgd pp {} dp {} {}",
        f.name, layout.pp, layout.dp, layout.schedule
    );
    assert_within_spread(&what, &ours, &f64s, &f32s, 4.0);
}

const GPT2: Family = Family {
    name: "gpt2",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
};
const LLAMA: Family = Family {
    name: "llama",
    inputs: &["input_ids"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
};
const BERT: Family = Family {
    name: "bert",
    inputs: &["input_ids", "attention_mask"],
    ignore_index: Some(-100),
    frozen: &[],
    steps: 20,
};
const BART: Family = Family {
    name: "bart",
    inputs: &["input_ids", "decoder_input_ids"],
    ignore_index: None,
    frozen: &["final_logits_bias"],
    steps: 20,
};
const MOBILENET_V3: Family = Family {
    name: "mobilenet_v3",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 10,
};
const MOBILENET_V2: Family = Family {
    name: "mobilenet_v2",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 2,
};
const VIT: Family = Family {
    name: "vit",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
};
const CONVNEXT: Family = Family {
    name: "convnext",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 20,
};
const RESNET18: Family = Family {
    name: "resnet18",
    inputs: &["pixel_values"],
    ignore_index: None,
    frozen: &[],
    steps: 2,
};

/// GPT-2: logits `[batch, seq, vocab]` with classes on the last axis, erf-free "gelu_new"
/// (tanh), the LM head tied to the token embedding.
#[test]
fn gpt2_trains_as_pytorch() {
    matches_pytorch(&GPT2);
}

/// Llama: grouped-query attention, rotary embeddings (shape arithmetic folded), RMSNorm,
/// SiLU; at pp = 1, pp = 2 (1F1B, 2 micro-batches) and dp = 2.
#[test]
fn llama_trains_as_pytorch_in_every_layout() {
    matches_pytorch(&LLAMA);
    for layout in [piped(2, 2, "1f1b"), Layout { dp: 2, ..ONE }] {
        layout_matches_pytorch(&LLAMA, layout);
    }
}

/// BERT masked LM: labels -100 where nothing is predicted, padding tokens (row 0 of the
/// word embeddings is PyTorch's `padding_idx`, found and kept frozen), attention mask.
#[test]
fn bert_masked_lm_trains_as_pytorch() {
    matches_pytorch(&BERT);
}

/// BART: encoder-decoder, embeddings shared by encoder, decoder and LM head, padding row
/// 1, and `final_logits_bias`, a buffer the exporter writes as an initializer.
#[test]
fn bart_trains_as_pytorch() {
    matches_pytorch(&BART);
}

/// MobileNetV3: BatchNormalization in training mode, HardSwish, HardSigmoid
/// (squeeze-excitation), its first 10 steps (with SGD, PyTorch's float32 and float64
/// runs part by 1e-5 from step 12, with AdamW by 1e-3 from step 17); at pp = 2 each micro-batch of 2 has its own batch statistics
/// (as in PyTorch with micro-batches), so pp = 2 is compared with pp = 1 on the same
/// micro-batches.
#[test]
fn mobilenet_v3_trains_as_pytorch_and_pipelines() {
    matches_pytorch(&MOBILENET_V3);
    let (_, _, lr) = reference(&MOBILENET_V3, "sgd");
    let micro = piped(1, 2, "1f1b");
    let pipelined = piped(2, 2, "1f1b");
    // Two steps: its last BatchNormalizations see 1x1 maps, over 2 samples per
    // micro-batch, and runs that differ in rounding part by 4e-5 from the third step.
    let one = train_fixture(&MOBILENET_V3, "sgd", lr, micro, 2);
    let two = train_fixture(&MOBILENET_V3, "sgd", lr, pipelined, 2);
    // The stage graphs are optimized by ONNX Runtime apart, so their kernels round
    // differently: a few float32 ulps of a loss near 2.3 (one ulp is 2.4e-7).
    let worst = one
        .iter()
        .zip(&two)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!("mobilenet_v3 pp 2 vs pp 1 on the same micro-batches: worst {worst:.2e}");
    assert!(
        worst <= 2e-6,
        "mobilenet_v3: pp 2 parts from pp 1 by {worst:.2e} on the same micro-batches \
         ({one:?} vs {two:?})"
    );
}

/// ViT: patches by a strided Conv, the class token `Expand`ed to a shape read off the
/// batch (folded: no stage boundary carries a shape), at pp = 4 (1F1B, 4 micro-batches of
/// 1), and at pp = 2 under ZB-V and interleaved 1F1B.
#[test]
fn vit_trains_as_pytorch_under_every_schedule() {
    matches_pytorch(&VIT);
    for layout in [
        piped(4, 4, "1f1b"),
        piped(2, 4, "zb_v"),
        piped(2, 2, "interleaved_1f1b"),
    ] {
        layout_matches_pytorch(&VIT, layout);
    }
}

/// A ConvNeXt: depthwise 7x7 convolutions, LayerNorm over channels-last (Transpose),
/// layer scale, exact GELU; at pp = 1 and pp = 2.
#[test]
fn convnext_trains_as_pytorch() {
    matches_pytorch(&CONVNEXT);
    layout_matches_pytorch(&CONVNEXT, piped(2, 2, "1f1b"));
}

/// MobileNetV2 at width 0.25: ReLU6 as `Clip`, depthwise convolutions, BatchNorm. Its
/// 1x1 maps over a batch of 4 make it chaotic from the second step (PyTorch's float32
/// run is 0.2 off float64 at step 1), so two steps are compared.
#[test]
fn mobilenet_v2_first_steps_as_pytorch() {
    matches_pytorch(&MOBILENET_V2);
}

/// ResNet-18's structure at 1/8 width: its last BatchNormalizations normalize 1x1 maps
/// over a batch of 4, which makes training chaotic (PyTorch's own float32 run is 5e-2 off
/// float64 by step 2), so only the first two steps are compared, within 10x the spread.
#[test]
fn resnet18_first_steps_as_pytorch() {
    for optimizer in ["sgd", "adamw"] {
        let (f64s, f32s, lr) = reference(&RESNET18, optimizer);
        let ours = train_fixture(&RESNET18, optimizer, lr, ONE, RESNET18.steps);
        let what = format!("resnet18 {optimizer}");
        assert_within_spread(&what, &ours, &f64s, &f32s, 10.0);
    }
}

/// What `pipetrain check` prints for a fixture's model file (it must succeed).
fn pipetrain_check(family: &str, file: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("check")
        .arg(fixture(family).join(file))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "check {family}/{file}: {stderr}");
    String::from_utf8(out.stdout).unwrap()
}

/// The exporter's default (eval mode, constant folding) merges initializers of equal
/// initial value: `pipetrain check` names them (and the export call that avoids it); the
/// training-mode export of the same model gets no warning.
#[test]
fn check_names_the_initializers_an_eval_mode_export_merged() {
    let check = |file: &str| pipetrain_check("bert", file);
    let eval = check("model.eval-default.onnx");
    for merged in [
        "initializer `bert.embeddings.LayerNorm.weight` also stands for 5 other parameters",
        "initializer `bert.embeddings.LayerNorm.bias` also stands for 16 other parameters",
        "`bert.encoder.layer.1.output.LayerNorm.weight`",
        "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False",
    ] {
        assert!(eval.contains(merged), "no `{merged}` in:\n{eval}");
    }
    let training = check("model.onnx");
    assert!(!training.contains("warning"), "{training}");
    assert!(training.contains("ok: nothing found"), "{training}");
}

/// The same models as the dynamo exporter (`dynamo=True`, opset 18) writes them: constants
/// as `value_ints`, `torch.split` as `SplitToSequence` + `SequenceAt`, buffers as
/// initializers. Its BatchNorm
/// nets normalize with running statistics (eval mode), another model than PyTorch's
/// `train()`: `check` says so.
#[test]
fn dynamo_exports_train_as_pytorch() {
    let text = pipetrain_check("mobilenet_v3", "model.dynamo.onnx");
    assert!(
        text.contains("34 BatchNormalization nodes normalize with their running statistics"),
        "{text}"
    );
    // The dynamo exporter writes Llama's rotary `inv_freq` buffer as an initializer (the
    // TorchScript exporter as a constant): listed as a buffer, as a user must.
    let llama = Family {
        frozen: &["model.rotary_emb.inv_freq"],
        ..LLAMA
    };
    for f in [&GPT2, &llama, &BERT, &BART, &VIT, &CONVNEXT] {
        let (f64s, f32s, lr) = reference(f, "sgd");
        let ours = train_model(
            f,
            "model.dynamo.onnx",
            "sgd",
            lr,
            ONE,
            f.steps.min(f64s.len()),
        );
        let what = format!("{} (dynamo export) sgd", f.name);
        assert_within_spread(&what, &ours, &f64s, &f32s, 4.0);
    }
}
