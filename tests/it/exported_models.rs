//! Models as users bring them: small random-initialized Hugging Face `transformers` and
//! torchvision models exported by `torch.onnx.export` (`tests/fixtures/models/`, made by
//! `tools/fixtures/export_models.py`), trained through `pipetrain train` and compared
//! with PyTorch's own training of the same weights on the same batches.
//!
//! Within the float32 spread of PyTorch (see `common/exported.rs`).

use crate::common::exported::{
    assert_within_sensitivity, assert_within_spread, first_batch, fixture, layout_matches_pytorch,
    matches_pytorch, piped, reference, train_fixture, train_model, train_options, train_run,
    Family, Layout, Run, BART, BERT, BERT_CLASSIFIER, CONVNEXT, CONVNEXT_V2, DEBERTA_V2, GEMMA,
    GPT2, GPTJ, GRID_SAMPLE, GRU, LLAMA, LSTM, MARIAN, MBART, MISTRAL, MOBILENET_V2, MOBILENET_V3,
    MOBILEVIT, ONE, PHI, QWEN2, RESNET18, RESNET18_64, SWIN, VIT, WAV2VEC2,
};
use pipetrain::checkpoint::folder_name;

/// GPT-2: logits `[batch, seq, vocab]` with classes on the last axis, erf-free "gelu_new"
/// (tanh), the LM head tied to the token embedding; at pp = 1, and at pp = 2 and 4 where
/// the first stage owns the tied embedding and the last reads it.
#[test]
fn gpt2_trains_as_pytorch_with_its_tied_head_across_stages() {
    matches_pytorch(&GPT2);
    for layout in [
        piped(2, 2, "1f1b"),
        piped(4, 4, "1f1b"),
        piped(2, 4, "zb_v"),
    ] {
        layout_matches_pytorch(&GPT2, layout);
    }
}

