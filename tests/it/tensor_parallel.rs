//! Tensor parallelism (`horizontal_parallel_size`) in one process: Megatron-LM's split
//! of the built-in GPT-2 trains as the unsplit model does, within float32 summation
//! noise (the shards' all-reduce adds partial products in another order); it composes
//! with pipeline and data parallelism, the split backward, recompute and gradient
//! buckets; checkpoints resume at another shard count; and what cannot be split is
//! refused, naming the node and the rule.

use crate::common;

use std::path::Path;

use pipetrain::config::TrainConfig;
use pipetrain::tensor::Tensor;
use pipetrain::train::{train, TrainSummary};

/// GPT-2 (2 layers, d 64, 4 heads), AdamW, 2 micro-batches of 4 per replica and step.
fn config(dir: &Path, name: &str, layout: (usize, usize, usize), extra: &str) -> TrainConfig {
    let (dp, hp, pp) = layout;
    let text = format!(
        r#"
batch_size = {batch}
gradient_accumulation_steps = 4
num_train_steps = 120
data_parallel_size = {dp}
horizontal_parallel_size = {hp}
pipeline_parallel_size = {pp}
{extra}
[model]
kind = "gpt2"
layers = 2
d_model = 64
heads = 4
vocab = 64
seq = 32
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = {{ kind = "language", samples = 1024, seq = 32, vocab = 64, seed = 7 }}
layout = {{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }}
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 3e-3
"#,
        batch = 8 / dp
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, &text).unwrap();
    TrainConfig::load(&path).unwrap()
}

fn run(dir: &Path, cfg: &TrainConfig) -> (Vec<f64>, TrainSummary) {
    let mut losses = Vec::new();
    let s = train(&common::runtime(), cfg, &dir.join("x.toml"), false, |r| {
        losses.push(r.loss)
    })
    .unwrap();
    (losses, s)
}

/// The largest relative difference between two runs' parameters (by name), and where.
/// The attention's query-key bias is left out: the softmax does not depend on it, so its
/// true gradient is 0 and Adam turns the rounding noise there into full-size steps.
fn weight_gap(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0f64, String::new());
    for (name, t) in a.iter().filter(|(n, _)| !n.ends_with("c_attn.bias")) {
        let u = &b.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(t.shape, u.shape, "{name}: whole shapes");
        let (x, y) = (t.to_f64_vec(), u.to_f64_vec());
        let norm = y.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
        let diff = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q).powi(2))
            .sum::<f64>()
            .sqrt();
        if diff / norm > worst.0 {
            worst = (diff / norm, name.clone());
        }
    }
    worst
}

/// Every step's loss within `tol` of the reference's.
fn assert_close(name: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst < tol,
        "{name}: a loss differs by {worst:e} (> {tol:e})"
    );
}

#[test]
fn two_and_four_shards_train_as_one_within_float32_noise() {
    let dir = tempfile::tempdir().unwrap();
    let (one, s1) = run(dir.path(), &config(dir.path(), "hp1", (1, 1, 1), ""));
    // The run learns: the curve moves far more than the tolerance.
    assert!(one[0] - one[one.len() - 1] > 0.5, "{one:?}");
    for hp in [2, 4] {
        let (got, s) = run(dir.path(), &config(dir.path(), "hp", (1, hp, 1), ""));
        assert_close(&format!("hp {hp}"), &got, &one, 1e-5);
        let gap = weight_gap(&s.parameters, &s1.parameters);
        assert!(gap.0 < 1e-4, "hp {hp}: weights {gap:?} from hp 1");
    }
}

#[test]
fn eight_actors_at_dp2_hp2_pp2_with_split_backward_recompute_and_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let one = run(dir.path(), &config(dir.path(), "one", (2, 1, 2), "")).0;
    let extra =
        "recompute = \"stage\"\ngradient_bucket_mb = 0.05\n[pipeline]\nschedule = \"zb_h1\"";
    let base = run(dir.path(), &config(dir.path(), "zb", (2, 1, 2), extra)).0;
    let (split, s) = run(dir.path(), &config(dir.path(), "split", (2, 2, 2), extra));
    assert_eq!(s.stages, 2);
    assert_close("(2, 2, 2) zb_h1", &split, &base, 1e-5);
    assert_close("(2, 2, 2) vs 1f1b", &split, &one, 1e-5);
}

