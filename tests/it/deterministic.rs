//! Embedding gradients in a fixed order: on the CPU, the scatter a lookup's gradient is
//! written as adds in the same order on any thread count; on a GPU
//! (`graph::scatter_adds_as_products`) the rewritten training graph gives the scattered
//! graph's gradient bit for bit where the sums are exact, with every scatter of a lookup
//! table gone.

use crate::common;

use pipetrain::compute::{SessionOptions, TensorMap, TrainSession};
use pipetrain::graph::{
    assign_stages, build_stage_graphs, build_training_graph, make_node, row_sums_as_products,
    rows_add_reference, scatter_adds_as_products, scatter_adds_as_rows_add, untyped_value_info,
    value_info, BalanceBy, LossSpec, Partition, TrainOptions, ValueMeta,
};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::{DType, Tensor};

/// `total = sum(Gather(W, ids) * R)`, `ids` an int64 input of shape `ids_shape`.
fn gather_model(name: &str, w: Tensor, r: Tensor, ids_shape: Vec<usize>) -> ModelProto {
    let nodes = vec![
        make_node("Gather", "g", &["W", "ids"], &["Y"], vec![]),
        make_node("Mul", "m", &["Y", "R"], &["YR"], vec![]),
        make_node("ReduceSum", "s", &["YR"], &["total"], vec![]),
    ];
    let ids_meta = ValueMeta {
        dtype: DType::I64,
        shape: ids_shape,
    };
    common::opset17_model(
        name,
        nodes,
        vec![w.to_proto("W"), r.to_proto("R")],
        vec![value_info("ids", &ids_meta)],
        vec![untyped_value_info("total")],
    )
}

/// Training options that differentiate `total` with respect to `W`, standard ops only.
fn options() -> TrainOptions {
    TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::Output {
            name: "total".into(),
        },
        trainable: Some(vec!["W".into()]),
        contrib_ops: false,
        fused_kernels: false,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    }
}

/// [`gather_model`] with a table `W [rows, 3, 2]`, `ids [2, 5]` (repeats, and a negative
/// index), `R` multiples of 1/8 so every sum is exact.
fn lookup_model(rows: usize) -> (ModelProto, Tensor) {
    let w: Vec<f32> = (0..rows * 6).map(|i| (i % 7) as f32 * 0.25).collect();
    let r: Vec<f32> = (0..60).map(|i| ((i * 5) % 11) as f32 / 8.0 - 0.5).collect();
    let ids = Tensor::i64(vec![2, 5], vec![1, 3, 1, 0, -1, 3, 3, 2, 1, 1]).unwrap();
    let w = Tensor::f32(vec![rows, 3, 2], w).unwrap();
    let r = Tensor::f32(vec![2, 5, 3, 2], r).unwrap();
    (gather_model("lookup", w, r, vec![2, 5]), ids)
}

#[test]
fn one_hot_products_give_the_scattered_embedding_gradient_bit_for_bit() {
    let rt = common::runtime();
    let (model, ids) = lookup_model(6);
    let feeds = [("ids", &ids)];
    let opts = options();
    let tg = build_training_graph(&rt, &model, &opts, &feeds).unwrap();
    let scatters = |g: &pipetrain::graph::Graph| {
        g.nodes
            .iter()
            .filter(|n| n.op_type == "ScatterElements")
            .count()
    };
    assert_eq!(scatters(&tg.graph), 1);
    let mut fixed = tg.clone();
    assert_eq!(scatters_rewritten(&mut fixed), 1);
    assert_eq!(scatters(&fixed.graph), 0);

    let data: TensorMap = [("ids".to_string(), ids.clone())].into();
    let params = common::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let grad = |tg: &pipetrain::graph::TrainingGraph| {
        let mut s = TrainSession::new(&rt, tg, &SessionOptions::default()).unwrap();
        s.step(&params, &data, &seed).unwrap().grads["W"].to_f64_vec()
    };
    let (scattered, product) = (grad(&tg), grad(&fixed));
    assert_eq!(scattered, product);
    // Row 1 is looked up four times, row 5 once (as -1), row 4 never.
    let row = |g: &[f64], k: usize| g[6 * k..6 * k + 6].to_vec();
    assert!(row(&product, 1).iter().any(|&v| v != 0.0));
    assert!(row(&product, 5).iter().any(|&v| v != 0.0));
    assert!(row(&product, 4).iter().all(|&v| v == 0.0));
}

