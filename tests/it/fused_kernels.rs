//! pipetrain's fused kernels (custom operators in its training graphs): each against
//! the standard-op graph it replaces and central finite differences, and training with
//! and without them (`runtime.fused_kernels`). The float32 LayerNormalization case of
//! `tests/it/grad_ops.rs` also runs with fused kernels on.

use crate::common;

use crate::common::fused::{assert_same, fused_nodes, gradients, gradients_with};
use crate::common::gradcheck::{check, GradCheck, Rng, F32};
use pipetrain::graph::custom_ops::{
    DEPTHWISE_CONV, DEPTHWISE_CONV_GRAD, ERF_GELU, GELU_GRAD, LAYER_NORM_GRAD, RELU_GRAD, SOFTMAX,
    SOFTMAX_CROSS_ENTROPY, SOFTMAX_CROSS_ENTROPY_GRAD, SOFTMAX_GRAD,
};
use pipetrain::graph::{
    int_attr, ints_attr, make_node, untyped_value_info, LossSpec, TrainingGraph,
};
use pipetrain::onnx::proto::{ModelProto, NodeProto};
use pipetrain::tensor::{DType, Tensor};

/// `loss = sum(LayerNorm(X) * R)` over the last axis of `[6, 33, cols]`, float32.
fn layer_norm_model(cols: usize) -> ModelProto {
    let mut r = Rng::new(3);
    let inits = vec![
        ("X", r.tensor(DType::F32, &[6, 33, cols], -2.0, 2.0)),
        ("W", r.tensor(DType::F32, &[cols], 0.5, 1.5)),
        ("B", r.tensor(DType::F32, &[cols], -0.5, 0.5)),
    ];
    let ln = make_node(
        "LayerNormalization",
        "ln",
        &["X", "W", "B"],
        &["Y", "M", "I"],
        vec![],
    );
    weighted_sum(ln, inits, &[6, 33, cols])
}

/// `loss = sum(Softmax(X) * R)` over the last axis of `[3, 4, 17, cols]`, float32.
fn softmax_model(cols: usize) -> ModelProto {
    let mut r = Rng::new(5);
    let inits = vec![("X", r.tensor(DType::F32, &[3, 4, 17, cols], -3.0, 3.0))];
    let sm = make_node("Softmax", "sm", &["X"], &["Y"], vec![]);
    weighted_sum(sm, inits, &[3, 4, 17, cols])
}

/// `node` (output `Y`, of `shape`) with `loss = sum(Y * R)`, `R` fixed random.
fn weighted_sum(node: NodeProto, mut inits: Vec<(&str, Tensor)>, shape: &[usize]) -> ModelProto {
    inits.push(("R", Rng::new(11).tensor(DType::F32, shape, -1.0, 1.0)));
    let nodes = vec![
        node,
        make_node("Mul", "m", &["Y", "R"], &["YR"], vec![]),
        make_node("ReduceSum", "s", &["YR"], &["total"], vec![]),
    ];
    common::opset17_model(
        "fused",
        nodes,
        inits.iter().map(|(n, t)| t.to_proto(n)).collect(),
        vec![],
        vec![untyped_value_info("total")],
    )
}

/// `loss = sum(GELU(X) * R)` with GELU as PyTorch exports `nn.GELU()`: `x / sqrt 2`
/// (or `x * (1 / sqrt 2)`), `Erf`, `+ 1`, `x *`, `* 0.5`.
fn gelu_model(by_mul: bool) -> ModelProto {
    let mut r = Rng::new(13);
    let shape = [5, 7, 67];
    let scalar = |v: f32| Tensor::f32(vec![], vec![v]).unwrap();
    let inits = vec![
        // `|x / sqrt 2|` past 3.725 too, where `erf` is taken as flat.
        ("X", r.tensor(DType::F32, &shape, -6.0, 6.0)),
        ("k", scalar(std::f32::consts::SQRT_2)),
        ("c", scalar(std::f32::consts::FRAC_1_SQRT_2)),
        ("one", scalar(1.0)),
        ("half", scalar(0.5)),
    ];
    let scale = match by_mul {
        false => make_node("Div", "div", &["X", "k"], &["t"], vec![]),
        true => make_node("Mul", "mul", &["c", "X"], &["t"], vec![]),
    };
    let mut chain = vec![
        scale,
        make_node("Erf", "erf", &["t"], &["e"], vec![]),
        make_node("Add", "add", &["e", "one"], &["a"], vec![]),
        make_node("Mul", "times", &["X", "a"], &["m"], vec![]),
        make_node("Mul", "halve", &["m", "half"], &["Y"], vec![]),
    ];
    let last = chain.pop().unwrap();
    let mut model = weighted_sum(last, inits, &shape);
    model.graph.as_mut().unwrap().node.splice(0..0, chain);
    model
}