/// A stalled run's who-waits-on-whom report names each member by its data-parallel
/// replica and tensor shard (the engine's replicas are the shards of every data-parallel
/// replica): `dp 1 tp 0 stage 1`, not `replica 2 stage 1`.
#[test]
fn the_watchdog_names_a_member_by_its_data_parallel_replica_and_shard() {
    let dir = tempfile::tempdir().unwrap();
    let held = "watchdog_seconds = 1\n[debug]\nstall = { step = 2, stage = 0, seconds = 4 }\n";
    let cfg = config(dir.path(), "stalled", (2, 2, 2), held);
    let err = train(
        &common::runtime(),
        &cfg,
        &dir.path().join("x.toml"),
        false,
        |_| {},
    )
    .expect_err("the stalled run ends in the watchdog's error");
    let text = err.to_string();
    for dp in 0..2 {
        for tp in 0..2 {
            for stage in 0..2 {
                let who = format!("dp {dp} tp {tp} stage {stage}");
                assert!(text.contains(&who), "{who} in: {text}");
            }
        }
    }
    assert!(!text.contains("replica 3"), "{text}");
}

#[test]
fn a_checkpoint_written_at_two_shards_resumes_at_one_and_at_four() {
    let dir = tempfile::tempdir().unwrap();
    let ck = |c: &mut TrainConfig, sub: &str| {
        c.checkpoints_dir = Some(dir.path().join(sub));
        c.checkpoint_period = Some(10);
    };
    // The whole run at hp 1: 30 optimizer steps.
    let (whole, w) = run(dir.path(), &config(dir.path(), "whole", (1, 1, 1), ""));
    // The first 15 at hp 2 (checkpoint at 10), then the rest at hp 1 and at hp 4.
    let mut first = config(dir.path(), "first", (1, 2, 1), "");
    first.num_train_steps = 60;
    ck(&mut first, "ck");
    run(dir.path(), &first);
    let saved = dir.path().join("ck/step-00000010");
    let files: Vec<String> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files
            .iter()
            .any(|f| f == "stage-000.shard-1.params.safetensors"),
        "{files:?}"
    );
    for hp in [1, 4] {
        let mut rest = config(dir.path(), &format!("rest{hp}"), (1, hp, 1), "");
        rest.checkpoint_to_load_path = Some(saved.clone());
        let (tail, s) = run(dir.path(), &rest);
        assert_eq!(s.first_step, 10);
        assert_close(&format!("resumed at hp {hp}"), &tail, &whole[10..], 1e-5);
        let gap = weight_gap(&s.parameters, &w.parameters);
        assert!(
            gap.0 < 1e-4,
            "resumed at hp {hp}: weights {gap:?} from the whole run"
        );
    }
}

#[test]
fn what_cannot_be_split_is_refused_naming_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let rt = common::runtime();
    let fails = |cfg: &TrainConfig| match train(&rt, cfg, &dir.path().join("x.toml"), false, |_| {})
    {
        Ok(_) => panic!("trained what should have been refused"),
        Err(e) => e.to_string(),
    };
    // 4 heads over 8 shards.
    let e = fails(&config(dir.path(), "heads", (1, 8, 1), ""));
    assert!(
        e.contains("horizontal_parallel_size") && e.contains("not divisible by 8"),
        "{e}"
    );
    // A model without a column-parallel / row-parallel pair (SqueezeNet: convolutions).
    let path = dir.path().join("conv.toml");
    let text = "batch_size = 4\nnum_train_steps = 4\nhorizontal_parallel_size = 2\n\
                [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.1\n\
                [model]\nkind = \"squeezenet\"\nimage_size = 32\nclasses = 10\n\
                [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
                [data]\nsynth = { kind = \"images\", samples = 64, classes = 10, image_size = 32, seed = 3 }\n\
                layout = { kind = \"arrays\", feeds = { x = \"x\", y = \"y\" } }\n";
    std::fs::write(&path, text).unwrap();
    let e = fails(&TrainConfig::load(&path).unwrap());
    assert!(e.contains("no split pattern found"), "{e}");
    // Adasum and LAMB need whole tensors.
    for (extra, field) in [
        ("enable_adasum = true", "enable_adasum"),
        ("", "optimizer.kind"),
    ] {
        let path = dir.path().join("refused.toml");
        let mut text = std::fs::read_to_string(dir.path().join("heads.toml"))
            .unwrap()
            .replace(
                "horizontal_parallel_size = 8",
                "horizontal_parallel_size = 2",
            );
        text = format!("{extra}\n{text}");
        if field == "optimizer.kind" {
            text = text.replace("kind = \"adamw\"", "kind = \"lamb\"");
        }
        std::fs::write(&path, text).unwrap();
        let e = TrainConfig::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains("horizontal_parallel_size"),
            "{e}"
        );
    }
}

