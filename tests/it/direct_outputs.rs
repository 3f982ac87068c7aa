//! Outputs that ONNX Runtime writes straight into a pipetrain buffer
//! (`GraphSession::run_views_direct`, how a step's first gradients reach the stage's
//! accumulators): the values land at their offsets and equal a plain run's, the rest of
//! the buffer is left alone, and a buffer that moved or a wrong shape is handled.

use crate::common;

use pipetrain::compute::{GraphSession, SessionOptions, Target};
use pipetrain::graph::{make_node, untyped_value_info, value_info, ValueMeta};
use pipetrain::tensor::{DType, Tensor, TensorView};
use pipetrain::Error;

/// `y = X @ W`, `z = relu(y)`, `xcopy = X` (an output that is another value's alias).
fn session() -> GraphSession {
    let meta = |shape: &[usize]| ValueMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    };
    let model = common::opset17_model(
        "direct",
        vec![
            make_node("MatMul", "mm", &["X", "W"], &["y"], vec![]),
            make_node("Relu", "relu", &["y"], &["z"], vec![]),
            make_node("Identity", "id", &["X"], &["xcopy"], vec![]),
        ],
        vec![],
        vec![
            value_info("X", &meta(&[4, 3])),
            value_info("W", &meta(&[3, 2])),
        ],
        vec![
            untyped_value_info("y"),
            untyped_value_info("z"),
            untyped_value_info("xcopy"),
        ],
    );
    let rt = common::runtime();
    GraphSession::from_model(&rt, &model, &SessionOptions::default(), "direct").unwrap()
}

fn inputs() -> (Tensor, Tensor) {
    let x = Tensor::f32(vec![4, 3], (0..12).map(|i| i as f32 - 5.5).collect()).unwrap();
    let w = Tensor::f32(vec![3, 2], vec![0.5, -1.0, 2.0, 0.25, -0.75, 1.5]).unwrap();
    (x, w)
}

#[test]
fn direct_outputs_land_at_their_offsets_with_a_plain_runs_values() {
    let mut s = session();
    const SENTINEL: f32 = 1234.5;
    let targets = [
        Target {
            output: 0, // y
            offset: 2,
            shape: &[4, 2],
        },
        Target {
            output: 2, // xcopy
            offset: 12,
            shape: &[4, 3],
        },
    ];
    let mut earlier: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    for round in 0..3 {
        let (x, w) = inputs();
        let x = Tensor::f32(
            vec![4, 3],
            x.as_f32()
                .unwrap()
                .iter()
                .map(|v| v * (round + 1) as f32)
                .collect(),
        )
        .unwrap();
        let plain = s.run(&[("X", &x), ("W", &w)]).unwrap();
        let (y, z, xcopy) = (&plain[0], &plain[1], &plain[2]);
        // A fresh buffer of the same length each round, the earlier ones still alive
        // (so at other addresses): each run writes into its own buffer only.
        let mut buf = vec![SENTINEL; 26];
        let feeds: [(&str, TensorView<'_>); 2] = [("X", x.view()), ("W", w.view())];
        let mut sunk = Vec::new();
        let rest = s
            .run_views_direct(&feeds, &mut buf, &targets, &mut |name, _| {
                sunk.push(name.to_string());
                Ok(false)
            })
            .unwrap();
        assert_eq!(&buf[2..10], y.as_f32().unwrap(), "y in place");
        assert_eq!(&buf[12..24], xcopy.as_f32().unwrap(), "the alias in place");
        assert!(buf[..2]
            .iter()
            .chain(&buf[10..12])
            .chain(&buf[24..])
            .all(|&v| v == SENTINEL));
        assert_eq!(sunk, ["z"], "only the other output is offered to the sink");
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].0, "z");
        assert_eq!(rest[0].1.as_f32().unwrap(), z.as_f32().unwrap());
        for (old, snapshot) in &earlier {
            assert_eq!(old, snapshot, "an earlier buffer was written to");
        }
        let snapshot = buf.clone();
        earlier.push((buf, snapshot));
    }
}

#[test]
fn direct_outputs_refuse_targets_that_do_not_fit() {
    let mut s = session();
    let (x, w) = inputs();
    let feeds: [(&str, TensorView<'_>); 2] = [("X", x.view()), ("W", w.view())];
    let mut small = vec![0.0; 8];
    let past_end = [Target {
        output: 0,
        offset: 1,
        shape: &[4, 2],
    }];
    let err = s
        .run_views_direct(&feeds, &mut small, &past_end, &mut |_, _| Ok(false))
        .unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { name, reason } if name == "y" && reason.contains("do not fit")),
        "{err}"
    );
    let mut buf = vec![0.0; 16];
    let no_output = [Target {
        output: 3,
        offset: 0,
        shape: &[4, 2],
    }];
    let err = s
        .run_views_direct(&feeds, &mut buf, &no_output, &mut |_, _| Ok(false))
        .unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { reason, .. } if reason.contains("has 3 outputs")),
        "{err}"
    );
    let wrong_shape = [Target {
        output: 0,
        offset: 0,
        shape: &[2, 4],
    }];
    let err = s
        .run_views_direct(&feeds, &mut buf, &wrong_shape, &mut |_, _| Ok(false))
        .unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { .. } | Error::Ort { .. }),
        "{err}"
    );
}
