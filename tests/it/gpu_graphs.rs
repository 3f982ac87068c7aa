//! The kernels a graph built for a GPU holds (`TrainOptions::cuda_kernels`, and with
//! `cuda_kernels_untried` those not yet run on a GPU), run here by their CPU twins:
//! which nodes the graph holds, and its loss and gradients against the standard-op
//! graph's.

use crate::common;

use crate::common::fused::{assert_same, fused_nodes};
use crate::common::gradcheck::Rng;
use pipetrain::graph::custom_ops::SOFTMAX_GRAD;
use pipetrain::graph::{LossSpec, TrainingGraph};
use pipetrain::tensor::Tensor;

/// The built-in GPT-2 (batch 2) with random tokens and targets, its training graph built
/// with some of pipetrain's kernel choices, and one step of it on the CPU.
struct Gpt2Case {
    cfg: pipetrain::models::Gpt2Config,
    model: pipetrain::onnx::proto::ModelProto,
    tokens: Tensor,
    targets: Tensor,
}

/// Which of pipetrain's kernels a graph is built with.
#[derive(Clone, Copy)]
struct Kernels {
    cuda: bool,
    fused: bool,
    untried: bool,
    flash: bool,
}

const PLAIN: Kernels = Kernels {
    cuda: false,
    fused: false,
    untried: false,
    flash: false,
};

impl Gpt2Case {
    fn new() -> Gpt2Case {
        use pipetrain::models::{build, Gpt2Config, ModelSpec};
        let cfg = Gpt2Config {
            batch: Some(2),
            ..Gpt2Config::DEFAULT
        };
        let model = build(&ModelSpec::Gpt2(cfg.clone())).unwrap();
        let mut rng = Rng::new(5);
        let mut ids = || {
            let v = (0..2 * cfg.seq).map(|_| (rng.next() * cfg.vocab as f64) as i64);
            Tensor::i64(vec![2, cfg.seq], v.collect()).unwrap()
        };
        let (tokens, targets) = (ids(), ids());
        Gpt2Case {
            cfg,
            model,
            tokens,
            targets,
        }
    }

    fn graph(&self, k: Kernels) -> TrainingGraph {
        let loss = LossSpec::SoftmaxCrossEntropy {
            prediction: "logits".into(),
            label: "targets".into(),
            ignore_index: None,
            class_axis: None,
            normalize: Default::default(),
        };
        let rt = common::runtime();
        let opts = pipetrain::graph::TrainOptions {
            inputs: Default::default(),
            loss,
            trainable: None,
            contrib_ops: true,
            fused_kernels: k.fused,
            cuda_kernels: k.cuda,
            cuda_kernels_untried: k.untried,
            flash_attention: k.flash,
            params: Default::default(),
        };
        let feeds = [("tokens", &self.tokens), ("targets", &self.targets)];
        pipetrain::graph::build_training_graph(&rt, &self.model, &opts, &feeds).unwrap()
    }

    fn step(&self, tg: &TrainingGraph) -> pipetrain::compute::StepOutput {
        let rt = common::runtime();
        let opts = pipetrain::compute::SessionOptions::default();
        let mut s = pipetrain::compute::TrainSession::new(&rt, tg, &opts).unwrap();
        let data = [
            ("tokens".to_string(), self.tokens.clone()),
            ("targets".into(), self.targets.clone()),
        ];
        let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
        s.step(&common::initial_params(tg), &data.into(), &seed)
            .unwrap()
    }

    /// The loss and every gradient of `a`'s step are `b`'s within float32 rounding.
    fn assert_same_step(&self, what: &str, a: &TrainingGraph, b: &TrainingGraph) {
        let (a, b) = (self.step(a), self.step(b));
        assert!(
            (a.loss - b.loss).abs() < 1e-6 * b.loss.abs(),
            "{what}: {} {}",
            a.loss,
            b.loss
        );
        let wrt: Vec<&str> = b.grads.keys().map(String::as_str).collect();
        assert!(wrt.len() > 20);
        assert_same(what, &a.grads, &b.grads, &wrt, 1e-5);
    }
}