#[test]
fn the_split_is_megatrons_heads_and_hidden_width_with_two_all_reduces_per_layer_each_way() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "plan", (1, 2, 1), "");
    let model = cfg.load_model().unwrap();
    let tokens = Tensor::i64(vec![4, 32], (0..128).map(|i| i % 64).collect()).unwrap();
    let example = [("tokens", &tokens), ("targets", &tokens)];
    let opts = pipetrain::graph::TrainOptions {
        inputs: Default::default(),
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: cfg.params.clone(),
    };
    let rt = common::runtime();
    let tg =
        pipetrain::graph::build_sharded_training_graph(&rt, &model, &opts, &example, 2).unwrap();
    let plan = tg.shards.as_ref().unwrap();
    let spec = |n: &str| {
        plan.specs
            .get(n)
            .map(|(s, w)| (s.axis, s.sections, w.clone()))
    };
    for l in 0..2 {
        let p = |s: &str| format!("h.{l}.{s}");
        // Attention by heads: QKV columns (three sections), output projection rows.
        assert_eq!(spec(&p("attn.c_attn.weight")), Some((1, 3, vec![64, 192])));
        assert_eq!(spec(&p("attn.c_attn.bias")), Some((0, 3, vec![192])));
        assert_eq!(spec(&p("attn.c_proj.weight")), Some((0, 1, vec![64, 64])));
        // The MLP by its hidden width.
        assert_eq!(spec(&p("mlp.c_fc.weight")), Some((1, 1, vec![64, 256])));
        assert_eq!(spec(&p("mlp.c_fc.bias")), Some((0, 1, vec![256])));
        assert_eq!(spec(&p("mlp.c_proj.weight")), Some((0, 1, vec![256, 64])));
        // Added once, after the sum: replicated.
        assert_eq!(spec(&p("mlp.c_proj.bias")), None);
        assert_eq!(spec(&p("ln_1.weight")), None);
        let shard = tg.param(&p("attn.c_attn.weight")).unwrap();
        assert_eq!(
            shard.meta.shape,
            vec![64, 96],
            "shard 0 holds half the columns"
        );
    }
    for whole in ["wte.weight", "wpe.weight", "lm_head.weight", "ln_f.weight"] {
        assert_eq!(spec(whole), None, "{whole} is replicated");
    }
    // Megatron's count: per layer two all-reduces of b x s x h forward, two backward.
    assert_eq!(plan.summed_forward.len(), 4);
    assert_eq!(plan.summed_backward.len(), 4);
    for v in plan.summed_forward.iter().chain(&plan.summed_backward) {
        assert_eq!(tg.metas[v].shape, vec![4, 32, 64], "{v}");
    }
}

