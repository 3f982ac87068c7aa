//! The shape probe (`compute::probe_values`) measures every value of a graph from one
//! profiled run: each node output's element type and shape equals what ONNX Runtime
//! returns when that value is made a graph output and the graph is run.

use crate::common;

use pipetrain::compute::{probe_values, GraphSession, SessionOptions};
use pipetrain::graph::{untyped_value_info, Graph};
use pipetrain::models::{build, Gpt2Config, ModelSpec};
use pipetrain::tensor::Tensor;

#[test]
fn every_value_of_gpt2_has_the_type_and_shape_a_run_returns() {
    let rt = common::runtime();
    let cfg = Gpt2Config {
        layers: 2,
        heads: 2,
        ..Default::default()
    };
    let graph = Graph::from_model(&build(&ModelSpec::Gpt2(cfg.clone())).unwrap()).unwrap();
    let (b, t) = (3, cfg.seq);
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7 % cfg.vocab) as i64).collect();
    let tokens = Tensor::i64(vec![b, t], ids).unwrap();
    let feeds = [("tokens", &tokens)];
    let metas = probe_values(&rt, &graph, &feeds).unwrap();

    let names: Vec<String> = graph.nodes.iter().flat_map(|n| n.output.clone()).collect();
    let mut exposed = graph.clone();
    exposed.outputs = names.iter().map(|n| untyped_value_info(n)).collect();
    let mut session =
        GraphSession::new(&rt, &exposed, &SessionOptions::default(), "all values").unwrap();
    let values = session.run(&feeds).unwrap();
    assert!(names.len() > 80, "{} values", names.len());
    for (name, value) in names.iter().zip(&values) {
        let meta = metas
            .get(name)
            .unwrap_or_else(|| panic!("{name} not probed"));
        assert_eq!(meta.dtype, value.dtype(), "{name}");
        assert_eq!(meta.shape, value.shape, "{name}");
    }
    // The batch of 3 is in the shapes (not a default or a symbolic dimension).
    assert_eq!(metas["logits"].shape, vec![b * t, cfg.vocab]);
}

/// With the loss attached, the training graph's shapes come from probing the loss's
/// nodes alone (`graph/loss_metas.rs`): the same metas and the same training graph as
/// probing the whole graph again, the way it was done before.
#[test]
fn the_loss_alone_measures_what_the_whole_graph_does() {
    use pipetrain::graph::{
        build_training_graph, LossNormalize, LossSpec, Metas, ShapeProbe, TrainOptions,
    };
    use std::cell::RefCell;

    /// ONNX Runtime's probe, noting each probed graph's node count; with `whole_only` it
    /// refuses graphs without the model's first node (the loss alone), as a probe that
    /// can only measure whole models would, so the builder falls back to the whole graph.
    struct Probe<'a> {
        rt: &'a pipetrain::compute::Runtime,
        first: String,
        whole_only: bool,
        sizes: RefCell<Vec<usize>>,
    }
    impl ShapeProbe for Probe<'_> {
        fn probe(&self, g: &Graph, feeds: &[(&str, &Tensor)]) -> pipetrain::Result<Metas> {
            self.sizes.borrow_mut().push(g.nodes.len());
            if self.whole_only && !g.nodes.iter().any(|n| n.name == self.first) {
                return Err(pipetrain::Error::InvalidGraph {
                    reason: "whole models only".into(),
                });
            }
            self.rt.probe(g, feeds)
        }
    }

    let rt = common::runtime();
    let cfg = Gpt2Config {
        layers: 2,
        heads: 2,
        ..Default::default()
    };
    let model = build(&ModelSpec::Gpt2(cfg.clone())).unwrap();
    let first = model.graph.as_ref().unwrap().node[0].name.clone();
    let (b, t) = (2, cfg.seq);
    let ids = |k: usize| {
        (0..b * t)
            .map(|i| ((i * k + 3) % cfg.vocab) as i64)
            .collect()
    };
    let tokens = Tensor::i64(vec![b, t], ids(7)).unwrap();
    let targets = Tensor::i64(vec![b, t], ids(5)).unwrap();
    let example = [("tokens", &tokens), ("targets", &targets)];
    let opts = TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::SoftmaxCrossEntropy {
            prediction: "logits".into(),
            label: "targets".into(),
            ignore_index: None,
            class_axis: None,
            normalize: LossNormalize::MicroBatch,
        },
        trainable: None,
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    };
    let probe = |whole_only| Probe {
        rt: &rt,
        first: first.clone(),
        whole_only,
        sizes: RefCell::new(Vec::new()),
    };
    let (fast, whole) = (probe(false), probe(true));
    let a = build_training_graph(&fast, &model, &opts, &example).unwrap();
    let b = build_training_graph(&whole, &model, &opts, &example).unwrap();
    assert_eq!(a.metas, b.metas);
    assert!(a.graph.to_model() == b.graph.to_model());
    // The fast build probed a small graph (the loss) where the other probed it all.
    let (fast, whole) = (fast.sizes.into_inner(), whole.sizes.into_inner());
    let forward = model.graph.as_ref().unwrap().node.len();
    assert!(fast.iter().any(|&n| n < forward / 4), "{fast:?}");
    assert!(
        whole.iter().filter(|&&n| n >= forward).count() >= 2,
        "{whole:?}"
    );
}

