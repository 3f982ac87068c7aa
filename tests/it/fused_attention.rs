//! pipetrain's fused attention (`Attention`, `AttentionGrad`): on the forms PyTorch
//! exports, against the standard-op graph it replaces and central finite differences;
//! masks that need a gradient stay standard ops.

use crate::common;

use crate::common::fused::{assert_same, fused_nodes, gradients, gradients_with};
use crate::common::gradcheck::{check, ints, GradCheck, Rng, F32};
use pipetrain::graph::custom_ops::{
    ATTENTION, ATTENTION_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD,
};
use pipetrain::graph::{attr_i, ints_attr, make_node, untyped_value_info, value_info};
use pipetrain::graph::{LossSpec, TrainingGraph, ValueMeta};
use pipetrain::onnx::proto::{ModelProto, NodeProto};
use pipetrain::tensor::{DType, Tensor};

/// Batch, heads, query tokens, key tokens, head size of q and k, head size of v.
const B: usize = 2;
const H: usize = 3;
const T: usize = 5;
const S: usize = 7;
const D: usize = 4;
const E: usize = 6;

/// A causal mask of `t` queries over `s` keys: 0 up to each query's place in the longer
/// sequence, `masked` after.
fn causal_mask(t: usize, s: usize, masked: f32) -> Tensor {
    let mut mask = vec![0f32; t * s];
    for i in 0..t {
        mask[i * s + i + s - t + 1..(i + 1) * s].fill(masked);
    }
    Tensor::f32(vec![t, s], mask).unwrap()
}

fn perm(p: [i64; 4]) -> Vec<pipetrain::onnx::proto::AttributeProto> {
    vec![ints_attr("perm", &p)]
}

/// The `mha` form's q, k^T and v for `[b, h, t, d, e]` (see [`model`]): its nodes and
/// initializers added.
fn mha_inputs(
    r: &mut Rng,
    [b, h, t, d, e]: [usize; 5],
    inits: &mut Vec<(&'static str, Tensor)>,
    nodes: &mut Vec<NodeProto>,
) -> (&'static str, &'static str, &'static str) {
    for (x, size) in [("Q", d), ("K", d), ("V", e)] {
        inits.push((x, r.tensor(DType::F32, &[t, b, h * size], -2.0, 2.0)));
        let merged = leak(format!("{x}_merged_shape"));
        let split = leak(format!("{x}_heads_shape"));
        inits.push((merged, ints(&[t, b * h, size].map(|v| v as i64))));
        inits.push((split, ints(&[b, h, t, size].map(|v| v as i64))));
        let (ra, tr, rb) = (format!("{x}_a"), format!("{x}_b"), format!("{x}_c"));
        let swap = vec![ints_attr("perm", &[1, 0, 2])];
        nodes.push(make_node("Reshape", &ra, &[x, merged], &[&ra], vec![]));
        nodes.push(make_node("Transpose", &tr, &[&ra], &[&tr], swap));
        nodes.push(make_node("Reshape", &rb, &[&tr, split], &[&rb], vec![]));
    }
    inits.push(("c", scalar(0.5)));
    nodes.push(make_node(
        "Transpose",
        "tk",
        &["K_c"],
        &["kt0"],
        perm([0, 1, 3, 2]),
    ));
    nodes.push(make_node("Mul", "sq", &["Q_c", "c"], &["q"], vec![]));
    nodes.push(make_node("Mul", "sk", &["c", "kt0"], &["kt"], vec![]));
    ("q", "kt", "V_c")
}

/// The `mha` form at `[b, h, t, d]` alone: q, k, v turned as torchvision's attention
/// turns them, the output `[t, b, h, d]`, `loss = sum(Y * R)`.
fn mha_model([b, h, t, d]: [usize; 4]) -> ModelProto {
    let (mut inits, mut nodes) = (Vec::new(), Vec::new());
    let mut r = Rng::new(43);
    let (q, kt, v) = mha_inputs(&mut r, [b, h, t, d, d], &mut inits, &mut nodes);
    nodes.push(make_node("MatMul", "qk", &[q, kt], &["scores"], vec![]));
    nodes.push(make_node("Softmax", "sm", &["scores"], &["p"], vec![]));
    nodes.push(make_node("MatMul", "pv", &["p", v], &["o"], vec![]));
    with_loss(nodes, inits, ([2, 0, 1, 3], [t, b, h, d]))
}

/// The model of `nodes` and `inits` whose attention output `o` is turned by `out_perm`
/// to `Y` (of `out_shape`), with `loss = sum(Y * R)`.
fn with_loss(
    mut nodes: Vec<NodeProto>,
    mut inits: Vec<(&'static str, Tensor)>,
    (out_perm, out_shape): ([i64; 4], [usize; 4]),
) -> ModelProto {
    nodes.push(make_node("Transpose", "to", &["o"], &["Y"], perm(out_perm)));
    inits.push(("R", Rng::new(37).tensor(DType::F32, &out_shape, -1.0, 1.0)));
    nodes.push(make_node("Mul", "m", &["Y", "R"], &["YR"], vec![]));
    nodes.push(make_node("ReduceSum", "s", &["YR"], &["total"], vec![]));
    common::opset17_model(
        "attention",
        nodes,
        inits.iter().map(|(n, t)| t.to_proto(n)).collect(),
        vec![],
        vec![untyped_value_info("total")],
    )
}

/// Heads of 128 x 64 x 128 multiply-adds run on the BLAS where the process has one
/// (`scripts/setup.sh` installs OpenBLAS), each matrix read row- or column-major in
/// place: the standard-op graph's loss and gradients.
#[test]
fn heads_large_enough_for_the_blas_give_the_standard_op_graphs_gradients() {
    let model = mha_model([2, 2, 128, 64]);
    let wrt = ["Q", "K", "V"];
    let (fused_tg, fused) = gradients(&model, true, &wrt);
    let (_, plain) = gradients(&model, false, &wrt);
    assert_eq!(fused_nodes(&fused_tg, ATTENTION), 1);
    assert_eq!(forward_ops(&fused_tg, "Transpose"), 0);
    let mut compared = vec!["loss"];
    compared.extend(wrt);
    // float32 sums of 64 and 128 terms in another order.
    assert_same("mha 128", &fused, &plain, &compared, 1e-5);
}

/// A name that lives as long as the test (the model's initializers are named by `&str`).
fn leak(name: String) -> &'static str {
    Box::leak(name.into_boxed_str())
}

fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v]).unwrap()
}

