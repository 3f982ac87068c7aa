//! The built-in models (`pipetrain::models`) on the synthetic data sets
//! (`pipetrain::data::synth`): ONNX Runtime runs each and the `onnx` checker accepts it,
//! and `pipetrain::train::train` trains each, as a 2-stage pipeline too.

mod support;

use std::path::Path;
use std::time::Instant;

use pipetrain::data::synth::{ImagesConfig, LanguageConfig, TeacherConfig};
use pipetrain::data::{generate, parse_npy, write_npz, SynthSpec};
use pipetrain::graph::export_inference_model;
use pipetrain::models::{build, Gpt2Config, MlpConfig, ModelSpec, SqueezeNetConfig};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::onnx::save_model;
use pipetrain::tensor::Tensor;
use pipetrain::Error;
use support::{
    accuracy, config, forward, mean, onnx_check, run_python, tmp, tokens, train_toml, write_data,
    write_model, ARRAYS, GPT2_ADAMW, NEXT_TOKEN,
};

#[test]
fn gpt2_with_a_dynamic_batch_runs_any_batch_and_passes_the_checker() {
    let dir = tmp("gpt2_dynamic");
    let cfg = Gpt2Config::default();
    let (model, path) = write_model(&ModelSpec::Gpt2(cfg.clone()), &dir);
    onnx_check(&path);
    for batch in [1, 3] {
        let logits = forward(&model, &[("tokens", &tokens(batch, cfg.seq, cfg.vocab))]);
        assert_eq!(logits.shape, vec![batch * cfg.seq, cfg.vocab]);
        assert!(logits.as_f32().unwrap().iter().all(|v| v.is_finite()));
    }
}

/// ONNX Runtime's logits of the model match GPT-2 written in numpy (float64,
/// `tests/reference/gpt2_numpy.py`), with weights scaled up 10x so attention is far
/// from uniform; and position t's logits do not depend on tokens after t.
#[test]
fn gpt2_matches_a_numpy_reference_and_is_causal() {
    let dir = tmp("gpt2_reference");
    let tied = Gpt2Config {
        batch: Some(2),
        tie_embeddings: true,
        layers: 1,
        heads: 2,
        ..Default::default()
    };
    for (name, cfg) in [("untied", Gpt2Config::default()), ("tied", tied)] {
        let mut model = build(&ModelSpec::Gpt2(cfg.clone())).unwrap();
        for t in &mut model.graph.as_mut().unwrap().initializer {
            if t.dims.len() == 2 {
                let mut v = Tensor::from_proto(t).unwrap();
                v.as_f32_mut().unwrap().iter_mut().for_each(|w| *w *= 10.0);
                *t = v.to_proto(&t.name);
            }
        }
        let path = dir.join(format!("{name}.onnx"));
        save_model(&model, &path).unwrap();
        let (b, t, v) = (2, cfg.seq, cfg.vocab);
        let ids: Vec<i64> = (0..b * t).map(|i| ((i * i * 31 + 7) % v) as i64).collect();
        let tokens = Tensor::i64(vec![b, t], ids.clone()).unwrap();
        let tokens_path = dir.join(format!("{name}_tokens.npz"));
        write_npz(&tokens_path, &[("tokens", &tokens)]).unwrap();
        let out = dir.join(format!("{name}_logits.npy"));
        let heads = cfg.heads.to_string();
        run_python(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/reference/gpt2_numpy.py"
            ))
            .unwrap(),
            &[&path, &tokens_path, &out, Path::new(&heads)],
        );
        let reference = parse_npy(&std::fs::read(&out).unwrap())
            .unwrap()
            .to_f64_vec();
        let logits = forward(&model, &[("tokens", &tokens)]);
        assert_eq!(logits.shape, vec![b * t, v]);
        let scale = reference.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let worst = logits
            .to_f64_vec()
            .iter()
            .zip(&reference)
            .fold(0.0f64, |m, (a, r)| m.max((a - r).abs()));
        eprintln!("gpt2 {name}: max |ORT - numpy| = {worst:.2e} (max |logit| {scale:.2})");
        assert!(
            scale > 1.0 && worst < 1e-4 * scale,
            "{name}: {worst:.2e} of {scale:.2}"
        );

        // Changing each row's last token changes only the last position's logits.
        let mut changed = ids;
        for row in 0..b {
            changed[row * t + t - 1] = (changed[row * t + t - 1] + 1) % v as i64;
        }
        let changed = Tensor::i64(vec![b, t], changed).unwrap();
        let after = forward(&model, &[("tokens", &changed)]);
        let (l0, l1) = (logits.as_f32().unwrap(), after.as_f32().unwrap());
        for pos in 0..b * t {
            let (r0, r1) = (&l0[pos * v..(pos + 1) * v], &l1[pos * v..(pos + 1) * v]);
            if pos % t == t - 1 {
                assert_ne!(r0, r1, "{name}: position {pos} ignores its own token");
            } else {
                assert_eq!(r0, r1, "{name}: position {pos} sees a later token");
            }
        }
    }
}

