//! LSTM, GRU and RNN (ONNX Runtime's training build differentiates LSTM and GRU with its
//! own kernels) against central finite differences: every direction, with
//! and without biases and initial states, and the loss reading each output alone
//! (float32: ONNX Runtime has no float64 kernel for them).

use crate::common::gradcheck::{check, GradCheck, Rng, Tol, F32};
use pipetrain::graph::{int_attr, string_attr};
use pipetrain::onnx::proto::AttributeProto;
use pipetrain::tensor::{DType, Tensor, TensorData};

/// ONNX Runtime's CPU LSTM, GRU and RNN have float32 kernels only.
const D: DType = DType::F32;
const SEQ: usize = 4;
const BATCH: usize = 3;
const INPUT: usize = 5;
const HIDDEN: usize = 3;

/// One recurrent node's case.
struct Case {
    op: &'static str,
    gates: usize,
    direction: &'static str,
    bias: bool,
    initial: bool,
    attrs: Vec<AttributeProto>,
}

impl Case {
    fn new(op: &'static str, direction: &'static str) -> Case {
        let gates = match op {
            "LSTM" => 4,
            "GRU" => 3,
            _ => 1,
        };
        Case {
            op,
            gates,
            direction,
            bias: true,
            initial: true,
            attrs: vec![],
        }
    }

    fn dirs(&self) -> usize {
        if self.direction == "bidirectional" {
            2
        } else {
            1
        }
    }

    /// The graph; `loss_of` picks the outputs the loss reads (all when empty).
    fn graph(&self, seed: u64, loss_of: &[&str]) -> GradCheck {
        let mut r = Rng::new(seed);
        let (d, g) = (self.dirs(), self.gates * HIDDEN);
        let (x_shape, state_shape) = ([SEQ, BATCH, INPUT], [d, BATCH, HIDDEN]);
        let mut c = GradCheck::new(17)
            .param("X", r.tensor(D, &x_shape, -1.0, 1.0))
            .param("W", r.tensor(D, &[d, g, INPUT], -0.6, 0.6))
            .param("R", r.tensor(D, &[d, g, HIDDEN], -0.6, 0.6));
        let mut inputs = vec!["X", "W", "R"];
        match self.bias {
            true => {
                c = c.param("B", r.tensor(D, &[d, 2 * g], -0.5, 0.5));
                inputs.push("B");
            }
            false => inputs.push(""),
        }
        inputs.push(""); // sequence_lens
        if self.initial {
            c = c.param("H0", r.tensor(D, &state_shape, -0.8, 0.8));
            inputs.push("H0");
            if self.op == "LSTM" {
                c = c.param("C0", r.tensor(D, &state_shape, -0.8, 0.8));
                inputs.push("C0");
            }
        }
        let outputs: &[&str] = match self.op {
            "LSTM" => &["Y", "Y_h", "Y_c"],
            _ => &["Y", "Y_h"],
        };
        let mut attrs = vec![
            int_attr("hidden_size", HIDDEN as i64),
            string_attr("direction", self.direction),
        ];
        attrs.extend(self.attrs.iter().cloned());
        c = c.node(self.op, &inputs, outputs, attrs);
        match loss_of.is_empty() {
            true => c,
            false => c.loss_of(loss_of),
        }
    }

    fn name(&self) -> String {
        format!(
            "{} {} bias {} initial {} {:?}",
            self.op,
            self.direction,
            self.bias,
            self.initial,
            self.attrs.iter().map(|a| &a.name).collect::<Vec<_>>()
        )
    }
}

/// Each direction with every output in the loss, then the loss reading one output alone
/// (the other outputs' gradients absent).
fn check_all(op: &'static str, attrs: Vec<AttributeProto>, outputs: &[&str], tol: Tol) {
    for (k, direction) in ["forward", "reverse", "bidirectional"]
        .into_iter()
        .enumerate()
    {
        let mut case = Case::new(op, direction);
        case.attrs = attrs.clone();
        check(&case.name(), case.graph(11 + k as u64, &[]), tol);
    }
    let mut bare = Case::new(op, "bidirectional");
    bare.bias = false;
    bare.initial = false;
    bare.attrs = attrs.clone();
    check(&bare.name(), bare.graph(5, &[]), tol);
    for out in outputs {
        let mut case = Case::new(op, "bidirectional");
        case.attrs = attrs.clone();
        check(
            &format!("{} reading {out}", case.name()),
            case.graph(7, &[out]),
            tol,
        );
    }
}

