//! Training-mode dropout as users export it (GPT-2's fixture, its `Dropout` ratios set to
//! 0.1 as `torch.onnx.export` writes them for a model configured with dropout): on the
//! CPU each mask is drawn from the seed, the step, the replica and the micro-batch
//! (`graph::keyed_dropout`), so a run repeats bit for bit, resumes from a checkpoint as
//! if never stopped, and recomputes its stages' forwards with the forward's masks.

use std::path::{Path, PathBuf};

use crate::common::exported::{fixture, piped, reference, train_run, Run, GPT2};
use pipetrain::checkpoint::folder_name;
use pipetrain::graph::{build_stage_graphs, custom_ops::KEYED_DROPOUT, DROPOUT_KEY};
use pipetrain::tensor::Tensor;

/// The GPT-2 fixture with every `Dropout`'s ratio set to `ratio`, written into `dir`.
pub(crate) fn gpt2_with_dropout(dir: &Path, ratio: f32) -> PathBuf {
    let mut model = pipetrain::onnx::load_model(&fixture("gpt2").join("model.onnx")).unwrap();
    let g = model.graph.as_mut().unwrap();
    let ratios: Vec<String> = (g.node.iter())
        .filter(|n| n.op_type == "Dropout")
        .map(|n| n.input[1].clone())
        .collect();
    let mut set = 0;
    for n in g.node.iter_mut().filter(|n| n.op_type == "Constant") {
        if ratios.contains(&n.output[0]) {
            let value = Tensor::f32(vec![], vec![ratio]).unwrap();
            n.attribute[0].t = Some(value.to_proto(""));
            set += 1;
        }
    }
    assert_eq!(set, ratios.len(), "every ratio is a Constant node's");
    assert!(set >= 5, "{set} dropouts");
    let path = dir.join(format!("gpt2_dropout_{ratio}.onnx"));
    pipetrain::onnx::save_model(&model, &path).unwrap();
    path
}

/// Each step's loss of GPT-2 `model` at pp 2 (1F1B, 2 micro-batches, AdamW) for 8 steps,
/// with `extra` configuration lines.
fn run(model: &Path, extra: &str) -> Vec<f64> {
    let (_, _, lr) = reference(&GPT2, "adamw");
    let run = Run {
        model: model.to_str().unwrap(),
        optimizer: "adamw",
        lr,
        layout: piped(2, 2, "1f1b"),
        steps: 8,
        extra,
    };
    train_run(&GPT2, &run)
}

#[test]
fn exported_dropouts_repeat_resume_and_recompute_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let model = gpt2_with_dropout(dir.path(), 0.1);
    let ckpts = dir.path().join("ckpts");
    let saving = format!("checkpoints_dir = {ckpts:?}\ncheckpoint_period = 4\n");
    let straight = run(&model, &saving);
    assert_eq!(straight.len(), 8);
    // The masks are drawn: the same run without dropout has other losses from the start.
    let none = run(&gpt2_with_dropout(dir.path(), 0.0), "");
    assert_ne!(none[0], straight[0], "dropout changes the first loss");
    assert_eq!(run(&model, ""), straight, "a second run repeats the first");
    let loading = format!(
        "checkpoint_to_load_path = {:?}\n",
        ckpts.join(folder_name(4))
    );
    assert_eq!(run(&model, &loading), straight[4..], "resumed at step 4");
    let recomputing = "recompute = \"stage\"\n";
    assert_eq!(run(&model, recomputing), straight, "recomputed forwards");
    // Another seed, other masks.
    assert_ne!(
        run(&model, "seed = 1\n"),
        straight,
        "the seed draws the masks"
    );
}

/// ONNX Runtime's own `Dropout` (without pipetrain's kernels) draws from one generator
/// per process, seeded by the clock: the same configuration trains differently each run,
/// which is why the CPU path keys the masks.
#[test]
fn onnx_runtime_s_own_dropout_differs_from_run_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = gpt2_with_dropout(dir.path(), 0.1);
    let standard = "[runtime]\nfused_kernels = false\n";
    assert_ne!(run(&model, standard), run(&model, standard));
}

