//! Every case of ONNX Runtime's own gradient tests that plain ONNX expresses
//! (`tests/fixtures/ort_gradient_cases.json`, made by `tools/ort_gradient_cases/`): the
//! same operator, shapes, attributes and differentiated inputs, built at opset 17 where
//! the test used an older one, against central finite differences. In float64 (relative
//! 1e-4) where ONNX Runtime's CPU provider has a double kernel for the operator, in float32
//! (the tolerance of `common/gradcheck.rs`) where it has not.

use std::collections::BTreeMap;

use crate::common::gradcheck::{GradCheck, Rng, F32, F64};
use pipetrain::graph::{float_attr, int_attr, ints_attr, string_attr};
use pipetrain::onnx::proto::{attribute_proto::AttributeType, AttributeProto};
use pipetrain::tensor::{DType, Tensor, TensorData};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    id: String,
    op: String,
    opset: i64,
    inputs: Vec<Option<Input>>,
    attributes: Vec<Attr>,
    outputs: Vec<bool>,
    /// ONNX Runtime's test asserts its builder refuses this case.
    ort_refuses: bool,
    source: String,
}

#[derive(Deserialize)]
struct Input {
    shape: Vec<usize>,
    dtype: String,
    grad: bool,
    gen: Gen,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Gen {
    Values(Vec<f64>),
    Uniform([f64; 2]),
    AwayFromZero(f64),
    Distinct(f64),
    /// Uniform in [-2, 2) cut to multiples of `step`, plus `offset`.
    Grid {
        step: f64,
        offset: f64,
    },
    Ints([i64; 2]),
    Labels {
        classes: i64,
        every_second: Option<i64>,
    },
    /// Random booleans (Where's condition).
    #[allow(dead_code)]
    Bool(bool),
}

#[derive(Deserialize)]
struct Attr {
    name: String,
    i: Option<i64>,
    f: Option<f32>,
    s: Option<String>,
    ints: Option<Vec<i64>>,
    floats: Option<Vec<f32>>,
}

/// Operators ONNX Runtime's CPU provider runs in float32 only (at these opsets).
const FLOAT32_ONLY: [&str; 9] = [
    "Atan",
    "GlobalMaxPool",
    "GlobalAveragePool",
    "AveragePool",
    "Erf",
    "Resize",
    "ConvTranspose",
    "Conv",
    // Cast to float32 (`to = 1`): its output is float32 whatever the input.
    "Cast",
];

fn attribute(a: &Attr) -> AttributeProto {
    if let Some(v) = a.i {
        int_attr(&a.name, v)
    } else if let Some(v) = a.f {
        float_attr(&a.name, v)
    } else if let Some(v) = &a.s {
        string_attr(&a.name, v)
    } else if let Some(v) = &a.ints {
        ints_attr(&a.name, v)
    } else {
        AttributeProto {
            name: a.name.clone(),
            r#type: AttributeType::Floats as i32,
            floats: a.floats.clone().unwrap_or_default(),
            ..Default::default()
        }
    }
}

/// An input's tensor, made as the case says.
fn tensor(input: &Input, float: DType, r: &mut Rng) -> Tensor {
    let n: usize = input.shape.iter().product();
    let shape = input.shape.clone();
    if input.dtype == "bool" {
        let v = (0..n).map(|_| r.next() > 0.5).collect();
        return Tensor::new(shape, TensorData::Bool(v)).unwrap();
    }
    if input.dtype.starts_with("int") {
        let v: Vec<i64> = match &input.gen {
            Gen::Values(v) => v.iter().map(|&x| x as i64).collect(),
            Gen::Ints([lo, hi]) => (0..n)
                .map(|_| r.uniform(*lo as f64, *hi as f64).floor() as i64)
                .collect(),
            Gen::Labels {
                classes,
                every_second,
            } => (0..n)
                .map(|k| match every_second {
                    Some(ignore) if k % 2 == 1 => *ignore,
                    _ => (r.next() * *classes as f64).floor() as i64,
                })
                .collect(),
            _ => panic!("integer input with a float generator"),
        };
        return Tensor::i64(shape, v).unwrap();
    }
    let t = match &input.gen {
        Gen::Values(v) => Tensor::f64(shape, v.clone()).unwrap(),
        Gen::Uniform([lo, hi]) => r.tensor(DType::F64, &shape, *lo, *hi),
        Gen::AwayFromZero(gap) => r.away_from_zero(DType::F64, &shape, *gap),
        Gen::Grid { step, offset } => {
            let v = (0..n)
                .map(|_| (r.uniform(-2.0, 2.0) / step).trunc() * step + offset)
                .collect();
            Tensor::f64(shape, v).unwrap()
        }
        Gen::Distinct(step) => {
            // 0, step, 2 step, ... shuffled: ties further apart than the difference step.
            let mut v: Vec<f64> = (0..n)
                .map(|k| k as f64 * step - n as f64 * step / 2.0)
                .collect();
            for k in (1..n).rev() {
                v.swap(k, (r.next() * (k + 1) as f64) as usize % (k + 1));
            }
            Tensor::f64(shape, v).unwrap()
        }
        _ => panic!("float input with an integer generator"),
    };
    crate::common::gradcheck::cast(&t, float)
}

/// The check of one case, or why it cannot be built.
fn build(case: &Case, float: DType) -> GradCheck {
    let mut r = Rng::new(5566);
    let mut c = GradCheck::new(case.opset);
    let mut names = Vec::new();
    for (k, input) in case.inputs.iter().enumerate() {
        let Some(input) = input else {
            names.push(String::new());
            continue;
        };
        let name = format!("in{k}");
        let t = tensor(input, float, &mut r);
        c = match input.grad && t.dtype().is_float() {
            true => c.param(&name, t),
            false => c.constant(&name, t),
        };
        names.push(name);
    }
    let outputs: Vec<String> = (0..case.outputs.len()).map(|k| format!("out{k}")).collect();
    let ins: Vec<&str> = names.iter().map(String::as_str).collect();
    let outs: Vec<&str> = outputs.iter().map(String::as_str).collect();
    let attrs = case.attributes.iter().map(attribute).collect();
    let read: Vec<&str> = outs
        .iter()
        .zip(&case.outputs)
        .filter(|(_, grad)| **grad)
        .map(|(o, _)| *o)
        .collect();
    c.node(&case.op, &ins, &outs, attrs).loss_of(&read)
}

#[test]
fn every_plain_onnx_case_of_onnx_runtimes_gradient_tests_holds() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ort_gradient_cases.json"
    );
    let cases: Vec<Case> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rt = crate::common::runtime();
    let mut failed = Vec::new();
    let mut refused = Vec::new();
    let mut per_op: BTreeMap<&str, usize> = BTreeMap::new();
    for case in &cases {
        let (float, tol) = match FLOAT32_ONLY.contains(&case.op.as_str()) {
            true => (DType::F32, F32),
            false => (DType::F64, F64),
        };
        match build(case, float).run(&rt, tol) {
            Ok(_) => *per_op.entry(case.op.as_str()).or_default() += 1,
            // A case ONNX Runtime refuses that its own forward cannot run (reflect pads
            // as long as the axis): refused here too, by the forward.
            Err(e) if case.ort_refuses && e.contains("running the shape probe") => {
                refused.push(format!("{}: {e}", case.id));
            }
            Err(e) => failed.push(format!("{} ({}): {e}", case.id, case.source)),
        }
    }
    eprintln!(
        "{} cases hold: {per_op:?}",
        cases.len() - failed.len() - refused.len()
    );
    eprintln!("refused, as by ONNX Runtime: {refused:#?}");
    assert!(
        failed.is_empty(),
        "{} of {} cases fail:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}