/// Rows of 48 (whole lanes of 8) and 45 (a remainder).
#[test]
fn layer_norm_grad_gives_the_standard_op_graphs_gradients() {
    let wrt = ["X", "W", "B"];
    for cols in [48, 45] {
        let model = layer_norm_model(cols);
        let (fused_tg, fused) = gradients(&model, true, &wrt);
        let (plain_tg, plain) = gradients(&model, false, &wrt);
        assert_eq!(
            fused_nodes(&fused_tg, LAYER_NORM_GRAD),
            1,
            "one kernel for the rule's ops"
        );
        assert_eq!(fused_nodes(&plain_tg, LAYER_NORM_GRAD), 0);
        assert!(fused_tg.graph.nodes.len() + 10 < plain_tg.graph.nodes.len());
        // float32 rounding of sums over up to 198 rows in another order.
        assert_same(&format!("cols {cols}"), &fused, &plain, &wrt, 2e-6);
    }
}

#[test]
fn softmax_grad_gives_the_standard_op_graphs_gradient_and_finite_differences() {
    for cols in [40, 37] {
        let model = softmax_model(cols);
        let (fused_tg, fused) = gradients(&model, true, &["X"]);
        let (plain_tg, plain) = gradients(&model, false, &["X"]);
        assert_eq!(fused_nodes(&fused_tg, SOFTMAX), 1);
        assert_eq!(fused_nodes(&fused_tg, SOFTMAX_GRAD), 1);
        assert_eq!(fused_nodes(&plain_tg, SOFTMAX_GRAD), 0);
        assert_same(
            &format!("cols {cols}"),
            &fused,
            &plain,
            &["X", "loss"],
            1e-6,
        );
    }
    let mut r = Rng::new(9);
    let case = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[2, 3, 11], -2.0, 2.0))
        .node("Softmax", &["X"], &["Y"], vec![]);
    check("Softmax float32, fused", case, F32);
}

#[test]
fn gelu_kernels_give_the_standard_op_graphs_loss_gradient_and_finite_differences() {
    for by_mul in [false, true] {
        let model = gelu_model(by_mul);
        let (fused_tg, fused) = gradients(&model, true, &["X"]);
        let (plain_tg, plain) = gradients(&model, false, &["X"]);
        assert_eq!(fused_nodes(&fused_tg, ERF_GELU), 1, "five kernels as one");
        assert_eq!(fused_nodes(&fused_tg, GELU_GRAD), 1, "seven kernels as one");
        assert_eq!(fused_nodes(&plain_tg, GELU_GRAD), 0);
        let erfs =
            |tg: &TrainingGraph| tg.graph.nodes.iter().filter(|n| n.op_type == "Erf").count();
        assert_eq!(
            (erfs(&fused_tg), erfs(&plain_tg)),
            (0, 1),
            "the GELU's own nodes go"
        );
        // The forward's arithmetic is the exported form's, `erf` ONNX Runtime's own: the
        // same loss, bit for bit.
        assert_eq!(fused["loss"].to_f64_vec(), plain["loss"].to_f64_vec());
        // The same arithmetic in the same order but for `exp` (within 3 ulp).
        assert_same(&format!("by_mul {by_mul}"), &fused, &plain, &["X"], 1e-6);
    }
    let scalar = |v: f32| Tensor::f32(vec![], vec![v]).unwrap();
    let case = GradCheck::new(17)
        .param("X", Rng::new(21).tensor(DType::F32, &[3, 29], -3.0, 3.0))
        .constant("k", scalar(std::f32::consts::SQRT_2))
        .constant("one", scalar(1.0))
        .constant("half", scalar(0.5))
        .node("Div", &["X", "k"], &["t"], vec![])
        .node("Erf", &["t"], &["e"], vec![])
        .node("Add", &["one", "e"], &["a"], vec![])
        .node("Mul", &["a", "X"], &["m"], vec![])
        .node("Mul", &["half", "m"], &["Y"], vec![]);
    check("GELU float32, fused", case, F32);
}

