//! The shape probe (`compute::probe_values`) measures every value of a graph from one
//! profiled run: each node output's element type and shape equals what ONNX Runtime
//! returns when that value is made a graph output and the graph is run.

mod common;

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
