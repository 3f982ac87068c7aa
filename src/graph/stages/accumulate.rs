//! A gradient graph that adds its parameter gradients into the accumulators it reads.
//!
//! A step of several micro-batches sums their gradients. ONNX Runtime writes the first
//! micro-batch's straight into the stage's accumulators; each later one's came out as
//! ONNX Runtime's own tensors, all held until the run ended, then added: a second copy
//! of the stage's gradients at every later micro-batch (3.8 GB across the ranks of a
//! 1-billion-parameter model). The twin graph made here ends each gradient `g` in
//! pipetrain's `Accumulate(g@acc, g)` (`acc + g`, as the accumulation it replaces
//! added: ONNX Runtime would fuse an `Add` into the product before it), with `g@acc` an
//! input: the stage feeds it the accumulator and
//! directs the sum into the same accumulator (`pipeline::stage_run`), so each gradient
//! is added as it is made and freed.

use std::collections::HashSet;

use crate::graph::custom_ops::{ACCUMULATE, DOMAIN};
use crate::graph::ir::{make_node, Graph};

/// The suffix of the input that feeds gradient `g`'s accumulator.
pub const ACC_SUFFIX: &str = "@acc";

/// `g` with each output named in `grads` summed with its accumulator (an input named
/// with [`ACC_SUFFIX`]); `None` when `g` computes none of `grads`. The outputs keep
/// their names and order.
pub fn accumulating(g: &Graph, grads: &HashSet<String>) -> Option<Graph> {
    let summed: Vec<usize> = (0..g.outputs.len())
        .filter(|&k| grads.contains(&g.outputs[k].name))
        .collect();
    if summed.is_empty() {
        return None;
    }
    let mut twin = g.clone();
    twin.name = format!("{} (accumulating)", g.name);
    for k in summed {
        let out = g.outputs[k].clone();
        let made = format!("{}@made", out.name);
        // The value as this micro-batch computes it takes another name everywhere.
        for n in &mut twin.nodes {
            for v in n.input.iter_mut().chain(n.output.iter_mut()) {
                if *v == out.name {
                    v.clone_from(&made);
                }
            }
        }
        let acc = format!("{}{ACC_SUFFIX}", out.name);
        twin.inputs.push(crate::onnx::proto::ValueInfoProto {
            name: acc.clone(),
            ..out.clone()
        });
        let mut add = make_node(
            ACCUMULATE,
            &format!("{}/accumulate", out.name),
            &[&acc, &made],
            &[&out.name],
            vec![],
        );
        add.domain = DOMAIN.into();
        twin.nodes.push(add);
    }
    twin.import_domain(DOMAIN, 1);
    Some(twin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::untyped_value_info;

    #[test]
    fn each_gradient_is_summed_with_its_accumulator_under_its_own_name() {
        let g = Graph {
            name: "stage 0 backward".into(),
            nodes: vec![
                make_node("Relu", "r", &["x"], &["w_grad"], vec![]),
                make_node("Neg", "n", &["w_grad"], &["x_grad"], vec![]),
            ],
            outputs: vec![untyped_value_info("x_grad"), untyped_value_info("w_grad")],
            ..Default::default()
        };
        let grads: HashSet<String> = ["w_grad".to_string()].into();
        let twin = accumulating(&g, &grads).unwrap();
        let names: Vec<&str> = twin.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["x_grad", "w_grad"]);
        assert_eq!(twin.nodes[1].input, ["w_grad@made"]);
        let add = twin.nodes.last().unwrap();
        assert_eq!(
            (add.op_type.as_str(), add.domain.as_str()),
            (ACCUMULATE, DOMAIN)
        );
        assert_eq!(add.input, ["w_grad@acc", "w_grad@made"]);
        assert!(twin.inputs.iter().any(|v| v.name == "w_grad@acc"));
        assert!(accumulating(&g, &HashSet::new()).is_none());
    }
}