#[test]
fn relu_grad_gives_the_standard_op_graphs_gradient_bit_for_bit() {
    let mut r = Rng::new(23);
    let mut x = r.tensor(DType::F32, &[9, 77], -1.0, 1.0);
    if let pipetrain::tensor::TensorData::F32(v) = &mut x.data {
        v[..5].fill(0.0); // at the kink: no gradient, as `Greater` says
    }
    let model = weighted_sum(
        make_node("Relu", "relu", &["X"], &["Y"], vec![]),
        vec![("X", x)],
        &[9, 77],
    );
    let (fused_tg, fused) = gradients(&model, true, &["X"]);
    let (plain_tg, plain) = gradients(&model, false, &["X"]);
    assert_eq!(fused_nodes(&fused_tg, RELU_GRAD), 1, "two kernels as one");
    assert_eq!(fused_nodes(&plain_tg, RELU_GRAD), 0);
    assert_eq!(fused["X"].to_f64_vec(), plain["X"].to_f64_vec());
}

/// `logits = X @ W` (`[rows, classes]`), softmax cross-entropy against `labels`.
fn classifier(rows: usize, classes: usize) -> (ModelProto, Tensor) {
    let mut r = Rng::new(17);
    let inits = vec![
        ("X", r.tensor(DType::F32, &[rows, 24], -1.0, 1.0)),
        ("W", r.tensor(DType::F32, &[24, classes], -1.0, 1.0)),
    ];
    let mut model = weighted_sum(
        make_node("MatMul", "mm", &["X", "W"], &["Y"], vec![]),
        inits,
        &[rows, classes],
    );
    model.graph.as_mut().unwrap().output = vec![untyped_value_info("Y")];
    let labels: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 7 + 3) % classes as i64)
        .collect();
    (model, Tensor::i64(vec![rows], labels).unwrap())
}

#[test]
fn cross_entropy_kernels_give_the_standard_op_graphs_loss_and_gradients() {
    use pipetrain::graph::LossNormalize;
    let wrt = ["X", "W", "loss"];
    for (classes, ignore, normalize) in [
        (40, None, LossNormalize::MicroBatch),
        (37, Some(3), LossNormalize::MicroBatch),
        (37, Some(3), LossNormalize::Tokens),
    ] {
        let (model, labels) = classifier(19, classes);
        let loss = LossSpec::SoftmaxCrossEntropy {
            prediction: "Y".into(),
            label: "labels".into(),
            ignore_index: ignore,
            class_axis: None,
            normalize,
        };
        let feeds = [("labels", &labels)];
        let (fused_tg, fused) = gradients_with(&model, loss.clone(), &feeds, true, &wrt[..2]);
        let (plain_tg, plain) = gradients_with(&model, loss, &feeds, false, &wrt[..2]);
        assert_eq!(fused_nodes(&fused_tg, SOFTMAX_CROSS_ENTROPY), 1);
        assert_eq!(fused_nodes(&fused_tg, SOFTMAX_CROSS_ENTROPY_GRAD), 1);
        assert_eq!(fused_nodes(&plain_tg, SOFTMAX_CROSS_ENTROPY), 0);
        let what = format!("{classes} classes, ignore {ignore:?}, {normalize:?}");
        assert_same(&what, &fused, &plain, &wrt, 2e-6);
    }
}