/// The step's work per node (what picks ONNX Runtime's threads): for the built-in MLP,
/// three products a layer (forward, the inputs' gradient, the weights' gradient; the
/// estimate counts the first layer's input gradient too, which the backward skips) and
/// about one operation per value of the other forward nodes, over the step's nodes.
#[test]
fn work_per_node_is_the_steps_products_over_its_nodes() {
    use pipetrain::graph::{build_training_graph, flops_per_node, LossSpec, TrainOptions};
    use pipetrain::models::MlpConfig;

    let rt = common::runtime();
    let cfg = MlpConfig {
        inputs: 96,
        hidden: vec![128, 64],
        classes: 10,
        ..Default::default()
    };
    let model = build(&ModelSpec::Mlp(cfg)).unwrap();
    let b = 32;
    let x = Tensor::f32(vec![b, 96], vec![0.5; b * 96]).unwrap();
    let y = Tensor::i64(vec![b], (0..b as i64).map(|i| i % 10).collect()).unwrap();
    let opts = TrainOptions {
        inputs: Default::default(),
        loss: LossSpec::SoftmaxCrossEntropy {
            prediction: "logits".into(),
            label: "y".into(),
            ignore_index: None,
            class_axis: None,
            normalize: Default::default(),
        },
        trainable: None,
        contrib_ops: false,
        fused_kernels: false,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: Default::default(),
    };
    let tg = build_training_graph(&rt, &model, &opts, &[("x", &x), ("y", &y)]).unwrap();
    let products = 3.0 * 2.0 * (b * (96 * 128 + 128 * 64 + 64 * 10)) as f64;
    let nodes = tg.graph.nodes.len() as f64;
    let work = flops_per_node(&tg) * nodes;
    // At least the products (every node counted), at most them and a few operations per
    // value of the step's activations, over the nodes that compute.
    assert!(work >= products, "{work} < {products}");
    assert!(work <= 1.2 * products, "{work} > 1.2 x {products}");
}

/// A graph ONNX Runtime cannot make a session for (no CPU kernel for `Asin` on
/// float64) fails the probe with an error and leaves none of the probe's profile files
/// in the temporary folder: ONNX Runtime writes one even for a session it failed to
/// create, and 451 had piled up there from the test suite.
#[test]
fn a_probe_that_fails_leaves_no_profile_behind() {
    use pipetrain::graph::{make_node, value_info, ValueMeta};
    use pipetrain::tensor::DType;
    let rt = common::runtime();
    let asin = |dtype| {
        let meta = ValueMeta {
            dtype,
            shape: vec![2, 2],
        };
        let model = common::opset17_model(
            "asin",
            vec![make_node("Asin", "n0", &["x"], &["y"], vec![])],
            vec![],
            vec![value_info("x", &meta)],
            vec![untyped_value_info("y")],
        );
        Graph::from_model(&model).unwrap()
    };
    // This thread's probes name their files after the process and the thread.
    let ours = format!(
        "pipetrain-probe-{}-{:?}-",
        std::process::id(),
        std::thread::current().id()
    );
    let left = || {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&ours))
            .count()
    };
    let x = Tensor::f64(vec![2, 2], vec![0.1, 0.2, 0.3, 0.4]).unwrap();
    let err = probe_values(&rt, &asin(DType::F64), &[("x", &x)]).unwrap_err();
    assert!(err.to_string().contains("Asin"), "{err}");
    assert_eq!(left(), 0);
    // A probe that runs removes its profile too.
    let x = Tensor::f32(vec![2, 2], vec![0.1, 0.2, 0.3, 0.4]).unwrap();
    probe_values(&rt, &asin(DType::F32), &[("x", &x)]).unwrap();
    assert_eq!(left(), 0);
}