/// A fixed batch of 2 and tied embeddings (one parameter read by the embedding and the
/// head): it runs, passes the checker, and trains in one stage on micro-batches of 2.
#[test]
fn gpt2_with_a_fixed_batch_and_tied_embeddings_runs_and_trains() {
    let dir = tmp("gpt2_fixed");
    let cfg = Gpt2Config {
        batch: Some(2),
        tie_embeddings: true,
        layers: 1,
        ..Default::default()
    };
    let (model, path) = write_model(&ModelSpec::Gpt2(cfg.clone()), &dir);
    onnx_check(&path);
    let logits = forward(&model, &[("tokens", &tokens(2, cfg.seq, cfg.vocab))]);
    assert_eq!(logits.shape, vec![2 * cfg.seq, cfg.vocab]);

    write_data(&SynthSpec::Language(LanguageConfig::default()), &dir);
    let batches = "batch_size = 2\nnum_train_steps = 60";
    let (summary, losses) = train_toml(&dir, &config("targets", NEXT_TOKEN, batches, GPT2_ADAMW));
    // wte, wpe, 12 in the block, ln_f's 2; the head is wte.
    assert_eq!(summary.parameters.len(), 16);
    assert!(summary
        .parameters
        .iter()
        .all(|(n, _)| !n.starts_with("lm_head")));
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    eprintln!("gpt2 tied, batch 2: loss {first:.3} -> {last:.3}");
    assert!(last < first - 1.0, "loss {first:.3} -> {last:.3}");
}

#[test]
fn squeezenet_runs_and_passes_the_checker() {
    let dir = tmp("squeezenet_forward");
    let cfg = SqueezeNetConfig::default();
    let (model, path) = write_model(&ModelSpec::Squeezenet(cfg), &dir);
    onnx_check(&path);
    let x = Tensor::f32(vec![2, 3, 32, 32], vec![0.5; 2 * 3 * 32 * 32]).unwrap();
    let logits = forward(&model, &[("x", &x)]);
    assert_eq!(logits.shape, vec![2, 10]);
}

#[test]
fn mlp_runs_and_passes_the_checker() {
    let dir = tmp("mlp_forward");
    let (model, path) = write_model(&ModelSpec::Mlp(MlpConfig::default()), &dir);
    onnx_check(&path);
    let x = Tensor::f32(vec![5, 784], vec![0.1; 5 * 784]).unwrap();
    assert_eq!(forward(&model, &[("x", &x)]).shape, vec![5, 10]);
}

/// Writes the default GPT-2 (dynamic batch) and the default language to `dir`.
fn gpt2_setup(dir: &Path) -> LanguageConfig {
    write_model(&ModelSpec::Gpt2(Gpt2Config::default()), dir);
    let lang = LanguageConfig::default();
    write_data(&SynthSpec::Language(lang.clone()), dir);
    lang
}

/// Measured: 100 AdamW steps of 16 sequences take the loss from 4.16 (ln 64; mean of
/// the first 5 steps 3.91) to 1.53 (last 5), against the language's floor ln 4 = 1.386,
/// in about 1 s.
#[test]
fn gpt2_learns_the_synthetic_language() {
    let dir = tmp("gpt2_train");
    let lang = gpt2_setup(&dir);
    let batches = "batch_size = 16\nnum_train_steps = 100";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("targets", NEXT_TOKEN, batches, GPT2_ADAMW));
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    let floor = lang.entropy_floor();
    eprintln!(
        "gpt2: {} steps in {:.1?}: loss {first:.3} -> {last:.3} (floor {floor:.3})",
        summary.steps,
        start.elapsed()
    );
    assert_eq!(summary.steps, 100);
    assert!(
        (losses[0] - 64f64.ln()).abs() < 0.05,
        "starts near ln 64: {}",
        losses[0]
    );
    assert!(first - last > 2.0, "loss {first:.3} -> {last:.3}");
    assert!(
        last < floor + 0.4,
        "{last:.3} is not near the floor {floor:.3}"
    );
    assert!(
        last > floor - 0.05,
        "{last:.3} beats the floor {floor:.3}: labels leak"
    );
}

