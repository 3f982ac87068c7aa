//! Float32 matrix products on the CPU: ONNX Runtime's own (MLAS, `FusedMatMul`) against
//! pipetrain's `BlasMatMul` (OpenBLAS, `compute/blas`), each a one-node session on
//! the machine's intra-op threads (2 here), at the shapes of a 512- or 1024-token step of
//! GPT-2 small and BERT-base, the three forms a training step has: `X W` (forward, input
//! gradients), `X^T dY` (weight gradients) and `X W^T` (a `torch.nn.Linear`). Alternating
//! windows of each, GFLOP/s and the ratio per shape (median of the windows' ratios).
//! Where the ratio is below 1, `graph/fusion/products.rs` leaves the product to MLAS.
//!
//! `cargo bench --bench products` (needs `scripts/setup.sh`'s scipy-openblas32)

use std::time::Instant;

use pipetrain::compute::{GraphSession, Runtime, SessionOptions};
use pipetrain::graph::{float_attr, int_attr, make_node, untyped_value_info, value_info};
use pipetrain::graph::{Graph, ValueMeta};
use pipetrain::tensor::{DType, Tensor};

const WINDOWS: usize = 5;

/// A session of one product `op` (domain, type) with `attrs`, of inputs shaped `a`, `b`.
fn session(
    rt: &Runtime,
    op: (&str, &str),
    attrs: (bool, bool),
    a: &[usize],
    b: &[usize],
) -> GraphSession {
    let mut g = Graph {
        name: "product".into(),
        ..Default::default()
    };
    for (domain, version) in [("", 17), ("com.microsoft", 1), ("ai.pipetrain", 1)] {
        g.import_domain(domain, version);
    }
    let flags = vec![
        int_attr("transA", i64::from(attrs.0)),
        int_attr("transB", i64::from(attrs.1)),
        float_attr("alpha", 1.0),
    ];
    let mut node = make_node(op.1, "p", &["a", "b"], &["y"], flags);
    node.domain = op.0.into();
    g.nodes.push(node);
    let meta = |s: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: s.to_vec(),
    };
    g.inputs = vec![value_info("a", &meta(a)), value_info("b", &meta(b))];
    g.outputs = vec![untyped_value_info("y")];
    let opts = SessionOptions::default();
    GraphSession::new(rt, &g, &opts, op.1).expect("a session of one product")
}

/// Seconds a run of `s` takes, over `runs` runs.
fn time(s: &mut GraphSession, feeds: &[(&str, &Tensor)], runs: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..runs {
        s.run(feeds).expect("a product");
    }
    t.elapsed().as_secs_f64() / runs as f64
}

fn main() {
    let rt = Runtime::from_env().expect("ONNX Runtime");
    if rt.info().blas.is_none() {
        eprintln!("no OpenBLAS beside ONNX Runtime: run scripts/setup.sh");
        return;
    }
    println!("| M x K x N | form | MLAS GFLOP/s | OpenBLAS GFLOP/s | OpenBLAS / MLAS |");
    println!("|---|---|---|---|---|");
    for (m, k, n) in [
        (512, 768, 768),
        (1024, 768, 768),
        (512, 768, 3072),
        (1024, 768, 3072),
        (1024, 3072, 768),
    ] {
        for (form, ta, tb) in [
            ("X W", false, false),
            ("X^T dY", true, false),
            ("X W^T", false, true),
        ] {
            let a = if ta { [k, m] } else { [m, k] };
            let b = if tb { [n, k] } else { [k, n] };
            let value = |s: &[usize]| {
                let len = s.iter().product();
                Tensor::f32(
                    s.to_vec(),
                    (0..len).map(|i| (i % 17) as f32 * 0.01).collect(),
                )
                .unwrap()
            };
            let (av, bv) = (value(&a), value(&b));
            let feeds = [("a", &av), ("b", &bv)];
            let mut mlas = session(&rt, ("com.microsoft", "FusedMatMul"), (ta, tb), &a, &b);
            let mut blas = session(&rt, ("ai.pipetrain", "BlasMatMul"), (ta, tb), &a, &b);
            let flop = 2.0 * (m * k * n) as f64;
            let runs = (4e9 / flop).ceil() as usize;
            time(&mut mlas, &feeds, 1);
            time(&mut blas, &feeds, 1);
            let (mut ratios, mut rates) = (Vec::new(), (0.0, 0.0));
            for _ in 0..WINDOWS {
                let (tm, tb) = (time(&mut mlas, &feeds, runs), time(&mut blas, &feeds, runs));
                ratios.push(tm / tb);
                rates.0 += flop / tm / 1e9 / WINDOWS as f64;
                rates.1 += flop / tb / 1e9 / WINDOWS as f64;
            }
            ratios.sort_by(f64::total_cmp);
            println!(
                "| {m} x {k} x {n} | {form} | {:.0} | {:.0} | {:.2} |",
                rates.0,
                rates.1,
                ratios[WINDOWS / 2]
            );
        }
    }
}
