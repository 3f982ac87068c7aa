//! GPT-2's GELU, `0.5 x (1 + tanh(k (x + c x^3)))`, as one `TanhGelu` node.
//!
//! Exported (Hugging Face's `gelu_new`, pipetrain's built-in `gpt2`) it is eight nodes:
//!
//! ```text
//! cube = Pow(x, 3); small = cube * c; inner = x + small; arg = inner * k;
//! th = Tanh(arg); gate = th + 1; hx = x * 0.5; y = hx * gate
//! ```
//!
//! (each `*` and `+` in either operand order), and differentiated node by node its
//! backward is about fifteen more kernels, each a pass over the MLP's widest activation:
//! on an H200, GPT-2 small's GELUs took about 10 ms of the device's 141 ms a step
//! (Nsight Compute, 2026-11-27). Every inner value must be read by the chain alone.

use std::collections::HashMap;

use super::custom;
use crate::graph::custom_ops::TANH_GELU;
use crate::graph::ir::{float_attr, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// Replaces each float32 tanh GELU of `g` (see the module doc) by one `TanhGelu`;
/// returns how many. Imports pipetrain's domain when it replaced any.
pub fn fuse_tanh_gelu(g: &mut Graph, metas: &Metas) -> usize {
    let chains = find(g, &g.constants());
    let chains: Vec<Chain> = chains
        .into_iter()
        .filter(|c| metas.get(&c.x).is_some_and(|m| m.dtype == DType::F32))
        .collect();
    if chains.is_empty() {
        return 0;
    }
    let mut replace: HashMap<usize, NodeProto> = HashMap::new();
    let mut drop = std::collections::HashSet::new();
    for c in &chains {
        let last = &g.nodes[c.last];
        let attrs = vec![float_attr("scale", c.scale), float_attr("coef", c.coef)];
        let name = format!("{}/tanh_gelu", last.name);
        replace.insert(
            c.last,
            custom(TANH_GELU, &name, &[&c.x], &[&last.output[0]], attrs),
        );
        drop.extend(c.inner.iter().copied());
    }
    super::apply(g, replace, &drop);
    chains.len()
}

/// One tanh GELU: its input, constants, last node and the seven before it.
struct Chain {
    x: String,
    scale: f32,
    coef: f32,
    last: usize,
    inner: [usize; 7],
}

/// The tanh GELUs of `g`, found from their `Tanh` nodes.
fn find(g: &Graph, consts: &HashMap<String, Tensor>) -> Vec<Chain> {
    let consumers = g.consumers();
    let producers = g.producers();
    let scalar = |v: &str| -> Option<f32> {
        let t = consts.get(v)?;
        (t.len() == 1).then(|| t.to_f64_vec()[0] as f32)
    };
    // The node making `v`, if it is `op` and `v` has no other reader.
    let made_by = |v: &str, op: &str| -> Option<usize> {
        let &i = producers.get(v)?;
        let only = consumers.get(v).is_some_and(|r| r.len() == 1);
        (only && g.nodes[i].op_type == op && g.nodes[i].domain.is_empty()).then_some(i)
    };
    // The single reader of `v`'s value, if it is `op`.
    let read_by = |v: &str, op: &str| -> Option<usize> {
        let readers = consumers.get(v)?;
        let &[i] = readers.as_slice() else {
            return None;
        };
        (g.nodes[i].op_type == op && g.nodes[i].domain.is_empty()).then_some(i)
    };
    // For a binary node: (the other operand, the constant) where one operand is constant.
    let with_const = |n: &NodeProto| -> Option<(String, f32)> {
        let [a, b] = [&n.input[0], &n.input[1]];
        match (scalar(a), scalar(b)) {
            (None, Some(k)) => Some((a.clone(), k)),
            (Some(k), None) => Some((b.clone(), k)),
            _ => None,
        }
    };
    let other = |n: &NodeProto, v: &str| -> Option<String> {
        let [a, b] = [&n.input[0], &n.input[1]];
        (a == v)
            .then(|| b.clone())
            .or_else(|| (b == v).then(|| a.clone()))
    };
    let mut found = Vec::new();
    for (tanh, n) in g.nodes.iter().enumerate() {
        if n.op_type != "Tanh" || !n.domain.is_empty() || n.input.len() != 1 {
            continue;
        }
        let chain = (|| {
            let arg = made_by(&n.input[0], "Mul")?;
            let (inner_v, scale) = with_const(&g.nodes[arg])?;
            let add = made_by(&inner_v, "Add")?;
            let small_v = g.nodes[add]
                .input
                .iter()
                .find(|v| made_by(v, "Mul").is_some())?;
            let small = made_by(small_v, "Mul")?;
            let x = other(&g.nodes[add], small_v)?;
            let (cube_v, coef) = with_const(&g.nodes[small])?;
            let cube = made_by(&cube_v, "Pow")?;
            let p = &g.nodes[cube];
            (p.input[0] == x && scalar(&p.input[1]) == Some(3.0)).then_some(())?;
            let gate = read_by(&n.output[0], "Add")?;
            let (_, one) = with_const(&g.nodes[gate])?;
            (one == 1.0).then_some(())?;
            let last = read_by(&g.nodes[gate].output[0], "Mul")?;
            let hx_v = other(&g.nodes[last], &g.nodes[gate].output[0])?;
            let hx = made_by(&hx_v, "Mul")?;
            let (hx_x, half) = with_const(&g.nodes[hx])?;
            (hx_x == x && half == 0.5).then_some(())?;
            let inner = [cube, small, add, arg, tanh, gate, hx];
            Some(Chain {
                x,
                scale,
                coef,
                last,
                inner,
            })
        })();
        found.extend(chain);
    }
    found
}

/// `0.5 x (1 + tanh(scale (x + coef x^3)))`: `TanhGelu`'s formula, in the order its
/// kernels compute it.
pub fn tanh_gelu(x: f32, scale: f32, coef: f32) -> f32 {
    let t = (scale * (x + coef * (x * x * x))).tanh();
    0.5 * x * (1.0 + t)
}

/// Its derivative: `0.5 (1 + t) + 0.5 x (1 - t^2) scale (1 + 3 coef x^2)`.
pub fn tanh_gelu_slope(x: f32, scale: f32, coef: f32) -> f32 {
    let x2 = x * x;
    let t = (scale * (x + coef * (x2 * x))).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * scale * (1.0 + 3.0 * coef * x2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::ValueMeta;

    /// Hugging Face's GPT-2 as torch.onnx exports it (`gelu_new`, opset 17; the test
    /// fixture): each of its tanh GELUs becomes one `TanhGelu` with the export's
    /// constants, and no node of the chains is left.
    #[test]
    fn hugging_faces_gelu_new_is_found_whole() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models/gpt2/model.onnx");
        let mut g = Graph::from_model(&crate::onnx::load_model(&path).unwrap()).unwrap();
        let count = |g: &Graph, op: &str| g.nodes.iter().filter(|n| n.op_type == op).count();
        let tanhs = count(&g, "Tanh");
        let metas: Metas = g
            .nodes
            .iter()
            .flat_map(|n| &n.output)
            .map(|o| {
                (
                    o.clone(),
                    ValueMeta {
                        dtype: DType::F32,
                        shape: vec![],
                    },
                )
            })
            .collect();
        let before = g.nodes.len();
        assert!(tanhs >= 2);
        assert_eq!(fuse_tanh_gelu(&mut g, &metas), tanhs);
        assert_eq!((count(&g, "Tanh"), count(&g, "Pow")), (0, 0));
        assert_eq!(g.nodes.len(), before - 7 * tanhs);
        let fused = g.nodes.iter().find(|n| n.op_type == TANH_GELU).unwrap();
        let attr = |name: &str| fused.attribute.iter().find(|a| a.name == name).unwrap().f;
        assert!((attr("scale") - (2.0f32 / std::f32::consts::PI).sqrt()).abs() < 1e-6);
        assert!((attr("coef") - 0.044715).abs() < 1e-7);
    }
}