/// The dynamic-batch GPT-2 trains as a 2-stage pipeline of 4 micro-batches of 4, and
/// its losses are those of one stage taking the 16 sequences at once (micro-batching
/// only changes float32 summation order: measured within 1e-5).
#[test]
fn gpt2_trains_as_a_two_stage_pipeline_of_small_micro_batches() {
    let dir = tmp("gpt2_pipeline");
    gpt2_setup(&dir);
    let whole = "batch_size = 16\nnum_train_steps = 30";
    let piped = "batch_size = 4\ngradient_accumulation_steps = 4\nnum_train_steps = 120\n\
                 pipeline_parallel_size = 2";
    let (one, reference) = train_toml(&dir, &config("targets", NEXT_TOKEN, whole, GPT2_ADAMW));
    let start = Instant::now();
    let (two, losses) = train_toml(&dir, &config("targets", NEXT_TOKEN, piped, GPT2_ADAMW));
    eprintln!(
        "gpt2 pipeline: {} steps of 4 micro-batches in {:.1?}, loss {:.3} -> {:.3}",
        two.steps,
        start.elapsed(),
        losses[0],
        losses[losses.len() - 1]
    );
    assert_eq!((one.stages, two.stages), (1, 2));
    assert_eq!(losses.len(), reference.len());
    let worst = losses
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!("max |pipeline - single stage| loss: {worst:.2e}");
    assert!(worst < 1e-4, "pipeline losses differ by {worst:.2e}");
    assert!(losses[0] - losses[losses.len() - 1] > 1.0);
}

/// Measured: 200 Adam steps (cosine, 5% warmup) of 32 images take the held-out accuracy
/// from 0.12 to 0.79 (chance 0.10) and the training loss from 2.31 to ~0.46, in ~7.5 s.
#[test]
fn squeezenet_learns_the_synthetic_images() {
    let dir = tmp("squeezenet_train");
    let (model, _) = write_model(&ModelSpec::Squeezenet(SqueezeNetConfig::default()), &dir);
    let images = ImagesConfig::default();
    write_data(&SynthSpec::Images(images.clone()), &dir);
    let optimizer = "[optimizer]\nkind = \"adam\"\n\n\
                     [lr_schedule]\nkind = \"cosine\"\nlr = 3e-4\nwarmup_ratio = 0.05";
    let batches = "batch_size = 32\nnum_train_steps = 200";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("y", ARRAYS, batches, optimizer));
    // Accuracy on held-out images of the same classes, before and after.
    let held_out = ImagesConfig {
        samples: 200,
        sample_seed: 1,
        ..images
    };
    let d = generate(&SynthSpec::Images(held_out)).unwrap();
    let accuracy_of = |m: &ModelProto| accuracy(&forward(m, &[("x", &d["x"])]), &d["y"]);
    let trained: Vec<(&str, &Tensor)> = summary
        .parameters
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let (before, after) = (
        accuracy_of(&model),
        accuracy_of(&export_inference_model(&model, &trained).unwrap()),
    );
    let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
    eprintln!(
        "squeezenet: {} steps in {:.1?}: loss {first:.3} -> {last:.3}, held-out accuracy \
         {before:.3} -> {after:.3}",
        summary.steps,
        start.elapsed()
    );
    assert!(after >= 0.4, "held-out accuracy {after} (chance 0.1)");
    assert!(after > before + 0.2);
    assert!(last < first - 1.0, "loss {first:.3} -> {last:.3}");
}

