//! Value-preserving clean-ups of a training graph's forward part, before it is
//! differentiated: nodes that hand their input on unchanged become `Identity`, which
//! ONNX Runtime drops and whose gradient is the output's own.
//!
//! `Dropout` with a constant ratio of 0, or with a constant false `training_mode` (an
//! exported `nn.Dropout(p=0.0)`, as configurations that turn dropout off have it): its
//! output is its input, so it is an identity when nothing reads its mask. Left as it is,
//! it is a copy forward and a mask cast and two products backward.

use super::ir::Graph;
use super::make_node;

/// Turns the identity `Dropout`s of `g` (see the module doc) into `Identity`; returns
/// how many.
pub fn identity_dropouts(g: &mut Graph) -> usize {
    let consts = g.constants();
    let consumers = g.consumers();
    let outputs: Vec<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
    let scalar = |name: Option<&String>| {
        let t = consts.get(name.filter(|n| !n.is_empty())?)?;
        (t.len() == 1).then(|| t.to_f64_vec()[0])
    };
    let identity: Vec<usize> = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type == "Dropout" && (n.domain.is_empty() || n.domain == "ai.onnx"))
        .filter(|(_, n)| {
            let off = scalar(n.input.get(1)) == Some(0.0);
            let inference = match n.input.get(2).filter(|t| !t.is_empty()) {
                None => true,
                Some(_) => scalar(n.input.get(2)) == Some(0.0),
            };
            let mask_unread = n.output.get(1).is_none_or(|m| {
                m.is_empty()
                    || (!consumers.contains_key(m.as_str()) && !outputs.contains(&m.as_str()))
            });
            (off || inference) && mask_unread
        })
        .map(|(i, _)| i)
        .collect();
    for &i in &identity {
        let n = &g.nodes[i];
        let name = format!("{}/identity", n.name);
        g.nodes[i] = make_node("Identity", &name, &[&n.input[0]], &[&n.output[0]], vec![]);
    }
    identity.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::untyped_value_info;
    use crate::tensor::Tensor;

    fn dropout(name: &str, inputs: &[&str], mask: &str) -> crate::onnx::proto::NodeProto {
        make_node(
            "Dropout",
            name,
            inputs,
            &[&format!("{name}_y"), mask],
            vec![],
        )
    }

    #[test]
    fn only_dropouts_that_hand_their_input_on_become_identities() {
        let scalar = |name: &str, v: f32| Tensor::f32(vec![], vec![v]).unwrap().to_proto(name);
        let flag = |name: &str, v: bool| {
            let t = Tensor {
                shape: vec![],
                data: crate::tensor::TensorData::Bool(vec![v]),
            };
            t.to_proto(name)
        };
        let nodes = vec![
            dropout("p0", &["x", "zero", "on"], "p0_mask"),
            dropout("p_tenth", &["x", "tenth", "on"], "p_tenth_mask"),
            dropout("eval", &["x", "tenth", "off"], "eval_mask"),
            dropout("no_mode", &["x", "tenth"], ""),
            dropout("default_ratio", &["x", "", "on"], ""),
            dropout("mask_read", &["x", "zero", "on"], "read"),
            make_node("Not", "reader", &["read"], &["r"], vec![]),
            dropout("mask_out", &["x", "zero", "on"], "out"),
        ];
        let mut g = Graph {
            initializers: vec![
                scalar("zero", 0.0),
                scalar("tenth", 0.1),
                flag("on", true),
                flag("off", false),
            ],
            nodes,
            outputs: vec![untyped_value_info("out")],
            ..Default::default()
        };
        assert_eq!(identity_dropouts(&mut g), 3);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(
            ops,
            [
                "Identity", "Dropout", "Identity", "Identity", "Dropout", "Dropout", "Not",
                "Dropout"
            ]
        );
        assert_eq!(g.nodes[0].input, ["x"]);
        assert_eq!(g.nodes[0].output, ["p0_y"]);
    }
}
