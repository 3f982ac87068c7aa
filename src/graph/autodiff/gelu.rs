//! GELU in the form PyTorch exports `nn.GELU()`, `0.5 * (x * (1 + erf(x / sqrt 2)))`,
//! differentiated as one function rather than node by node.
//!
//! Node by node, the chain rule takes ten elementwise kernels a GELU (the `Erf` rule's
//! `exp(-t^2)` alone is four); as a whole, with `t` and `a = 1 + erf(t)` from the forward
//! pass, the derivative is
//!
//! ```text
//! dy/dx = a / 2 + t * exp(-t^2) / sqrt(pi)      (t = x / k or x * c, any constant)
//! ```
//!
//! since `d erf(t)/dx = 2 / sqrt(pi) * exp(-t^2) * t / x`: seven kernels, with the
//! constant folded into the exponent (`exp(ln(1 / sqrt pi) - t^2)`).

use std::collections::HashMap;

use super::emit::Emitter;
use crate::graph::ir::Graph;
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// One GELU found in a forward graph, named by its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gelu {
    /// The input.
    pub x: String,
    /// `x / k` (or `x * c`).
    pub t: String,
    /// `1 + erf(t)`.
    pub a: String,
}

/// The GELUs of `fwd`, keyed by the index of their last node (the `Mul` by one half).
/// Every inner value must be read by the next node of the chain only (a value read
/// elsewhere too gets its gradient node by node), and the constants (`k` or `c`, 1 and
/// 0.5) must be constants, not values computed from what is differentiated.
pub(crate) fn find(
    fwd: &Graph,
    consts: &HashMap<String, Tensor>,
    is_variable: &dyn Fn(&str) -> bool,
) -> HashMap<usize, Gelu> {
    let consumers = fwd.consumers();
    let producer: HashMap<&str, usize> = fwd
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let scalar = |v: &str| -> Option<f64> {
        if is_variable(v) {
            return None;
        }
        let t = consts.get(v)?;
        (t.len() == 1).then(|| t.to_f64_vec()[0])
    };
    // The node making `v` when it is `op` and `v` is read by one node only.
    let only_use = |v: &str, op: &str| -> Option<&NodeProto> {
        let readers = consumers.get(v)?;
        let &i = producer.get(v)?;
        let n = &fwd.nodes[i];
        (readers.len() == 1 && n.op_type == op && n.output.len() == 1).then_some(n)
    };
    // The operand of binary node `n` other than a constant equal to `c`.
    let other_than = |n: &NodeProto, c: f64| -> Option<String> {
        let [l, r] = n.input.as_slice() else {
            return None;
        };
        if scalar(r) == Some(c) {
            Some(l.clone())
        } else if n.op_type != "Div" && scalar(l) == Some(c) {
            Some(r.clone())
        } else {
            None
        }
    };
    let mut found = HashMap::new();
    for (i, half) in fwd.nodes.iter().enumerate() {
        if half.op_type != "Mul" || half.output.len() != 1 {
            continue;
        }
        let Some(m) = other_than(half, 0.5) else {
            continue;
        };
        let Some(times) = only_use(&m, "Mul") else {
            continue;
        };
        let [p, q] = times.input.as_slice() else {
            continue;
        };
        for (x, a) in [(p, q), (q, p)] {
            let Some(add) = only_use(a, "Add") else {
                continue;
            };
            let Some(e) = other_than(add, 1.0) else {
                continue;
            };
            let Some(erf) = only_use(&e, "Erf") else {
                continue;
            };
            let t = &erf.input[0];
            let Some(scale) = only_use(t, "Div").or_else(|| only_use(t, "Mul")) else {
                continue;
            };
            let [s0, s1] = scale.input.as_slice() else {
                continue;
            };
            let x_scaled = (s0 == x && scalar(s1).is_some_and(|k| k != 0.0))
                || (scale.op_type == "Mul" && s1 == x && scalar(s0).is_some());
            if x_scaled {
                found.insert(
                    i,
                    Gelu {
                        x: x.clone(),
                        t: t.clone(),
                        a: a.clone(),
                    },
                );
                break;
            }
        }
    }
    found
}

