//! Value-preserving clean-ups: of a training graph's forward part, before it is
//! differentiated, nodes that hand their input on unchanged become `Identity`, which
//! ONNX Runtime drops and whose gradient is the output's own; of a stage's graphs, the
//! `Identity`s that only name an output ([`fold_output_identities`]).
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

/// Drops every `Identity` of `g` that only names one of its outputs after a value a node
/// of `g` makes and nothing else reads: that node writes the output itself. Returns how
/// many.
///
/// The backward names each parameter's gradient with such an identity where the
/// gradient is complete (`autodiff::gradient_outputs`), at the end of the backward,
/// while its value is made where the layer's gradient is. Left in, every weight gradient
/// stays alive to the end of the pass (a stage's whole gradient size in ONNX Runtime's
/// memory: 1.9 GB for half of a 953 M Llama), cannot be written by ONNX Runtime straight
/// into the caller's buffer, and crosses every cut of the gradient graph into buckets.
pub fn fold_output_identities(g: &mut Graph) -> usize {
    let outputs: std::collections::HashSet<&str> =
        g.outputs.iter().map(|o| o.name.as_str()).collect();
    let consumers = g.consumers();
    let producer: std::collections::HashMap<&str, usize> = (g.nodes.iter().enumerate())
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let mut folds: Vec<(usize, usize)> = Vec::new();
    for (t, n) in g.nodes.iter().enumerate() {
        let names_output = n.op_type == "Identity"
            && n.domain.is_empty()
            && n.input.len() == 1
            && n.output.len() == 1
            && outputs.contains(n.output[0].as_str());
        if !names_output {
            continue;
        }
        let x = n.input[0].as_str();
        let read_once = consumers.get(x).is_some_and(|c| c.len() == 1);
        if let Some(&p) = producer
            .get(x)
            .filter(|_| read_once && !outputs.contains(x))
        {
            folds.push((p, t));
        }
    }
    for &(p, t) in &folds {
        let (x, out) = (g.nodes[t].input[0].clone(), g.nodes[t].output[0].clone());
        for o in g.nodes[p].output.iter_mut().filter(|o| **o == x) {
            *o = out.clone();
        }
    }
    let gone: std::collections::HashSet<usize> = folds.iter().map(|&(_, t)| t).collect();
    let mut i = 0;
    g.nodes.retain(|_| {
        i += 1;
        !gone.contains(&(i - 1))
    });
    gone.len()
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

    #[test]
    fn an_outputs_identity_goes_where_its_input_is_made_and_read_once() {
        let nodes = vec![
            make_node("MatMul", "mm", &["a", "b"], &["x"], vec![]),
            make_node("Mul", "m", &["a", "a"], &["z"], vec![]),
            make_node("Identity", "id", &["x"], &["w_grad"], vec![]),
            make_node("Identity", "id2", &["z"], &["v_grad"], vec![]),
            make_node("Neg", "n", &["z"], &["u"], vec![]),
            make_node("Identity", "id3", &["a"], &["a_out"], vec![]),
        ];
        let mut g = Graph {
            nodes,
            outputs: ["w_grad", "v_grad", "u", "a_out"]
                .map(untyped_value_info)
                .to_vec(),
            ..Default::default()
        };
        // `z` is read twice, `a` is no node's: those identities stay.
        assert_eq!(fold_output_identities(&mut g), 1);
        assert_eq!(g.nodes.len(), 5);
        assert_eq!(g.nodes[0].output, ["w_grad"]);
        assert!(g.nodes.iter().all(|n| !n.input.iter().any(|i| i == "x")));
    }
}
