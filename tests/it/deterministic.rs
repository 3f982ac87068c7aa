//! Embedding gradients in a fixed order (`graph::scatter_adds_as_products`, what a GPU
//! session computes): the rewritten training graph gives the scattered graph's gradient
//! bit for bit where the sums are exact, with every scatter of a lookup table gone.

use crate::common;

use pipetrain::compute::{SessionOptions, TensorMap, TrainSession};
use pipetrain::graph::{
    build_training_graph, make_node, scatter_adds_as_products, untyped_value_info, value_info,
    LossSpec, TrainOptions, ValueMeta,
};
use pipetrain::onnx::proto::ModelProto;
use pipetrain::tensor::{DType, Tensor};

/// `total = sum(Gather(W, ids) * R)` with a table `W [rows, 3, 2]`, `ids [2, 5]` int64
/// (repeats, and a negative index), `R` multiples of 1/8 so every sum is exact.
fn lookup_model(rows: usize) -> (ModelProto, Tensor) {
    let w: Vec<f32> = (0..rows * 6).map(|i| (i % 7) as f32 * 0.25).collect();
    let r: Vec<f32> = (0..60).map(|i| ((i * 5) % 11) as f32 / 8.0 - 0.5).collect();
    let ids = Tensor::i64(vec![2, 5], vec![1, 3, 1, 0, -1, 3, 3, 2, 1, 1]).unwrap();
    let nodes = vec![
        make_node("Gather", "g", &["W", "ids"], &["Y"], vec![]),
        make_node("Mul", "m", &["Y", "R"], &["YR"], vec![]),
        make_node("ReduceSum", "s", &["YR"], &["total"], vec![]),
    ];
    let inits = [
        Tensor::f32(vec![rows, 3, 2], w).unwrap().to_proto("W"),
        Tensor::f32(vec![2, 5, 3, 2], r).unwrap().to_proto("R"),
    ];
    let ids_meta = ValueMeta {
        dtype: DType::I64,
        shape: vec![2, 5],
    };
    let model = common::opset17_model(
        "lookup",
        nodes,
        inits.to_vec(),
        vec![value_info("ids", &ids_meta)],
        vec![untyped_value_info("total")],
    );
    (model, ids)
}

#[test]
fn one_hot_products_give_the_scattered_embedding_gradient_bit_for_bit() {
    let rt = common::runtime();
    let (model, ids) = lookup_model(6);
    let feeds = [("ids", &ids)];
    let opts = TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::Output {
            name: "total".into(),
        },
        trainable: Some(vec!["W".into()]),
        contrib_ops: false,
        fused_kernels: false,
        params: Default::default(),
    };
    let tg = build_training_graph(&rt, &model, &opts, &feeds).unwrap();
    let scatters =
        |g: &pipetrain::graph::Graph| g.nodes.iter().filter(|n| n.op_type == "ScatterND").count();
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