fn scatters_rewritten(tg: &mut pipetrain::graph::TrainingGraph) -> usize {
    scatter_adds_as_products(&mut tg.graph)
}

/// [`gather_model`] with `W [2, 768]` and all 1,024 `ids` 0 (BERT's token-type lookup:
/// every token reads row 0), `R` random.
fn one_row_model() -> (ModelProto, Tensor) {
    let mut rng = 7u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let r: Vec<f32> = (0..1024 * 768).map(|_| next()).collect();
    let w = Tensor::f32(vec![2, 768], vec![0.5; 2 * 768]).unwrap();
    let r = Tensor::f32(vec![8, 128, 768], r).unwrap();
    let model = gather_model("one_row", w, r, vec![8, 128]);
    (model, Tensor::i64(vec![8, 128], vec![0; 1024]).unwrap())
}

#[test]
fn a_row_read_by_every_token_gets_the_same_gradient_on_any_thread_count() {
    // ONNX Runtime's CPU ScatterND adds index slices on several threads without atomics:
    // on two threads this gradient lost additions in some runs (BERT's token types).
    let rt = common::runtime();
    let (model, ids) = one_row_model();
    let opts = options();
    let tg = build_training_graph(&rt, &model, &opts, &[("ids", &ids)]).unwrap();
    assert!(tg.graph.nodes.iter().all(|n| n.op_type != "ScatterND"));
    let data: TensorMap = [("ids".to_string(), ids.clone())].into();
    let params = common::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let grads = |threads: usize, runs: usize| {
        let opts = SessionOptions {
            intra_threads: threads,
            ..SessionOptions::default()
        };
        let mut s = TrainSession::new(&rt, &tg, &opts).unwrap();
        (0..runs)
            .map(|_| s.step(&params, &data, &seed).unwrap().grads["W"].to_f64_vec())
            .collect::<Vec<_>>()
    };
    let one = grads(1, 1).remove(0);
    // Row 0 holds each column's sum over the 1,024 tokens (float64 for reference).
    let r = model.graph.as_ref().unwrap().initializer[1].clone();
    let r = Tensor::from_proto(&r).unwrap().to_f64_vec();
    for c in [0, 383, 767] {
        let exact: f64 = (0..1024).map(|t| r[t * 768 + c]).sum();
        assert!(
            (one[c] - exact).abs() < 1e-3,
            "column {c}: {} vs {exact}",
            one[c]
        );
    }
    assert!(one[768..].iter().all(|&v| v == 0.0));
    for (i, g) in grads(2, 16).into_iter().enumerate() {
        assert!(
            g == one,
            "run {i} on two threads differs from one thread's sums"
        );
    }
}