/// Query and key tokens of the causal forms: several row blocks of the kernel, the last
/// one short; and queries that see a prefix of 16 keys more.
const LONG: usize = 37;
const PREFIXED: usize = 21;

/// The exported forms, each with `loss = sum(Y * R)`:
/// - `gpt`: q, k, v as `[B, T, H, D]` turned by `Transpose`s, `* c`, a causal mask of
///   `-inf` (`[T, T]`), the output turned back to `[B, T, H, E]`; `prefixed`: the same
///   with more keys than queries, each query seeing the keys up to its own place in the
///   longer sequence (`-1e9` elsewhere);
/// - `bert`: cross-attention (`S` keys), `/ c`, a padding mask `[B, 1, 1, S]`, an
///   `Identity` (a dropout of ratio 0) after the softmax;
/// - `gpt_where`: `gpt` masked as Hugging Face's eager GPT-2 does, a `Cast` to float32
///   and `Where(causal, scores, finfo.min)` instead of an added mask;
/// - `vit`: `q`, `kt`, `v` made elsewhere (no transposes to take in), no scale, no mask,
///   the output turned to `[T, B, H, E]`;
/// - `mha`: torchvision's `nn.MultiheadAttention` (ViT): q, k, v `[T, B, H*D]`, each
///   reshaped to `[T, B*H, D]`, turned to `[B*H, T, D]` and reshaped to `[B, H, T, D]`, k
///   turned once more, q and k each multiplied by a constant, no mask, the output turned
///   to `[T, B, H, E]`.
pub(crate) fn model(form: &str) -> ModelProto {
    let mut r = Rng::new(31);
    let (t, s) = match form {
        "gpt" | "packed" | "gpt_where" => (LONG, LONG),
        "prefixed" => (PREFIXED, LONG),
        _ => (T, S),
    };
    let mut inits: Vec<(&'static str, Tensor)> = Vec::new();
    let mut nodes: Vec<NodeProto> = Vec::new();
    let (q, kt, v) = match form {
        "mha" => mha_inputs(&mut r, [B, H, T, D, E], &mut inits, &mut nodes),
        "vit" => {
            inits.push(("Q", r.tensor(DType::F32, &[B, H, t, D], -2.0, 2.0)));
            inits.push(("K", r.tensor(DType::F32, &[B, H, D, s], -2.0, 2.0)));
            inits.push(("V", r.tensor(DType::F32, &[B, H, s, E], -2.0, 2.0)));
            ("Q", "K", "V")
        }
        _ => {
            if form == "packed" {
                // One projection's output split into K, Q, V (in that order).
                let (c, shape) = (H * D, [B, t, H, D].map(|d| d as i64));
                inits.push(("QKV", r.tensor(DType::F32, &[B, t, 3 * c], -2.0, 2.0)));
                inits.push(("sizes", ints(&[c as i64; 3])));
                inits.push(("heads", ints(&shape)));
                let parts = ["Kp", "Qp", "Vp"];
                let axis = vec![pipetrain::graph::int_attr("axis", 2)];
                nodes.push(make_node("Split", "split", &["QKV", "sizes"], &parts, axis));
                for (part, x) in parts.iter().zip(["K", "Q", "V"]) {
                    let name = format!("reshape_{x}");
                    nodes.push(make_node("Reshape", &name, &[part, "heads"], &[x], vec![]));
                }
            } else {
                inits.push(("Q", r.tensor(DType::F32, &[B, t, H, D], -2.0, 2.0)));
                inits.push(("K", r.tensor(DType::F32, &[B, s, H, D], -2.0, 2.0)));
                inits.push(("V", r.tensor(DType::F32, &[B, s, H, E], -2.0, 2.0)));
            }
            nodes.push(make_node(
                "Transpose",
                "tq",
                &["Q"],
                &["q"],
                perm([0, 2, 1, 3]),
            ));
            nodes.push(make_node(
                "Transpose",
                "tk",
                &["K"],
                &["kt"],
                perm([0, 2, 3, 1]),
            ));
            nodes.push(make_node(
                "Transpose",
                "tv",
                &["V"],
                &["v"],
                perm([0, 2, 1, 3]),
            ));
            ("q", "kt", "v")
        }
    };
    nodes.push(make_node("MatMul", "qk", &[q, kt], &["scores"], vec![]));
    // The scale's op and value, the mask, and the order of the mask's addition.
    let masking = match form {
        "gpt" | "packed" => Some((
            "Mul",
            0.5,
            causal_mask(t, s, f32::NEG_INFINITY),
            ["scaled", "mask"],
        )),
        "prefixed" => Some(("Mul", 0.5, causal_mask(t, s, -1e9), ["scaled", "mask"])),
        "bert" => {
            let mut mask = vec![0f32; B * s];
            mask[s - 2..s].fill(-10000.0); // the first sequence's last two keys are padding
            let mask = Tensor::f32(vec![B, 1, 1, s], mask).unwrap();
            Some(("Div", 2.0, mask, ["mask", "scaled"]))
        }
        _ => None,
    };
    // Hugging Face's eager GPT-2: the scaled scores cast to float32 (a copy), then
    // `Where(causal, scores, finfo.min)`.
    if form == "gpt_where" {
        let open = causal_mask(t, s, -1.0)
            .to_f64_vec()
            .iter()
            .map(|&m| m == 0.0)
            .collect();
        inits.push(("c", scalar(0.5)));
        let open = Tensor::new(vec![1, 1, t, s], pipetrain::tensor::TensorData::Bool(open));
        inits.push(("open", open.unwrap()));
        inits.push(("fill", scalar(f32::MIN)));
        let to_float = vec![pipetrain::graph::int_attr("to", 1)];
        nodes.push(make_node(
            "Mul",
            "scale",
            &["scores", "c"],
            &["scaled"],
            vec![],
        ));
        nodes.push(make_node("Cast", "cast", &["scaled"], &["cast"], to_float));
        nodes.push(make_node(
            "Where",
            "where",
            &["open", "cast", "fill"],
            &["x"],
            vec![],
        ));
    }
    let softmax_in = match masking {
        _ if form == "gpt_where" => "x",
        Some((op, c, mask, add)) => {
            inits.push(("c", scalar(c)));
            inits.push(("mask", mask));
            nodes.push(make_node(
                op,
                "scale",
                &["scores", "c"],
                &["scaled"],
                vec![],
            ));
            nodes.push(make_node("Add", "masked", &add, &["x"], vec![]));
            "x"
        }
        None => "scores",
    };
    nodes.push(make_node("Softmax", "sm", &[softmax_in], &["p"], vec![]));
    let probs = if form == "bert" {
        nodes.push(make_node("Identity", "dropout", &["p"], &["pd"], vec![]));
        "pd"
    } else {
        "p"
    };
    nodes.push(make_node("MatMul", "pv", &[probs, v], &["o"], vec![]));
    let out = match form {
        "vit" | "mha" => ([2, 0, 1, 3], [t, B, H, E]),
        "packed" => ([0, 2, 1, 3], [B, t, H, D]),
        _ => ([0, 2, 1, 3], [B, t, H, E]),
    };
    with_loss(nodes, inits, out)
}

/// How many nodes of the training graph's forward are `op`.
fn forward_ops(tg: &TrainingGraph, op: &str) -> usize {
    let forward = &tg.graph.nodes[..tg.forward_len];
    forward.iter().filter(|n| n.op_type == op).count()
}

#[test]
fn fused_attention_gives_the_standard_op_graphs_loss_and_gradients() {
    // The nodes of each form the fused node replaces, whether its mask is causal (then
    // the kernel's own, not an input), and the operator (the packed one for a `Split`
    // projection: one input and one gradient for Q, K and V).
    let forms = [
        ("gpt", 9, true, ATTENTION),
        ("prefixed", 9, true, ATTENTION),
        ("bert", 10, false, ATTENTION),
        ("vit", 4, false, ATTENTION),
        ("mha", 9, false, ATTENTION),
        ("packed", 13, true, PACKED_ATTENTION),
        ("gpt_where", 10, true, ATTENTION),
    ];
    for (form, replaced, causal, op) in forms {
        let wrt: &[&str] = if op == ATTENTION {
            &["Q", "K", "V"]
        } else {
            &["QKV"]
        };
        let model = model(form);
        let (fused_tg, fused) = gradients(&model, true, wrt);
        let (plain_tg, plain) = gradients(&model, false, wrt);
        let grad_op = if op == ATTENTION {
            ATTENTION_GRAD
        } else {
            PACKED_ATTENTION_GRAD
        };
        assert_eq!(fused_nodes(&fused_tg, op), 1, "{form}");
        assert_eq!(fused_nodes(&fused_tg, grad_op), 1, "{form}");
        assert_eq!(fused_nodes(&plain_tg, op), 0, "{form}");
        // Every transpose around the products is read through strides (`mha`: its
        // inputs' reshapes to `[T, B, H, D]` stay, views; its constant factors are in the
        // node's scale).
        let reshapes = if form == "mha" { 3 } else { 0 };
        for (standard, left) in [
            ("Transpose", 0),
            ("MatMul", 0),
            ("Softmax", 0),
            ("Split", 0),
            ("Reshape", reshapes),
            ("Mul", 1),
        ] {
            assert_eq!(
                forward_ops(&fused_tg, standard),
                left,
                "{form}: {standard}s left"
            );
        }
        assert_eq!(
            fused_tg.forward_len + replaced - 1,
            plain_tg.forward_len,
            "{form}"
        );
        let node = fused_tg
            .graph
            .nodes
            .iter()
            .find(|n| n.op_type == op)
            .unwrap();
        assert_eq!(attr_i(node, "causal"), Some(i64::from(causal)), "{form}");
        let masked = !["vit", "mha"].contains(&form) && !causal;
        let parts = if op == ATTENTION { 3 } else { 1 };
        assert_eq!(node.input.len(), parts + usize::from(masked), "{form}");
        let mut compared = vec!["loss"];
        compared.extend(wrt);
        // float32 sums of up to 37 terms in another order.
        assert_same(form, &fused, &plain, &compared, 4e-6);
    }
}

/// Tokens of the finite-difference checks: two row blocks of the causal kernel.
const N: usize = 20;

/// The `gpt` form's nodes after `Q`, `K`, `V` (`[B, N, H, D]`, V `[B, N, H, E]`), for a
/// finite-difference check.
fn gpt_nodes(case: GradCheck) -> GradCheck {
    case.constant("c", scalar(0.5))
        .constant("mask", causal_mask(N, N, f32::NEG_INFINITY))
        .node("Transpose", &["Q"], &["q"], perm([0, 2, 1, 3]))
        .node("Transpose", &["K"], &["kt"], perm([0, 2, 3, 1]))
        .node("Transpose", &["V"], &["v"], perm([0, 2, 1, 3]))
        .node("MatMul", &["q", "kt"], &["scores"], vec![])
        .node("Mul", &["scores", "c"], &["scaled"], vec![])
        .node("Add", &["scaled", "mask"], &["x"], vec![])
        .node("Softmax", &["x"], &["p"], vec![])
        .node("MatMul", &["p", "v"], &["o"], vec![])
        .node("Transpose", &["o"], &["Y"], perm([0, 2, 1, 3]))
}

#[test]
fn fused_attention_matches_finite_differences() {
    let mut r = Rng::new(41);
    let case = GradCheck::new(17)
        .param("Q", r.tensor(DType::F32, &[B, N, H, D], -1.0, 1.0))
        .param("K", r.tensor(DType::F32, &[B, N, H, D], -1.0, 1.0))
        .param("V", r.tensor(DType::F32, &[B, N, H, E], -1.0, 1.0));
    check("attention float32, fused", gpt_nodes(case), F32);
    // The packed form: one projection's output split into V, Q, K.
    let c = H * D;
    let case = GradCheck::new(17)
        .param("QKV", r.tensor(DType::F32, &[B, N, 3 * c], -1.0, 1.0))
        .constant("sizes", ints(&[c as i64; 3]))
        .constant("heads", ints(&[B, N, H, D].map(|d| d as i64)))
        .node(
            "Split",
            &["QKV", "sizes"],
            &["vp", "qp", "kp"],
            vec![pipetrain::graph::int_attr("axis", -1)],
        )
        .node("Reshape", &["qp", "heads"], &["Q"], vec![])
        .node("Reshape", &["kp", "heads"], &["K"], vec![])
        .node("Reshape", &["vp", "heads"], &["V"], vec![]);
    check("packed attention float32, fused", gpt_nodes(case), F32);
}

#[test]
fn a_mask_that_needs_a_gradient_stays_standard_ops() {
    // An additive bias that is trained (a learned relative position bias).
    let mut model = model("gpt");
    let g = model.graph.as_mut().unwrap();
    let bias = Rng::new(47).tensor(DType::F32, &[LONG, LONG], -1.0, 1.0);
    g.initializer.push(bias.to_proto("bias"));
    let add = g.node.iter_mut().find(|n| n.name == "masked").unwrap();
    add.input[1] = "bias".into();
    let wrt = ["Q", "K", "V", "bias"];
    let (fused_tg, fused) = gradients(&model, true, &wrt);
    let (_, plain) = gradients(&model, false, &wrt);
    assert_eq!(fused_nodes(&fused_tg, ATTENTION), 0);
    assert_same(
        "trained mask",
        &fused,
        &plain,
        &["loss", "Q", "K", "V", "bias"],
        1e-6,
    );
}

#[test]
fn the_causal_kernel_gives_the_masked_kernels_bits() {
    // The same causal mask as data (the kernel adds it) and as a constant (the kernel's
    // own causal mask, skipping what no query sees): the same loss and gradients, bit for
    // bit, over several row blocks, with and without a key prefix.
    let wrt = ["Q", "K", "V"];
    for form in ["gpt", "prefixed"] {
        let constant = model(form);
        let mut fed = constant.clone();
        let g = fed.graph.as_mut().unwrap();
        let at = g.initializer.iter().position(|t| t.name == "mask").unwrap();
        let mask = Tensor::from_proto(&g.initializer.remove(at)).unwrap();
        let meta = ValueMeta {
            dtype: DType::F32,
            shape: mask.shape.clone(),
        };
        g.input.push(value_info("mask", &meta));
        let loss = || LossSpec::Output {
            name: "total".into(),
        };
        let (causal_tg, causal) = gradients_with(&constant, loss(), &[], true, &wrt);
        let (masked_tg, masked) = gradients_with(&fed, loss(), &[("mask", &mask)], true, &wrt);
        let node = |tg: &TrainingGraph| {
            let n = tg
                .graph
                .nodes
                .iter()
                .find(|n| n.op_type == ATTENTION)
                .unwrap();
            (attr_i(n, "causal"), n.input.len())
        };
        assert_eq!(node(&causal_tg), (Some(1), 3), "{form}");
        assert_eq!(node(&masked_tg), (Some(0), 4), "{form}");
        for name in ["loss", "Q", "K", "V"] {
            let (a, b) = (causal[name].to_f64_vec(), masked[name].to_f64_vec());
            assert!(a == b, "{form}: {name} differs");
        }
    }
}