/// GPT-2's tied embedding in a checkpoint written at pp = 2 (its owner stage saves it):
/// resuming at pp = 2 gives the uninterrupted run's losses bitwise (AdamW, so the moments
/// come back too), and resuming at pp = 1 stays within the float32 spread of PyTorch.
#[test]
fn gpt2_tied_embedding_checkpoints_across_layouts() {
    let (f64s, f32s, lr) = reference(&GPT2, "adamw");
    let dir = tempfile::tempdir().unwrap();
    let ckpts = dir.path().join("ckpts");
    let run = |layout, extra: &str| {
        let run = Run {
            model: "model.onnx",
            optimizer: "adamw",
            lr,
            layout,
            steps: 20,
            extra,
        };
        train_run(&GPT2, &run)
    };
    let saving = format!("checkpoints_dir = {ckpts:?}\ncheckpoint_period = 10\n");
    let straight = run(piped(2, 2, "1f1b"), &saving);
    let loading = format!(
        "checkpoint_to_load_path = {:?}\n",
        ckpts.join(folder_name(10))
    );
    let resumed = run(piped(2, 2, "1f1b"), &loading);
    assert_eq!(
        resumed,
        straight[10..],
        "pp 2 -> pp 2: losses after the resume"
    );
    let one = run(piped(1, 2, "1f1b"), &loading);
    let ours: Vec<f64> = straight[..10].iter().chain(&one).copied().collect();
    assert_within_spread("gpt2 adamw pp 2 -> pp 1", &ours, &f64s, &f32s, 4.0);
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

/// Phi (partial rotary, parallel attention and MLP, biased projections), Qwen2 (biased
/// q/k/v), Mistral and Gemma (scaled, tied embedding with a padding row; `1 + w` RMSNorm;
/// tanh GELU) as the README's export call writes them with transformers 4.46: each has
/// the input `onnx::Neg_1` (`num_logits_to_keep`, read as `hidden[:, -n:]`), which
/// nothing feeds and nothing configures: taken as 0, every position's logits. At pp = 1
/// and pp = 2.
#[test]
fn causal_lms_train_as_the_readme_exports_them() {
    for f in [&PHI, &QWEN2, &MISTRAL, &GEMMA] {
        let model = pipetrain::onnx::load_model(&fixture(f.name).join("model.onnx")).unwrap();
        let inputs: Vec<&str> = model
            .graph
            .as_ref()
            .unwrap()
            .input
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(inputs, ["input_ids", "onnx::Neg_1"], "{}", f.name);
        matches_pytorch(f);
        layout_matches_pytorch(f, piped(2, 2, "1f1b"));
    }
}

/// BERT masked LM: labels -100 where nothing is predicted, padding tokens (row 0 of the
/// word embeddings is PyTorch's `padding_idx`, found and kept frozen), attention mask.
/// At pp = 2 the LM head's decoder, tied to the word embeddings, reads them on the
/// last stage.
#[test]
fn bert_masked_lm_trains_as_pytorch() {
    matches_pytorch(&BERT);
    layout_matches_pytorch(&BERT, piped(2, 2, "1f1b"));
}

/// A BERT sequence classifier: its pooler reads the last layer at token 0 alone
/// (`hidden[:, 0]`), so past the keys and values of its attention that layer computes token
/// 0 alone (`graph/selected_rows.rs`): its queries, output projection and feed-forward are
/// products of one row, in both exports. Trains as PyTorch does at pp = 1 (both exports)
/// and pp = 2.
#[test]
fn bert_classifier_computes_the_token_it_reads_alone_and_trains_as_pytorch() {
    let f = &BERT_CLASSIFIER;
    for file in ["model.onnx", "model.dynamo.onnx"] {
        let tg = training_graph(f, file);
        let one_row: Vec<&str> = tg.graph.nodes[..tg.forward_len]
            .iter()
            .filter(|n| ["MatMul", "FusedMatMul", "Gemm"].contains(&n.op_type.as_str()))
            .filter(|n| tg.metas[&n.output[0]].shape[..2] == [4, 1])
            .map(|n| n.name.as_str())
            .collect();
        assert_eq!(one_row.len(), 4, "{file}: {one_row:?}");
    }
    matches_pytorch(f);
    layout_matches_pytorch(f, piped(2, 2, "1f1b"));
    let (f64s, f32s, lr) = reference(f, "sgd");
    let ours = train_model(f, "model.dynamo.onnx", "sgd", lr, ONE, f.steps);
    assert_within_spread(
        "bert_classifier (dynamo export) sgd",
        &ours,
        &f64s,
        &f32s,
        4.0,
    );
}

/// The training graph of fixture `f`'s `file` on its first batch, as `pipetrain train`
/// builds it on the CPU (one shard).
fn training_graph(f: &Family, file: &str) -> pipetrain::graph::TrainingGraph {
    let batch = first_batch(f);
    let example: Vec<(&str, &pipetrain::tensor::Tensor)> =
        batch.iter().map(|(n, t)| (*n, t)).collect();
    let model = pipetrain::onnx::load_model(&fixture(f.name).join(file)).unwrap();
    let rt = crate::common::runtime();
    pipetrain::graph::build_training_graph(&rt, &model, &train_options(f), &example).unwrap()
}

/// BART: encoder-decoder, embeddings shared by encoder, decoder and LM head, padding row
/// 1, and `final_logits_bias`, a buffer the exporter writes as an initializer.
/// At pp = 2 and 3 the shared embeddings are read by the first stage (encoder) and by later
/// ones (decoder, LM head).
#[test]
fn bart_trains_as_pytorch() {
    matches_pytorch(&BART);
    for layout in [piped(2, 2, "1f1b"), piped(3, 4, "1f1b")] {
        layout_matches_pytorch(&BART, layout);
    }
}

/// MobileNetV3: BatchNormalization in training mode, HardSwish, HardSigmoid
/// (squeeze-excitation), its first 10 steps (with SGD, PyTorch's float32 and float64
/// runs part by 1e-5 from step 12, with AdamW by 1e-3 from step 17); and at pp = 2.
#[test]
fn mobilenet_v3_trains_as_pytorch_and_pipelines() {
    matches_pytorch(&MOBILENET_V3);
    pipelines_as_one_stage(&MOBILENET_V3, 2e-6);
}

/// At pp = 2 each micro-batch of 2 has its own batch statistics (as in PyTorch with
/// micro-batches), so a BatchNorm net at pp = 2 is compared with pp = 1 on the same
/// micro-batches, for two SGD steps (its last BatchNormalizations see 1x1 maps over 2
/// samples, where runs that differ in rounding part from the third step), within `tol`.
fn pipelines_as_one_stage(f: &Family, tol: f64) {
    let (_, _, lr) = reference(f, "sgd");
    let one = train_fixture(f, "sgd", lr, piped(1, 2, "1f1b"), 2);
    let two = train_fixture(f, "sgd", lr, piped(2, 2, "1f1b"), 2);
    // The stage graphs are optimized by ONNX Runtime apart, so their kernels round
    // differently: a few float32 ulps of a loss near 2.3 (one ulp is 2.4e-7).
    let worst = one
        .iter()
        .zip(&two)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "{}: pp 2 vs pp 1 on the same micro-batches: worst {worst:.2e}",
        f.name
    );
    assert!(
        worst <= tol,
        "{}: pp 2 parts from pp 1 by {worst:.2e} on the same micro-batches ({one:?} vs {two:?})",
        f.name
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
    pipelines_as_one_stage(&MOBILENET_V2, 2e-6);
}

/// ResNet-18's structure at 1/8 width: its last BatchNormalizations normalize 1x1 maps
/// over a batch of 4, which makes training chaotic (PyTorch's own float32 run is 5e-2 off
/// float64 by step 2), so only the first two steps are compared, within 10x the spread;
/// and at pp = 2.
#[test]
fn resnet18_first_steps_as_pytorch() {
    for optimizer in ["sgd", "adamw"] {
        let (f64s, f32s, lr) = reference(&RESNET18, optimizer);
        let ours = train_fixture(&RESNET18, optimizer, lr, ONE, RESNET18.steps);
        let what = format!("resnet18 {optimizer}");
        assert_within_spread(&what, &ours, &f64s, &f32s, 10.0);
    }
    pipelines_as_one_stage(&RESNET18, 2e-6);
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
/// initializers that its graph signature declares buffers (not trained). Its BatchNorm
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
    // TorchScript exporter as a constant), and declares it a buffer: it does not train,
    // unlisted. So is BART's `final_logits_bias`.
    let bart = Family {
        frozen: &[],
        ..BART
    };
    for f in [&GPT2, &LLAMA, &BERT, &bart, &VIT, &CONVNEXT] {
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

/// BatchNorm nets for as many steps as PyTorch's own float32 run stays close to float64
/// (64 x 64 pixels, batch 8, one micro-batch a step: BatchNorm normalizes over the whole
/// batch as PyTorch's does): ResNet-18's structure (8 SGD steps) and MobileViT (4), at
/// pp = 1 and pp = 2, within the float32 spread or, where larger, what a 1e-7 relative
/// nudge of PyTorch's float64 weights moves its loss (MobileViT from its third step).
#[test]
fn batchnorm_nets_train_as_pytorch_while_float32_agrees() {
    for f in [&RESNET18_64, &MOBILEVIT] {
        let (_, _, lr) = reference(f, "sgd");
        for layout in [ONE, piped(2, 1, "gpipe")] {
            let ours = train_fixture(f, "sgd", lr, layout, f.steps);
            let what = format!("{} sgd pp {}", f.name, layout.pp);
            assert_within_sensitivity(&what, &ours, f, "sgd");
        }
    }
}

/// Models that needed gradient rules ONNX Runtime's training build has: GPT-J's rotary
/// reads every other channel (strided `Slice`), DeBERTa-v2's relative attention gathers
/// positions (`GatherElements`), wav2vec2's convolutional position embedding is weight
/// normed (`ReduceL2`), as is ConvNeXt-V2's global response norm, and a Swin block
/// merges patches by strided slices. Marian (sinusoidal positions that do not train) and
/// mBART (`final_logits_bias`, a buffer) through the export helper, which records them:
/// nothing is listed by hand. At pp = 1 (SGD and AdamW) and pp = 2.
#[test]
fn models_that_need_the_training_builds_rules_train_as_pytorch() {
    for f in [
        &GPTJ,
        &DEBERTA_V2,
        &WAV2VEC2,
        &CONVNEXT_V2,
        &SWIN,
        &MARIAN,
        &MBART,
    ] {
        matches_pytorch(f);
        layout_matches_pytorch(f, piped(2, 2, "1f1b"));
    }
}

/// Recurrent nets as `torch.onnx.export` writes `torch.nn`'s: a two-layer LSTM (weights
/// reordered by `Slice`/`Concat` from PyTorch's, `batch_first` as transposes), and a
/// bidirectional GRU (`linear_before_reset`) feeding a ReLU RNN. ONNX Runtime's training
/// build differentiates LSTM and GRU with its own kernels; here the backward is standard
/// ops. At pp = 1 (SGD and AdamW) and pp = 2; the LSTM also as the dynamo exporter
/// writes it.
#[test]
fn recurrent_nets_train_as_pytorch() {
    for f in [&LSTM, &GRU] {
        matches_pytorch(f);
        layout_matches_pytorch(f, piped(2, 2, "1f1b"));
    }
    let (f64s, f32s, lr) = reference(&LSTM, "sgd");
    let ours = train_model(&LSTM, "model.dynamo.onnx", "sgd", lr, ONE, f64s.len());
    assert_within_spread("lstm (dynamo export) sgd", &ours, &f64s, &f32s, 4.0);
}

/// `F.grid_sample` as both exporters write it (`GridSample`, which ONNX Runtime's training
/// build cannot differentiate): features sampled at a learned offset from the identity
/// grid, with border padding; the offsets train through the grid's gradient. At pp = 1
/// (SGD and AdamW), pp = 2, and the dynamo export.
#[test]
fn a_grid_sampling_net_trains_as_pytorch() {
    matches_pytorch(&GRID_SAMPLE);
    layout_matches_pytorch(&GRID_SAMPLE, piped(2, 2, "1f1b"));
    let (f64s, f32s, lr) = reference(&GRID_SAMPLE, "sgd");
    let ours = train_model(
        &GRID_SAMPLE,
        "model.dynamo.onnx",
        "sgd",
        lr,
        ONE,
        f64s.len(),
    );
    assert_within_spread("grid_sample (dynamo export) sgd", &ours, &f64s, &f32s, 4.0);
}
