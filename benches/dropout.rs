//! A training-mode dropout's forward: pipetrain's `KeyedDropout` (`compute/fused/dropout.rs`,
//! what `pipetrain train` runs on the CPU) against ONNX Runtime's `Dropout`, each one node
//! of its own session over a BERT-base activation (`[8, 128, 768]`, ratio 0.1), at one and
//! two intra-op threads. Windows of 10 runs alternate between the two (15 rounds); the
//! table gives each one's median time and the median of the per-round ratios.
//!
//! `cargo bench --bench dropout`

use pipetrain::compute::{GraphSession, Runtime, SessionOptions};
use pipetrain::graph::custom_ops::{DOMAIN, KEYED_DROPOUT};
use pipetrain::graph::{int_attr, make_node, value_info, Graph, ValueMeta, DROPOUT_KEY};
use pipetrain::onnx::proto::{GraphProto, ModelProto, OperatorSetIdProto};
use pipetrain::tensor::{DType, Tensor, TensorData};

const SHAPE: [usize; 3] = [8, 128, 768];
const ROUNDS: usize = 15;
const RUNS: usize = 10;

/// One dropout node over `X` (`keyed`: pipetrain's, reading the key), `y` and `mask` out.
fn graph(keyed: bool) -> Graph {
    let ratio = Tensor::f32(vec![], vec![0.1]).unwrap();
    let training = Tensor::new(vec![], TensorData::Bool(vec![true])).unwrap();
    let (node, mut inputs) = match keyed {
        true => {
            let salt = vec![int_attr("salt", 3)];
            let inputs = ["X", "ratio", DROPOUT_KEY];
            let mut n = make_node(KEYED_DROPOUT, "d", &inputs, &["y", "mask"], salt);
            n.domain = DOMAIN.into();
            (n, vec![])
        }
        false => {
            let inputs = ["X", "ratio", "training"];
            (
                make_node("Dropout", "d", &inputs, &["y", "mask"], vec![]),
                vec![],
            )
        }
    };
    inputs.push(value_info("X", &ValueMeta::f32(&SHAPE)));
    if keyed {
        let key = ValueMeta {
            dtype: DType::I64,
            shape: vec![4],
        };
        inputs.push(value_info(DROPOUT_KEY, &key));
    }
    let outputs = ["y", "mask"]
        .map(pipetrain::graph::untyped_value_info)
        .to_vec();
    let mut opsets = vec![OperatorSetIdProto {
        domain: String::new(),
        version: 17,
    }];
    if keyed {
        opsets.push(OperatorSetIdProto {
            domain: DOMAIN.into(),
            version: 1,
        });
    }
    let model = ModelProto {
        ir_version: 8,
        opset_import: opsets,
        graph: Some(GraphProto {
            name: "dropout".into(),
            node: vec![node],
            initializer: vec![ratio.to_proto("ratio"), training.to_proto("training")],
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    };
    Graph::from_model(&model).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rt = Runtime::from_env().expect("ONNX Runtime: run `bash scripts/setup.sh` first");
    let n: usize = SHAPE.iter().product();
    let values = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = Tensor::f32(SHAPE.to_vec(), values).unwrap();
    let key = Tensor::i64(vec![4], vec![0, 1, 0, 0]).unwrap();
    println!("threads  onnx runtime ms  keyed ms  keyed/onnx runtime (median of rounds)");
    for threads in [1, 2] {
        let opts = SessionOptions {
            intra_threads: threads,
            ..SessionOptions::default()
        };
        let mut ort = GraphSession::new(&rt, &graph(false), &opts, "ort").unwrap();
        let mut keyed = GraphSession::new(&rt, &graph(true), &opts, "keyed").unwrap();
        let (mut a, mut b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = std::time::Instant::now();
            for _ in 0..RUNS {
                ort.run(&[("X", &x)]).unwrap();
            }
            let theirs = t.elapsed().as_secs_f64() / RUNS as f64;
            let t = std::time::Instant::now();
            for _ in 0..RUNS {
                keyed.run(&[("X", &x), (DROPOUT_KEY, &key)]).unwrap();
            }
            let ours = t.elapsed().as_secs_f64() / RUNS as f64;
            a.push(theirs);
            b.push(ours);
            ratios.push(ours / theirs);
        }
        println!(
            "{threads:>7}  {:>15.3}  {:>8.3}  {:.2}",
            median(a) * 1e3,
            median(b) * 1e3,
            median(ratios)
        );
    }
}