/// The stage graphs: each training-mode dropout of the forward reads the key, and the
/// evaluation graph computes none (so evaluation needs no key and draws no mask).
#[test]
fn keyed_dropouts_train_and_evaluate_computes_none() {
    let rt = crate::common::runtime();
    let dir = tempfile::tempdir().unwrap();
    let model = pipetrain::onnx::load_model(&gpt2_with_dropout(dir.path(), 0.1)).unwrap();
    let batch = crate::common::exported::first_batch(&GPT2);
    let feeds: Vec<(&str, &Tensor)> = batch.iter().map(|(n, t)| (*n, t)).collect();
    let opts = crate::common::exported::train_options(&GPT2);
    let mut tg = pipetrain::graph::build_training_graph(&rt, &model, &opts, &feeds).unwrap();
    let n = pipetrain::graph::key_dropouts(&mut tg);
    let dropouts =
        |g: &pipetrain::graph::Graph, op: &str| g.nodes.iter().filter(|n| n.op_type == op).count();
    assert!(n >= 5 && dropouts(&tg.graph, "Dropout") == 0, "{n} keyed");
    let one = pipetrain::graph::Partition::Balanced {
        stages: 1,
        by: pipetrain::graph::BalanceBy::Flops,
    };
    let a = pipetrain::graph::assign_stages(&tg, &one).unwrap();
    let stage = &build_stage_graphs(&tg, &a).unwrap()[0];
    assert_eq!(dropouts(&stage.forward, KEYED_DROPOUT), n);
    assert!(stage.io.data.iter().any(|d| d == DROPOUT_KEY));
    assert_eq!(dropouts(&stage.evaluate, KEYED_DROPOUT), 0);
    assert_eq!(dropouts(&stage.evaluate, "Dropout"), 0);
    assert!(!stage.evaluate.inputs.iter().any(|v| v.name == DROPOUT_KEY));
}

/// The seeds' `Module` keys its dropouts the same way (by its optimizer steps and its
/// training steps since the last): two modules from the same weights train alike, and
/// unlike the same model without dropout.
#[test]
fn a_module_s_dropouts_repeat() {
    use pipetrain::api::{CheckpointState, Module, Optimizer};
    let rt = crate::common::runtime();
    let dir = tempfile::tempdir().unwrap();
    let batch: pipetrain::tensor::TensorMap = crate::common::exported::first_batch(&GPT2)
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
    let losses = |model: &Path| -> Vec<u64> {
        let loss = crate::common::exported::train_options(&GPT2).loss;
        let state = CheckpointState::from_init(None).unwrap();
        let mut module = Module::new(&rt, model, loss, &batch, state).unwrap();
        let config = pipetrain::optim::OptimizerConfig::default();
        let mut optimizer = Optimizer::new(config, 0.05, &mut module).unwrap();
        module.train();
        let mut out = Vec::new();
        for _ in 0..3 {
            for _ in 0..2 {
                out.push(module.train_step_blocking(&batch).unwrap().to_bits());
            }
            optimizer.step_blocking(&mut module).unwrap();
            module.lazy_reset_grad();
        }
        out
    };
    let keyed = gpt2_with_dropout(dir.path(), 0.1);
    let first = losses(&keyed);
    assert_eq!(losses(&keyed), first);
    assert_ne!(losses(&gpt2_with_dropout(dir.path(), 0.0)), first);
    // Each training step of a step draws its own masks.
    assert_ne!(first[0], first[1]);
}

/// The trained inference model computes no dropout: its training-mode `Dropout`s are put
/// in inference mode, as PyTorch's `eval()` does (two runs of ONNX Runtime with its
/// graph optimizations off give the same logits).
#[test]
fn the_exported_model_computes_no_dropout() {
    let dir = tempfile::tempdir().unwrap();
    let model = pipetrain::onnx::load_model(&gpt2_with_dropout(dir.path(), 0.5)).unwrap();
    let exported = pipetrain::graph::export_inference_model(&model, &[]).unwrap();
    let g = exported.graph.as_ref().unwrap();
    let dropouts: Vec<_> = g.node.iter().filter(|n| n.op_type == "Dropout").collect();
    assert!(!dropouts.is_empty());
    assert!(dropouts
        .iter()
        .all(|n| n.input.len() == 2 && n.output.len() == 1));
    let rt = crate::common::runtime();
    let opts = pipetrain::compute::SessionOptions {
        optimize: false,
        ..Default::default()
    };
    let g = pipetrain::graph::Graph::from_model(&exported).unwrap();
    let mut session = pipetrain::compute::GraphSession::new(&rt, &g, &opts, "exported").unwrap();
    let batch = crate::common::exported::first_batch(&GPT2);
    let feeds: Vec<(&str, &Tensor)> = (batch.iter())
        .filter(|(n, _)| *n == "input_ids")
        .map(|(n, t)| (*n, t))
        .collect();
    let a = session.run(&feeds).unwrap();
    let b = session.run(&feeds).unwrap();
    assert_eq!(a[0].as_f32(), b[0].as_f32());
}