/// Hugging Face and torchvision models as `torch.onnx.export` writes them (both
/// exporters; `tests/fixtures/models/`): the split finds their attention (by heads:
/// `Linear` as `MatMul` by a transposed weight, GPT-2's `Conv1D` as `Gemm`, Llama's
/// rotary embedding and key/value `Expand`) and MLPs, leaves the heads whole, and the
/// split models train as the unsplit ones within float32 noise. torchvision's ViT keeps
/// its attention whole (`nn.MultiheadAttention` packs Q, K and V and picks them with
/// `Gather`), its MLPs split.
#[test]
fn exported_hugging_face_models_split_and_train_as_unsplit() {
    use crate::common::exported::{
        first_batch, fixture, train_options, train_run, Family, Run, BART, BERT, GPT2, LLAMA, ONE,
        VIT,
    };
    use pipetrain::graph::build_sharded_training_graph;
    let cases: [(&Family, usize); 5] = [(&GPT2, 4), (&BERT, 4), (&LLAMA, 4), (&BART, 5), (&VIT, 2)];
    let rt = common::runtime();
    for (f, summed) in cases {
        let dir = fixture(f.name);
        let batch = first_batch(f);
        let example: Vec<(&str, &Tensor)> = batch.iter().map(|(n, t)| (*n, t)).collect();
        let opts = train_options(f);
        for file in ["model.onnx", "model.dynamo.onnx"] {
            let model = pipetrain::onnx::load_model(&dir.join(file)).unwrap();
            let tg = build_sharded_training_graph(&rt, &model, &opts, &example, 2).unwrap();
            // The fixtures' Dropouts have ratio 0: identities, so none is left to draw
            // masks that shards could disagree on (seeding the others is unit-tested in
            // `graph::tensor_parallel`).
            let dropouts = tg.graph.nodes.iter().filter(|n| n.op_type == "Dropout");
            assert_eq!(dropouts.count(), 0, "{} {file}", f.name);
            let plan = tg.shards.unwrap();
            assert_eq!(
                plan.summed_forward.len(),
                summed,
                "{} {file}: {}",
                f.name,
                plan.summary()
            );
        }
        let run = |extra| Run {
            model: "model.onnx",
            optimizer: "adamw",
            lr: 1e-3,
            layout: ONE,
            steps: 6,
            extra,
        };
        let whole = train_run(f, &run(""));
        let split = train_run(f, &run("horizontal_parallel_size = 2"));
        assert_close(f.name, &split, &whole, 1e-5);
    }
}

/// The optimizer state sharded across the data-parallel replicas of each tensor shard
/// (`deepspeed_zero_stage = 1` at dp 2 x hp 2 x pp 2): the same losses and weights, bit
/// for bit, as the unsharded run (no clipping: the norm is not read); its checkpoint
/// (each tensor shard's and each replica's part in files of their own) resumes unsharded
/// at hp 1 within float32 noise.
#[test]
fn a_sharded_optimizer_state_with_tensor_shards_trains_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let layout = (2, 2, 2);
    let (whole, w) = run(dir.path(), &config(dir.path(), "whole", layout, ""));
    let mut sharded = config(dir.path(), "sharded", layout, "deepspeed_zero_stage = 1");
    sharded.checkpoints_dir = Some(dir.path().join("ck"));
    sharded.checkpoint_period = Some(10);
    let (losses, s) = run(dir.path(), &sharded);
    assert!(losses == whole, "the losses differ");
    let bits = |p: &[(String, Tensor)]| -> Vec<(String, Vec<u32>)> {
        let mut v: Vec<_> = (p.iter())
            .map(|(n, t)| {
                (
                    n.clone(),
                    t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect(),
                )
            })
            .collect();
        v.sort();
        v
    };
    assert!(
        bits(&s.parameters) == bits(&w.parameters),
        "the weights differ"
    );
    let saved = dir.path().join("ck/step-00000010");
    let names: Vec<String> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .any(|f| f == "stage-001.zero-1.shard-1.optimizer.safetensors"),
        "{names:?}"
    );
    let mut rest = config(dir.path(), "rest", (2, 1, 2), "");
    rest.checkpoint_to_load_path = Some(saved);
    let (tail, _) = run(dir.path(), &rest);
    assert_close("resumed at hp 1, unsharded", &tail, &whole[10..], 1e-5);
    // Clipped: the norm adds every replica's part, each tensor shard counting the
    // replicated parameters once between them.
    let clip = "max_grad_norm = 0.05";
    let (clipped, _) = run(dir.path(), &config(dir.path(), "clip", layout, clip));
    let zero_clip = format!("{clip}\ndeepspeed_zero_stage = 1");
    let (sharded, _) = run(dir.path(), &config(dir.path(), "zclip", layout, &zero_clip));
    assert_close("clipped, sharded", &sharded, &clipped, 1e-6);
    assert!(clipped != whole, "the clipping bites");
}