/// `RowsAdd` (the GPU's embedding gradient, `compute/cuda_ops.rs`) as its Rust formula
/// gives ONNX Runtime's CPU scatter bit for bit, on random updates whose sums are not
/// exact (so only the same order of additions gives the same bits); the rewrite leaves
/// one `RowsAdd` of pipetrain's domain where the scatter was.
#[test]
fn rows_add_is_the_cpu_scatter_bit_for_bit_and_replaces_it() {
    let rt = common::runtime();
    let mut rng = 11u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    let (rows, n, width) = (37usize, 600usize, 24usize);
    let ids: Vec<i64> = (0..n)
        .map(|_| (next() % 12) as i64 - 2) // rows -2..9: repeats, two counted from the end
        .collect();
    let r: Vec<f32> = (0..n * width)
        .map(|_| (next() % 1_000_003) as f32 / 1_000_003.0 - 0.5)
        .collect();
    let w = Tensor::f32(vec![rows, width], vec![0.25; rows * width]).unwrap();
    let model = gather_model(
        "rows_add",
        w,
        Tensor::f32(vec![n, width], r.clone()).unwrap(),
        vec![n],
    );
    let ids = Tensor::i64(vec![n], ids.clone()).unwrap();
    let tg = build_training_graph(&rt, &model, &options(), &[("ids", &ids)]).unwrap();
    let data: TensorMap = [("ids".to_string(), ids.clone())].into();
    let params = common::initial_params(&tg);
    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let mut s = TrainSession::new(&rt, &tg, &SessionOptions::default()).unwrap();
    let scattered = s.step(&params, &data, &seed).unwrap().grads["W"].clone();
    let reference = rows_add_reference(ids.as_i64().unwrap(), &r, rows);
    assert!(reference.iter().any(|&v| v != 0.0) && reference[2 * width..3 * width] != [0.0; 24]);
    assert!(
        scattered.as_f32().unwrap() == reference.as_slice(),
        "not bitwise the CPU scatter"
    );

    let mut rewritten = tg.graph.clone();
    assert_eq!(scatter_adds_as_rows_add(&mut rewritten), 1);
    let ops: Vec<_> = rewritten
        .nodes
        .iter()
        .map(|n| (n.op_type.as_str(), n.domain.as_str()))
        .collect();
    assert!(
        ops.contains(&("RowsAdd", "ai.pipetrain")) && !ops.iter().any(|o| o.0 == "ScatterElements")
    );
    assert!(rewritten
        .to_model()
        .opset_import
        .iter()
        .any(|o| o.domain == "ai.pipetrain"));
}

/// The GPU's row sums (`graph::row_sums_as_products`): on the peers' tiny GPT (a
/// torch.onnx export) every float32 sum or mean over the last axis of the standard-op
/// training graph (LayerNorm's and softmax's backward) becomes a product with a constant
/// vector, none is left, the graph still cuts into stages, and its loss and gradients on
/// ONNX Runtime's CPU are the reduction graph's within float32 reassociation.
#[test]
fn row_sums_as_products_give_the_reductions_gradients() {
    let rt = common::runtime();
    let peer = common::PeerModel::load("tiny_gpt");
    let mut opts = peer.options();
    opts.fused_kernels = false; // the standard-op graph a GPU runs
    let batch = peer.batch(0);
    let model = peer.model_with_init();
    let tg = build_training_graph(&rt, &model, &opts, &common::PeerModel::example(&batch)).unwrap();
    let reductions = |tg: &pipetrain::graph::TrainingGraph| {
        let ops = tg.graph.nodes.iter().map(|n| n.op_type.as_str());
        ops.filter(|o| matches!(*o, "ReduceSum" | "ReduceMean"))
            .count()
    };
    let mut rows = tg.clone();
    let n = row_sums_as_products(&mut rows);
    assert!(n >= 6, "only {n} row sums rewritten");
    assert_eq!(reductions(&rows) + n, reductions(&tg));
    assert_eq!(
        row_sums_as_products(&mut rows.clone()),
        0,
        "a last-axis sum is left"
    );
    let two = Partition::Balanced {
        stages: 2,
        by: BalanceBy::Params,
    };
    build_stage_graphs(&rows, &assign_stages(&rows, &two).unwrap()).unwrap();

    let seed = Tensor::f32(vec![], vec![1.0]).unwrap();
    let step = |tg: &pipetrain::graph::TrainingGraph| {
        let mut s = TrainSession::new(&rt, tg, &SessionOptions::default()).unwrap();
        s.step(&common::initial_params(tg), &batch, &seed).unwrap()
    };
    let (a, b) = (step(&tg), step(&rows));
    assert!(
        (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs(),
        "{} {}",
        a.loss,
        b.loss
    );
    for (name, ga) in &a.grads {
        let (ga, gb) = (ga.as_f32().unwrap(), b.grads[name].as_f32().unwrap());
        let scale = ga.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = ga
            .iter()
            .zip(gb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            scale > 0.0 && worst <= 2e-5 * scale,
            "{name}: {worst} of {scale}"
        );
    }
}
