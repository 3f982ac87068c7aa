//! `runtime.flash_attention` on the CPU (`compute/fused/attention`'s `lse` form, the
//! GPU's flash kernels' twin): every exported attention form, the exported BERT's padding
//! mask read again in the backward, and the BERT and GPT-2 fixtures trained as PyTorch.

use crate::common;

use crate::common::exported::{
    assert_within_spread, first_batch, fixture, piped, reference, train_options, train_run, Run,
    BERT, GPT2,
};
use crate::common::fused::{assert_same, fused_nodes, gradients, gradients_flash};
use crate::fused_attention::model;
use pipetrain::graph::attr_i;
use pipetrain::graph::custom_ops::{
    ATTENTION, ATTENTION_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD,
};
use pipetrain::graph::TrainingGraph;
use pipetrain::tensor::Tensor;

/// With `flash_attention` on the CPU each form's fused node keeps its rows' log-sum-exps
/// (`lse`, an output `[B, H, T]`), its backward reads them, the output and the mask, and
/// computes the probabilities again: the loss and gradients are the standard-op graph's
/// within float32 rounding.
#[test]
fn attention_keeping_the_log_sum_exp_gives_the_standard_op_graphs_gradients() {
    for form in [
        "gpt",
        "prefixed",
        "bert",
        "vit",
        "mha",
        "packed",
        "gpt_where",
    ] {
        let wrt: &[&str] = if form == "packed" {
            &["QKV"]
        } else {
            &["Q", "K", "V"]
        };
        let model = model(form);
        let (flash_tg, flash) = gradients_flash(&model, wrt);
        let (_, plain) = gradients(&model, false, wrt);
        let nodes = &flash_tg.graph.nodes;
        let node = nodes
            .iter()
            .find(|n| [ATTENTION, PACKED_ATTENTION].contains(&n.op_type.as_str()))
            .unwrap();
        assert_eq!(attr_i(node, "lse"), Some(1), "{form}");
        let grad = nodes
            .iter()
            .find(|n| [ATTENTION_GRAD, PACKED_ATTENTION_GRAD].contains(&n.op_type.as_str()))
            .unwrap();
        let parts = wrt.len();
        let masked = node.input.len() > parts;
        assert_eq!(
            grad.input[parts + 1..parts + 3],
            [node.output[1].clone(), node.output[0].clone()],
            "{form}"
        );
        assert_eq!(grad.input.len(), parts + 3 + usize::from(masked), "{form}");
        let mut compared = vec!["loss"];
        compared.extend(wrt);
        assert_same(form, &flash, &plain, &compared, 4e-6);
    }
}

/// `runtime.flash_attention`: every attention of BERT (its padding mask read again in the
/// backward) and of GPT-2 (causal) keeps its rows' log-sum-exps instead of its
/// probabilities, and both train as PyTorch at pp = 2 (1F1B, two micro-batches), SGD
/// within the float32 spread.
#[test]
fn attention_keeping_its_log_sum_exp_trains_bert_and_gpt2_as_pytorch() {
    for f in [&BERT, &GPT2] {
        let batch = first_batch(f);
        let example: Vec<(&str, &pipetrain::tensor::Tensor)> =
            batch.iter().map(|(n, t)| (*n, t)).collect();
        let model = pipetrain::onnx::load_model(&fixture(f.name).join("model.onnx")).unwrap();
        let opts = pipetrain::graph::TrainOptions {
            flash_attention: true,
            ..train_options(f)
        };
        let rt = crate::common::runtime();
        let tg = pipetrain::graph::build_training_graph(&rt, &model, &opts, &example).unwrap();
        let forward = &tg.graph.nodes[..tg.forward_len];
        let lse = forward
            .iter()
            .filter(|n| n.attribute.iter().any(|a| a.name == "lse" && a.i == 1));
        assert_eq!(lse.count(), 2, "{}: each layer's attention", f.name);
        let (f64s, f32s, lr) = reference(f, "sgd");
        let run = Run {
            model: "model.onnx",
            optimizer: "sgd",
            lr,
            layout: piped(2, 2, "1f1b"),
            steps: f64s.len(),
            extra: "[runtime]\nflash_attention = true\n",
        };
        let ours = train_run(f, &run);
        let what = format!("{} flash attention pp 2", f.name);
        assert_within_spread(&what, &ours, &f64s, &f32s, 4.0);
    }
}

/// Hugging Face's BERT as `torch.onnx.export` writes it (the fixture: heads of 16, a
/// padding mask), built for a GPU with `flash_attention`: each attention keeps its
/// rows' log-sum-exps and its backward reads the padding mask too (to compute the
/// probabilities again); one step on the CPU gives the standard-op graph's loss and
/// gradients within float32 rounding.
#[test]
fn a_gpu_graph_reads_berts_padding_mask_again_in_the_backward() {
    let batch = first_batch(&BERT);
    let mask = &batch
        .iter()
        .find(|(n, _)| *n == "attention_mask")
        .unwrap()
        .1;
    assert!(mask.to_f64_vec().contains(&0.0), "the batch has padding");
    let example: Vec<(&str, &Tensor)> = batch.iter().map(|(n, t)| (*n, t)).collect();
    let model = pipetrain::onnx::load_model(&fixture("bert").join("model.onnx")).unwrap();
    let rt = common::runtime();
    let build = |flash: bool| {
        let opts = pipetrain::graph::TrainOptions {
            fused_kernels: false,
            cuda_kernels: flash,
            cuda_kernels_untried: flash,
            flash_attention: flash,
            ..train_options(&BERT)
        };
        pipetrain::graph::build_training_graph(&rt, &model, &opts, &example).unwrap()
    };
    let (gpu, plain) = (build(true), build(false));
    let backward: Vec<_> = gpu
        .graph
        .nodes
        .iter()
        .filter(|n| n.op_type == ATTENTION_GRAD)
        .collect();
    assert_eq!(fused_nodes(&gpu, ATTENTION), 2, "one per layer");
    assert_eq!(backward.len(), 2);
    for b in backward {
        // dO, Q, K, V, L, O, mask.
        assert_eq!(b.input.len(), 7, "{:?}", b.input);
    }
    let step = |tg: &TrainingGraph| {
        let opts = pipetrain::compute::SessionOptions::default();
        let mut s = pipetrain::compute::TrainSession::new(&rt, tg, &opts).unwrap();
        let data: Vec<(String, Tensor)> = batch
            .iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect();
        let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
        s.step(
            &common::initial_params(tg),
            &data.into_iter().collect(),
            &seed,
        )
        .unwrap()
    };
    let (a, b) = (step(&gpu), step(&plain));
    assert!(
        (a.loss - b.loss).abs() < 1e-6 * b.loss.abs(),
        "{} {}",
        a.loss,
        b.loss
    );
    let wrt: Vec<&str> = b.grads.keys().map(String::as_str).collect();
    assert!(wrt.len() > 20);
    assert_same("bert, flash attention", &a.grads, &b.grads, &wrt, 1e-5);
}