/// The kernels a graph built for a GPU holds (`TrainOptions::cuda_kernels`), run here by
/// their CPU twins (on the CPU, `fused_kernels` makes the same GELU nodes): on the built-in GPT-2 every tanh GELU is one `TanhGelu` (its backward
/// one `TanhGeluGrad`) and every attention softmax's backward one `SoftmaxGrad`, and the
/// loss and every gradient are the standard-op graph's within float32 rounding.
#[test]
fn gpu_graphs_tanh_gelu_and_softmax_grad_give_the_standard_op_graphs_gradients() {
    use pipetrain::graph::custom_ops::{TANH_GELU, TANH_GELU_GRAD};
    let case = Gpt2Case::new();
    let layers = case.cfg.layers;
    let cuda = Kernels {
        cuda: true,
        ..PLAIN
    };
    let (gpu, plain) = (case.graph(cuda), case.graph(PLAIN));
    for op in [TANH_GELU, TANH_GELU_GRAD, SOFTMAX_GRAD] {
        assert_eq!(fused_nodes(&gpu, op), layers, "{op}");
        assert_eq!(fused_nodes(&plain, op), 0, "{op}");
    }
    let cpu = case.graph(Kernels {
        fused: true,
        ..PLAIN
    });
    assert_eq!(
        fused_nodes(&cpu, TANH_GELU),
        layers,
        "fused_kernels: TanhGelu"
    );
    assert!(!gpu.graph.nodes.iter().any(|n| n.op_type == "Tanh"));
    case.assert_same_step("gpt2, GPU kernels", &gpu, &plain);
}

/// A graph built for a GPU with `cuda_kernels_untried` (`compute/cuda_attention.rs`,
/// `compute/cuda_layer_norm.rs`), run here by the operators' CPU twins: each of GPT-2's
/// causal attentions is one node each way, with its causal mask the kernel's own (no
/// softmax, mask or transposes left), each LayerNorm's backward one `LayerNormGrad`, and
/// the loss and every gradient are the standard-op graph's within float32 rounding.
/// Without `cuda_kernels_untried`, both stay standard ops.
#[test]
fn gpu_graphs_untried_kernels_give_the_standard_op_graphs_gradients() {
    use pipetrain::graph::custom_ops::{LAYER_NORM_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD};
    let case = Gpt2Case::new();
    let layers = case.cfg.layers;
    let cuda = Kernels {
        cuda: true,
        ..PLAIN
    };
    let untried = Kernels {
        untried: true,
        ..cuda
    };
    let (gpu, without, plain) = (case.graph(untried), case.graph(cuda), case.graph(PLAIN));
    for (op, n) in [
        (PACKED_ATTENTION, layers),
        (PACKED_ATTENTION_GRAD, layers),
        (LAYER_NORM_GRAD, 2 * layers + 1),
    ] {
        assert_eq!(fused_nodes(&gpu, op), n, "{op}");
        assert_eq!(
            fused_nodes(&without, op),
            0,
            "{op} without cuda_kernels_untried"
        );
    }
    let node = gpu
        .graph
        .nodes
        .iter()
        .find(|n| n.op_type == PACKED_ATTENTION)
        .unwrap();
    let causal = node
        .attribute
        .iter()
        .find(|a| a.name == "causal")
        .map(|a| a.i);
    assert_eq!(causal, Some(1), "the causal mask is the kernel's own");
    assert_eq!(node.input.len(), 1, "no mask input");
    assert_eq!(
        fused_nodes(&gpu, SOFTMAX_GRAD),
        0,
        "the softmax went into the node"
    );
    case.assert_same_step("gpt2, untried GPU kernels", &gpu, &plain);
}

/// With `flash_attention` too (`compute/kernels/flash.rs`), each attention keeps its
/// rows' log-sum-exps (attribute `lse`, a second output of its own name) and its backward
/// reads them with the forward's output; run here by the CPU operator's `lse` form (the
/// probabilities computed again), the loss and every gradient are the standard-op graph's
/// within float32 rounding.
#[test]
fn gpu_graphs_flash_attention_gives_the_standard_op_graphs_gradients() {
    use pipetrain::graph::custom_ops::{PACKED_ATTENTION, PACKED_ATTENTION_GRAD};
    let case = Gpt2Case::new();
    let layers = case.cfg.layers;
    let flash = Kernels {
        cuda: true,
        untried: true,
        flash: true,
        ..PLAIN
    };
    let (gpu, plain) = (case.graph(flash), case.graph(PLAIN));
    let nodes = |op: &str| -> Vec<&pipetrain::onnx::proto::NodeProto> {
        gpu.graph.nodes.iter().filter(|n| n.op_type == op).collect()
    };
    let (forward, backward) = (nodes(PACKED_ATTENTION), nodes(PACKED_ATTENTION_GRAD));
    assert_eq!((forward.len(), backward.len()), (layers, layers));
    for (f, b) in forward.iter().zip(&backward) {
        let lse = f.attribute.iter().find(|a| a.name == "lse").map(|a| a.i);
        assert_eq!(lse, Some(1), "{}", f.name);
        assert!(f.output[1].ends_with("/lse"), "{:?}", f.output);
        let kept = [f.output[1].as_str(), f.output[0].as_str()];
        assert!(
            backward.iter().any(|b| b.input[2..] == kept),
            "a backward reads {kept:?}"
        );
        assert_eq!(b.input.len(), 4, "dO, QKV, L, O: {:?}", b.input);
    }
    case.assert_same_step("gpt2, flash attention", &gpu, &plain);
}
