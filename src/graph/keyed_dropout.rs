//! Training-mode `Dropout`s drawing their masks from a key fed with each micro-batch.
//!
//! ONNX Runtime's `Dropout` draws from a generator of its own: seeded from the clock
//! where the node has no `seed` attribute (as `torch.onnx.export` writes it), so two runs
//! of one configuration differ, and seeded or not, going on from wherever the session's
//! last run left it, so a resumed run draws other masks than the uninterrupted one, and
//! a backward that recomputes the forward would draw other masks than the forward did.
//!
//! With pipetrain's kernels (the CPU's, or the CUDA ones on a GPU: `train::settings`),
//! [`key_dropouts`] writes each training-mode `Dropout` of the forward as `KeyedDropout`
//! (`compute/fused/dropout.rs`, `compute/cuda_dropout.rs`), whose mask is
//! a function of the node and of [`DROPOUT_KEY`], a data input `[seed, step, replica,
//! micro-batch]` the data source feeds with each micro-batch (`pipeline::data`). It
//! keeps the node's place, name and outputs, so the gradient (which reads the mask) and
//! the stage cut are unchanged. Evaluation graphs compute no dropout
//! ([`dropouts_for_inference`]).

use super::custom_ops::{DOMAIN, KEYED_DROPOUT};
use super::ir::{int_attr, make_node, value_info, Graph, ValueMeta};
use super::training::TrainingGraph;
use crate::tensor::DType;

/// The data input every keyed dropout reads: int64 `[seed, step, replica, micro-batch]`.
pub const DROPOUT_KEY: &str = "pipetrain/dropout_key";

/// Rewrites every float32 training-mode `Dropout` of `tg`'s forward with a constant ratio
/// in (0, 1) as a `KeyedDropout`, adding [`DROPOUT_KEY`] to its data inputs where it
/// rewrote any; returns how many.
pub fn key_dropouts(tg: &mut TrainingGraph) -> usize {
    let consts = tg.graph.constants();
    let scalar = |name: Option<&String>| {
        let t = consts.get(name.filter(|n| !n.is_empty())?)?;
        (t.len() == 1).then(|| t.to_f64_vec()[0])
    };
    let mut n = 0;
    for node in &mut tg.graph.nodes[..tg.forward_len] {
        let standard = node.domain.is_empty() || node.domain == "ai.onnx";
        if node.op_type != "Dropout" || !standard {
            continue;
        }
        let training = scalar(node.input.get(2)).is_some_and(|t| t != 0.0);
        let ratio = scalar(node.input.get(1)).filter(|r| *r > 0.0 && *r < 1.0);
        let f32 = tg
            .metas
            .get(&node.input[0])
            .is_some_and(|m| m.dtype == DType::F32);
        if !(training && ratio.is_some() && f32) {
            continue;
        }
        let outputs: Vec<&str> = node.output.iter().map(String::as_str).collect();
        let inputs = [node.input[0].as_str(), node.input[1].as_str(), DROPOUT_KEY];
        let salt = int_attr("salt", salt_of(&node.name));
        let mut keyed = make_node(KEYED_DROPOUT, &node.name, &inputs, &outputs, vec![salt]);
        keyed.domain = DOMAIN.into();
        *node = keyed;
        n += 1;
    }
    if n > 0 {
        let meta = ValueMeta {
            dtype: DType::I64,
            shape: vec![4],
        };
        tg.graph.inputs.push(value_info(DROPOUT_KEY, &meta));
        tg.metas.insert(DROPOUT_KEY.into(), meta);
        tg.data_inputs.push(DROPOUT_KEY.into());
        tg.graph.import_domain(DOMAIN, 1);
    }
    n
}

/// A node's salt: the FNV-1a hash of its name (the same in every process and layout).
fn salt_of(name: &str) -> i64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    hash as i64
}

/// Turns the dropouts of an evaluation graph `g` into what they compute in inference:
/// a `KeyedDropout` whose mask nothing reads into an `Identity`, a training-mode
/// `Dropout` into one in inference mode; drops [`DROPOUT_KEY`] from its inputs when
/// nothing reads it any more. Returns how many it changed.
pub fn dropouts_for_inference(g: &mut Graph) -> usize {
    let changes: Vec<(usize, bool)> = {
        let consumers = g.consumers();
        let outputs: Vec<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
        let unread = |v: Option<&String>| {
            v.is_none_or(|m| {
                m.is_empty()
                    || (!consumers.contains_key(m.as_str()) && !outputs.contains(&m.as_str()))
            })
        };
        let standard = |d: &str| d.is_empty() || d == "ai.onnx";
        g.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| unread(n.output.get(1)))
            .filter_map(|(i, n)| match n.op_type.as_str() {
                KEYED_DROPOUT if n.domain == DOMAIN => Some((i, true)),
                "Dropout" if standard(&n.domain) && n.input.len() > 2 => Some((i, false)),
                _ => None,
            })
            .collect()
    };
    for &(i, keyed) in &changes {
        let node = &mut g.nodes[i];
        if keyed {
            let name = format!("{}/inference", node.name);
            *node = make_node(
                "Identity",
                &name,
                &[&node.input[0]],
                &[&node.output[0]],
                vec![],
            );
        } else {
            node.input.truncate(2);
            node.output.truncate(1);
        }
    }
    if !g
        .nodes
        .iter()
        .any(|n| n.input.iter().any(|v| v == DROPOUT_KEY))
    {
        g.inputs.retain(|v| v.name != DROPOUT_KEY);
    }
    changes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_salt_apart_and_the_same_everywhere() {
        assert_eq!(salt_of("/d/Dropout"), salt_of("/d/Dropout"));
        assert_ne!(salt_of("/d/Dropout"), salt_of("/d/Dropout_1"));
    }
}