#[test]
fn fused_and_unfused_runs_follow_the_same_curve() {
    let dir = tempfile::tempdir().unwrap();
    let run = |fused: bool| {
        let path = dir.path().join(format!("f{fused}.toml"));
        let text = format!(
            "batch_size = 8\nnum_train_steps = 40\n\
             [model]\nkind = \"gpt2\"\nlayers = 2\nd_model = 64\nheads = 4\nvocab = 64\nseq = 32\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"targets\"\n\
             [data]\nsynth = {{ kind = \"language\", samples = 512, seq = 32, vocab = 64, seed = 7 }}\n\
             layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
             [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 3e-3\n\
             [runtime]\nfused_kernels = {fused}\n"
        );
        std::fs::write(&path, text).unwrap();
        let cfg = pipetrain::config::TrainConfig::load(&path).unwrap();
        let mut losses = Vec::new();
        pipetrain::train::train(&common::runtime(), &cfg, &path, false, |r| {
            losses.push(r.loss)
        })
        .unwrap();
        losses
    };
    let (on, off) = (run(true), run(false));
    assert_eq!(on.len(), 40);
    let worst = on
        .iter()
        .zip(&off)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "fused and unfused curves differ by {worst:e}");
}

/// `loss = sum(Conv(X, W, B) * R)` with one filter per channel (`group` = 6): ConvNeXt's
/// 7x7, MobileNet's 3x3 at stride 2, and dilated, asymmetrically padded 3x2 taps.
fn depthwise_model(
    kernel: [i64; 2],
    strides: [i64; 2],
    pads: [i64; 4],
    dilations: [i64; 2],
) -> ModelProto {
    let (n, c, h, w) = (3usize, 6usize, 11usize, 9usize);
    let mut r = Rng::new(29);
    let span = |a: usize| dilations[a] * (kernel[a] - 1) + 1;
    let out =
        |a: usize, size: usize| (size as i64 + pads[a] + pads[a + 2] - span(a)) / strides[a] + 1;
    let shape = [n, c, out(0, h) as usize, out(1, w) as usize];
    let inits = vec![
        ("X", r.tensor(DType::F32, &[n, c, h, w], -2.0, 2.0)),
        (
            "W",
            r.tensor(
                DType::F32,
                &[c, 1, kernel[0] as usize, kernel[1] as usize],
                -0.5,
                0.5,
            ),
        ),
        ("B", r.tensor(DType::F32, &[c], -0.5, 0.5)),
    ];
    let attrs = vec![
        ints_attr("kernel_shape", &kernel),
        ints_attr("strides", &strides),
        ints_attr("pads", &pads),
        ints_attr("dilations", &dilations),
        int_attr("group", c as i64),
    ];
    let conv = make_node("Conv", "dw", &["X", "W", "B"], &["Y"], attrs);
    weighted_sum(conv, inits, &shape)
}

#[test]
fn depthwise_conv_kernels_give_the_standard_op_graphs_loss_gradients_and_finite_differences() {
    let cases = [
        ([7, 7], [1, 1], [3, 3, 3, 3], [1, 1]),
        ([3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
        ([3, 2], [1, 2], [0, 2, 1, 0], [2, 1]),
    ];
    for (kernel, strides, pads, dilations) in cases {
        let model = depthwise_model(kernel, strides, pads, dilations);
        let wrt = ["X", "W", "B"];
        let (fused_tg, fused) = gradients(&model, true, &wrt);
        let (plain_tg, plain) = gradients(&model, false, &wrt);
        assert_eq!(fused_nodes(&fused_tg, DEPTHWISE_CONV), 1);
        assert_eq!(
            fused_nodes(&fused_tg, DEPTHWISE_CONV_GRAD),
            1,
            "three gradients in one"
        );
        assert_eq!(fused_nodes(&plain_tg, DEPTHWISE_CONV), 0);
        let what = format!("kernel {kernel:?} strides {strides:?} pads {pads:?}");
        assert_same(&what, &fused, &plain, &["X", "W", "B", "loss"], 1e-5);
    }
    let mut r = Rng::new(31);
    let attrs = vec![
        ints_attr("pads", &[1, 2, 1, 0]),
        ints_attr("strides", &[2, 1]),
        int_attr("group", 3),
    ];
    let case = GradCheck::new(17)
        .param("X", r.tensor(DType::F32, &[2, 3, 7, 6], -2.0, 2.0))
        .param("W", r.tensor(DType::F32, &[3, 1, 3, 3], -1.0, 1.0))
        .param("B", r.tensor(DType::F32, &[3], -1.0, 1.0))
        .node("Conv", &["X", "W", "B"], &["Y"], attrs);
    check("depthwise Conv float32, fused", case, F32);
}