/// `x`'s gradient from `dy`, the gradient of the GELU's output.
pub(super) fn backward(e: &mut Emitter, g: &Gelu, dy: &str, dtype: DType) -> String {
    let t2 = e.mul(&g.t, &g.t);
    // ln(1 / sqrt(pi)): exp(c - t^2) = exp(-t^2) / sqrt(pi).
    let c = e.scalar(-0.5 * std::f64::consts::PI.ln(), dtype);
    let z = e.op("Sub", &[&c, &t2], vec![]);
    let density = e.op("Exp", &[&z], vec![]);
    let slope = e.mul(&g.t, &density);
    let half = e.scalar(0.5, dtype);
    let level = e.mul(&g.a, &half);
    let d = e.op("Add", &[&level, &slope], vec![]);
    e.mul(dy, &d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::make_node;

    fn graph(nodes: Vec<NodeProto>) -> (Graph, HashMap<String, Tensor>) {
        let g = Graph {
            nodes,
            ..Default::default()
        };
        let consts = [
            ("k", std::f32::consts::SQRT_2),
            ("c", 0.5),
            ("one", 1.0),
            ("half", 0.5),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), Tensor::f32(vec![], vec![v]).unwrap()))
        .collect();
        (g, consts)
    }

    fn chain(scale: NodeProto, add: &[&str], times: &[&str], half: &[&str]) -> Vec<NodeProto> {
        vec![
            scale,
            make_node("Erf", "erf", &["t"], &["e"], vec![]),
            make_node("Add", "add", add, &["a"], vec![]),
            make_node("Mul", "times", times, &["m"], vec![]),
            make_node("Mul", "half", half, &["y"], vec![]),
        ]
    }

    #[test]
    fn pytorchs_erf_gelu_is_found_in_either_operand_order() {
        let want = Gelu {
            x: "x".into(),
            t: "t".into(),
            a: "a".into(),
        };
        let div = make_node("Div", "div", &["x", "k"], &["t"], vec![]);
        let mul = make_node("Mul", "mul", &["c", "x"], &["t"], vec![]);
        for (scale, add, times, half) in [
            (div.clone(), ["e", "one"], ["x", "a"], ["m", "half"]),
            (mul, ["one", "e"], ["a", "x"], ["half", "m"]),
        ] {
            let (g, consts) = graph(chain(scale, &add, &times, &half));
            let found = find(&g, &consts, &|v| v == "x");
            assert_eq!(found, HashMap::from([(4, want.clone())]));
        }
    }

    #[test]
    fn chains_read_elsewhere_or_with_other_constants_are_left_to_the_node_rules() {
        let div = || make_node("Div", "div", &["x", "k"], &["t"], vec![]);
        let mut read_elsewhere = chain(div(), &["e", "one"], &["x", "a"], &["m", "half"]);
        read_elsewhere.push(make_node("Neg", "neg", &["a"], &["z"], vec![]));
        let (g, consts) = graph(read_elsewhere);
        assert!(find(&g, &consts, &|v| v == "x").is_empty());

        let not_half = chain(div(), &["e", "one"], &["x", "a"], &["m", "one"]);
        let (g, consts) = graph(not_half);
        assert!(find(&g, &consts, &|v| v == "x").is_empty());

        // `x / k` where `k` is trained is no constant scale.
        let (g, consts) = graph(chain(div(), &["e", "one"], &["x", "a"], &["m", "half"]));
        assert!(find(&g, &consts, &|v| v == "x" || v == "k").is_empty());

        // A different x in the scale and the product.
        let other = make_node("Div", "div", &["w", "k"], &["t"], vec![]);
        let (g, consts) = graph(chain(other, &["e", "one"], &["x", "a"], &["m", "half"]));
        assert!(find(&g, &consts, &|v| v == "x" || v == "w").is_empty());
    }
}