#[test]
fn lstm_matches_finite_differences() {
    check_all("LSTM", vec![], &["Y", "Y_h", "Y_c"], F32);
}

#[test]
fn gru_matches_finite_differences_with_and_without_linear_before_reset() {
    for lbr in [0, 1] {
        let lbr = vec![int_attr("linear_before_reset", lbr)];
        check_all("GRU", lbr, &["Y", "Y_h"], F32);
    }
}

#[test]
fn rnn_matches_finite_differences_with_tanh_and_relu() {
    check_all("RNN", vec![], &["Y", "Y_h"], F32);
    // A step of 1e-2 crosses Relu's kink for some pre-activations; at 1e-3 float32's
    // rounding (~1e-7 |L| / h ~ 1e-3) needs the wider tolerance.
    let relu = pipetrain::graph::strings_attr("activations", &["Relu", "Relu"]);
    let fine = Tol {
        step: 1e-3,
        rtol: 5e-3,
        atol: 5e-3,
    };
    check_all("RNN", vec![relu], &["Y"], fine);
}

/// Forms the rule does not handle are refused, naming the node and what is refused.
#[test]
fn unsupported_recurrent_forms_are_refused_by_name() {
    let rt = crate::common::runtime();
    let mut clipped = Case::new("LSTM", "forward");
    clipped.attrs = vec![pipetrain::graph::float_attr("clip", 3.0)];
    let err = clipped.graph(3, &[]).run(&rt, F32).unwrap_err();
    assert!(err.contains("LSTM") && err.contains("clip"), "{err}");
    let mut hard = Case::new("GRU", "forward");
    hard.attrs = vec![pipetrain::graph::strings_attr(
        "activations",
        &["HardSigmoid", "Tanh"],
    )];
    let err = hard.graph(3, &[]).run(&rt, F32).unwrap_err();
    assert!(err.contains("GRU") && err.contains("HardSigmoid"), "{err}");
    let lens = Tensor::new(
        vec![BATCH],
        TensorData::I32(vec![SEQ as i32, 2, SEQ as i32]),
    )
    .unwrap();
    let c = GradCheck::new(17)
        .param("X", Rng::new(1).tensor(D, &[SEQ, BATCH, INPUT], -1.0, 1.0))
        .param("W", Rng::new(2).tensor(D, &[1, HIDDEN, INPUT], -1.0, 1.0))
        .param("R", Rng::new(3).tensor(D, &[1, HIDDEN, HIDDEN], -1.0, 1.0))
        .constant("L", lens)
        .node(
            "RNN",
            &["X", "W", "R", "", "L"],
            &["Y", "Y_h"],
            vec![int_attr("hidden_size", HIDDEN as i64)],
        );
    let err = c.run(&rt, F32).unwrap_err();
    assert!(err.contains("sequence_lens"), "{err}");
}

/// Nodes with no optional input at all (`X, W, R`), their input a constant: the
/// weights' gradients alone, in every cell.
#[test]
fn nodes_without_optional_inputs_and_a_constant_input_match_finite_differences() {
    for (op, gates) in [("LSTM", 4), ("GRU", 3), ("RNN", 1)] {
        let mut r = Rng::new(17);
        let c = GradCheck::new(17)
            .constant("X", r.tensor(D, &[SEQ, BATCH, INPUT], -1.0, 1.0))
            .param("W", r.tensor(D, &[1, gates * HIDDEN, INPUT], -0.6, 0.6))
            .param("R", r.tensor(D, &[1, gates * HIDDEN, HIDDEN], -0.6, 0.6))
            .node(
                op,
                &["X", "W", "R"],
                &["Y"],
                vec![int_attr("hidden_size", HIDDEN as i64)],
            );
        check(&format!("{op} of X, W, R alone"), c, F32);
    }
}