/// Measured: 150 AdamW steps (lr 1e-3) of 64 teacher-labelled samples take the default
/// MLP's training loss from 2.30 to 0.003 (it memorises the 2048 samples), in ~0.4 s;
/// held-out accuracy (1000 fresh samples) goes from 0.11 to 0.34 (chance 0.1).
#[test]
fn mlp_learns_the_teacher() {
    let dir = tmp("mlp_train");
    let (model, _) = write_model(&ModelSpec::Mlp(MlpConfig::default()), &dir);
    let teacher = TeacherConfig {
        samples: 2048,
        ..Default::default()
    };
    write_data(&SynthSpec::Teacher(teacher.clone()), &dir);
    let optimizer =
        "[optimizer]\nkind = \"adamw\"\n\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3";
    let batches = "batch_size = 64\nnum_train_steps = 150";
    let start = Instant::now();
    let (summary, losses) = train_toml(&dir, &config("y", ARRAYS, batches, optimizer));
    let held_out = TeacherConfig {
        samples: 1000,
        sample_seed: 1,
        ..teacher
    };
    let d = generate(&SynthSpec::Teacher(held_out)).unwrap();
    let accuracy_of = |m: &ModelProto| accuracy(&forward(m, &[("x", &d["x"])]), &d["y"]);
    let trained: Vec<(&str, &Tensor)> = summary
        .parameters
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let (before, after) = (
        accuracy_of(&model),
        accuracy_of(&export_inference_model(&model, &trained).unwrap()),
    );
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    eprintln!(
        "mlp: {} steps in {:.1?}: loss {first:.3} -> {last:.3}, held-out accuracy \
         {before:.3} -> {after:.3}",
        summary.steps,
        start.elapsed()
    );
    assert!(last < 0.1, "loss {first:.3} -> {last:.3}");
    assert!(first > 2.0, "loss {first:.3} -> {last:.3}");
    assert!(after > 0.25, "held-out accuracy {before:.3} -> {after:.3}");
}

/// numpy reads what `write_npz` wrote: shapes, types and values (sums) agree.
#[test]
fn numpy_reads_the_synthetic_data_files() {
    let dir = tmp("numpy");
    let spec = SynthSpec::Teacher(TeacherConfig {
        samples: 100,
        inputs: 8,
        ..Default::default()
    });
    let path = write_data(&spec, &dir);
    let arrays = generate(&spec).unwrap();
    let seen = run_python(
        "import sys, numpy as np\n\
         d = np.load(sys.argv[1])\n\
         print(d['x'].dtype, d['x'].shape, repr(float(d['x'].astype(np.float64).sum())), \
               d['y'].dtype, d['y'].shape, int(d['y'].sum()))",
        &[&path],
    );
    let x_sum: f64 = arrays["x"].to_f64_vec().iter().sum();
    let y_sum: i64 = arrays["y"].as_i64().unwrap().iter().sum();
    let parts: Vec<&str> = seen.split(' ').collect();
    assert_eq!(parts[0], "float32", "{seen}");
    assert_eq!(parts[1..3].join(" "), "(100, 8)", "{seen}");
    assert!(
        (parts[3].parse::<f64>().unwrap() - x_sum).abs() < 1e-9,
        "{seen}"
    );
    assert_eq!(parts[4], "int64", "{seen}");
    assert_eq!(parts[5], "(100,)", "{seen}");
    assert_eq!(parts[6].parse::<i64>().unwrap(), y_sum, "{seen}");
}

/// A model section with a broken rule names the file and the field.
#[test]
fn bad_model_configs_name_the_field() {
    let cases = [
        ("kind = \"gpt2\"\nd_model = 30\nheads = 4", "model.heads"),
        ("kind = \"gpt2\"\nbatch = 0", "model.batch"),
        ("kind = \"squeezenet\"\nimage_size = 16", "model.image_size"),
        ("kind = \"mlp\"\nhidden = [64, 0]", "model.hidden[1]"),
    ];
    for (text, want) in cases {
        let spec: ModelSpec = toml::from_str(text).unwrap();
        match spec.validate(Path::new("run.toml")) {
            Err(Error::Config { path, field, .. }) => {
                assert_eq!(
                    (path.as_path(), field.as_str()),
                    (Path::new("run.toml"), want)
                )
            }
            other => panic!("{text}: {other:?}"),
        }
        assert!(matches!(build(&spec), Err(Error::Config { .. })), "{text}");
    }
}
