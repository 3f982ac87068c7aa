//! Emitting backward nodes: unique names, constants, and the few compound patterns that
//! many gradient rules share (un-broadcasting, reshaping like a forward value).

use std::collections::HashMap;

use crate::graph::ir::{float_attr, int_attr, ints_attr, make_node, tensor_attr};
use crate::onnx::proto::{AttributeProto, NodeProto};
use crate::tensor::{DType, Tensor, TensorData};

/// Collects the backward nodes; each node records the forward node it belongs to (its
/// anchor), which is how the stage partition places backward work.
#[derive(Debug, Default)]
pub struct Emitter {
    /// Emitted nodes.
    pub nodes: Vec<NodeProto>,
    /// For each emitted node, the index of its forward anchor node.
    pub anchors: Vec<usize>,
    anchor: usize,
    prefix: String,
    counter: usize,
    /// Use ONNX Runtime's `com.microsoft.FusedMatMul` for transposed products.
    pub contrib: bool,
    /// Whether a `com.microsoft` node was emitted (the domain must then be imported).
    pub used_contrib: bool,
    /// Emit pipetrain's fused kernels where their pattern appears (see
    /// [`crate::graph::custom_ops`]).
    pub fused: bool,
    /// Emit those of pipetrain's kernels that run on ONNX Runtime's CUDA provider
    /// (softmax's backward).
    pub cuda: bool,
    /// Emit too those not yet run on a GPU (LayerNorm's backward;
    /// `runtime.cuda_kernels_untried`).
    pub cuda_untried: bool,
    /// Whether one of pipetrain's own nodes was emitted (its domain must be imported).
    pub used_custom: bool,
    /// Each `Reshape` emitted: `(input, shape)` to its output, so that the same reshape
    /// asked for again (a layer's output gradient flattened for both its weight and its
    /// bias) is one node.
    reshapes: HashMap<(String, Vec<usize>), String>,
    /// Each emitted `Reshape`'s output to its input and anchor, so that a reshape of it
    /// under the same anchor reads that input instead (one node, not two).
    reshaped: HashMap<String, (String, usize)>,
    /// Each `Pad` a gradient rule emitted through [`Emitter::pad`] (a `Slice`'s
    /// gradient), so that a sum of them can be a `Concat` (`super::sums`).
    pub(super) padded: HashMap<String, super::sums::Padded>,
}

impl Emitter {
    /// An emitter; `contrib` allows ONNX Runtime's contrib ops.
    pub fn new(contrib: bool) -> Emitter {
        Emitter {
            contrib,
            ..Default::default()
        }
    }

    /// Subsequent nodes belong to forward node `anchor`, named under `prefix`.
    pub fn set_anchor(&mut self, anchor: usize, prefix: &str) {
        self.anchor = anchor;
        self.prefix = prefix.to_string();
    }

    /// A fresh value name.
    pub fn fresh(&mut self, hint: &str) -> String {
        self.counter += 1;
        format!("grad/{}/{}_{}", self.prefix, hint, self.counter)
    }

    /// Emits a node with explicit outputs.
    pub fn node(
        &mut self,
        op: &str,
        domain: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) {
        let name = format!("grad/{}/{}_{}", self.prefix, op, self.counter);
        self.counter += 1;
        let mut n = make_node(op, &name, inputs, outputs, attrs);
        n.domain = domain.into();
        if domain == "com.microsoft" {
            self.used_contrib = true;
        }
        if domain == crate::graph::custom_ops::DOMAIN {
            self.used_custom = true;
        }
        self.nodes.push(n);
        self.anchors.push(self.anchor);
    }

    /// Emits a one-output node of the default domain and returns its output.
    pub fn op(&mut self, op: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        let out = self.fresh(op);
        self.node(op, "", inputs, &[&out], attrs);
        out
    }

    /// Emits one of pipetrain's own operators (`graph::custom_ops`) with one output and
    /// returns it.
    pub fn custom_op(&mut self, op: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        let out = self.fresh(op);
        self.node(op, crate::graph::custom_ops::DOMAIN, inputs, &[&out], attrs);
        out
    }

    /// Emits a node with `n` outputs and returns them.
    pub fn op_n(
        &mut self,
        op: &str,
        inputs: &[&str],
        n: usize,
        attrs: Vec<AttributeProto>,
    ) -> Vec<String> {
        let outs: Vec<String> = (0..n).map(|_| self.fresh(op)).collect();
        let refs: Vec<&str> = outs.iter().map(String::as_str).collect();
        self.node(op, "", inputs, &refs, attrs);
        outs
    }

    /// A `Constant` node holding `t`.
    pub fn constant(&mut self, t: Tensor) -> String {
        let out = self.fresh("const");
        let proto = t.to_proto(&out);
        self.node(
            "Constant",
            "",
            &[],
            &[&out],
            vec![tensor_attr("value", proto)],
        );
        out
    }

    /// An int64 vector constant (axes, shapes, perms).
    pub fn ints(&mut self, v: &[i64]) -> String {
        self.constant(Tensor {
            shape: vec![v.len()],
            data: TensorData::I64(v.to_vec()),
        })
    }

    /// A zero tensor of a static shape, made at run time (`ConstantOfShape`: no large
    /// constant in the graph).
    pub fn zeros(&mut self, dims: &[usize], dtype: DType) -> String {
        let shape = self.ints(&dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let value = Tensor::zeros(dtype, vec![1]).to_proto("value");
        self.op(
            "ConstantOfShape",
            &[&shape],
            vec![tensor_attr("value", value)],
        )
    }

    /// A scalar constant of a float type.
    pub fn scalar(&mut self, v: f64, dtype: DType) -> String {
        let data = match dtype {
            DType::F64 => TensorData::F64(vec![v]),
            _ => TensorData::F32(vec![v as f32]),
        };
        self.constant(Tensor {
            shape: vec![],
            data,
        })
    }

    /// `a * b` (elementwise, broadcasting).
    pub fn mul(&mut self, a: &str, b: &str) -> String {
        self.op("Mul", &[a, b], vec![])
    }

    /// `x * c` for a scalar constant `c`.
    pub fn scale(&mut self, x: &str, c: f64, dtype: DType) -> String {
        if c == 1.0 {
            return x.to_string();
        }
        let k = self.scalar(c, dtype);
        self.mul(x, &k)
    }

    /// `ReduceSum(x, axes)`.
    pub fn reduce_sum(&mut self, x: &str, axes: &[i64], keepdims: bool) -> String {
        let axes = self.ints(axes);
        self.op(
            "ReduceSum",
            &[x, &axes],
            vec![int_attr("keepdims", keepdims as i64)],
        )
    }

    /// `Reshape(x, shape)` with a constant shape.
    ///
    /// One node per `(input, shape)`, however often asked for; a reshape of a reshape
    /// emitted for the same forward node reads the first one's input. (Shapes here are
    /// whole, so a `Reshape` depends on its input's values only, not its shape. The
    /// node kept was emitted first, so it is at the same pipeline stage or a later one:
    /// its output flows the way gradients do.)
    pub fn reshape(&mut self, x: &str, shape: &[usize]) -> String {
        let x = match self.reshaped.get(x) {
            Some((source, anchor)) if *anchor == self.anchor => source.clone(),
            _ => x.to_string(),
        };
        let key = (x, shape.to_vec());
        if let Some(out) = self.reshapes.get(&key) {
            return out.clone();
        }
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let s = self.ints(&dims);
        let out = self.op("Reshape", &[&key.0, &s], vec![]);
        self.reshaped
            .insert(out.clone(), (key.0.clone(), self.anchor));
        self.reshapes.insert(key, out.clone());
        out
    }

    /// `Reshape(g, Shape(like))`: the shape comes from the value at run time.
    pub fn reshape_like(&mut self, g: &str, like: &str) -> String {
        let s = self.op("Shape", &[like], vec![]);
        self.op("Reshape", &[g, &s], vec![])
    }

    /// Sums `g` (of shape `from`) down to `to`, undoing numpy-style broadcasting.
    pub fn unbroadcast(&mut self, g: &str, from: &[usize], to: &[usize], dtype: DType) -> String {
        if from == to {
            return g.to_string();
        }
        let lead = from.len() - to.len().min(from.len());
        let mut axes: Vec<i64> = (0..lead as i64).collect();
        for (i, &d) in to.iter().enumerate() {
            if d == 1 && from[lead + i] != 1 {
                axes.push((lead + i) as i64);
            }
        }
        let k = axes.len();
        let (summed, shape) = if axes.is_empty() {
            (g.to_string(), from.to_vec())
        } else if axes.iter().enumerate().all(|(i, &a)| a == i as i64) {
            (self.sum_leading(g, from, k, dtype), from[k..].to_vec())
        } else {
            let mut kept = from.to_vec();
            axes.iter().for_each(|&a| kept[a as usize] = 1);
            (self.reduce_sum(g, &axes, true), kept)
        };
        match shape == to {
            true => summed,
            false => self.reshape(&summed, to),
        }
    }

    /// Sums over the first `k` axes of `g` (of shape `from`); the result has shape
    /// `from[k..]`. Written as a row of ones times `g` seen as a matrix: ONNX Runtime's
    /// CPU ReduceSum over leading axes ran 14x slower than that product (296 vs 21 us for
    /// a bias gradient of tiny_gpt's MLP, [8, 64, 512] -> [512]).
    pub fn sum_leading(&mut self, g: &str, from: &[usize], k: usize, dtype: DType) -> String {
        let rows: usize = from[..k].iter().product();
        let cols: usize = from[k..].iter().product();
        let data = match dtype {
            DType::F64 => TensorData::F64(vec![1.0; rows]),
            _ => TensorData::F32(vec![1.0; rows]),
        };
        // A vector first operand: the product is `[cols]`, no axis to drop.
        let ones = self.constant(Tensor {
            shape: vec![rows],
            data,
        });
        let m = self.reshape(g, &[rows, cols]);
        let s = self.op("MatMul", &[&ones, &m], vec![]);
        match from[k..] == [cols] {
            true => s,
            false => self.reshape(&s, &from[k..]),
        }
    }

    /// `alpha * op(a) @ op(b)` where `op` transposes the last two axes when asked; `ra`/`rb`
    /// are the operands' ranks. Uses `com.microsoft.FusedMatMul` when contrib ops are
    /// allowed (one kernel, no transposed copy), else Transpose + MatMul (+ Mul).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_t(
        &mut self,
        (a, ra): (&str, usize),
        (b, rb): (&str, usize),
        ta: bool,
        tb: bool,
        alpha: f64,
        dtype: DType,
    ) -> String {
        if self.contrib && (ta || tb || alpha != 1.0) {
            let out = self.fresh("FusedMatMul");
            self.node(
                "FusedMatMul",
                "com.microsoft",
                &[a, b],
                &[&out],
                vec![
                    int_attr("transA", ta as i64),
                    int_attr("transB", tb as i64),
                    float_attr("alpha", alpha as f32),
                ],
            );
            return out;
        }
        let a = if ta {
            self.swap_last(a, ra)
        } else {
            a.to_string()
        };
        let b = if tb {
            self.swap_last(b, rb)
        } else {
            b.to_string()
        };
        let y = self.op("MatMul", &[&a, &b], vec![]);
        self.scale(&y, alpha, dtype)
    }

    /// `x` split on `axis` into parts of `sizes`; one part is `x` itself.
    pub fn split(&mut self, x: &str, axis: i64, sizes: &[usize]) -> Vec<String> {
        if sizes.len() == 1 {
            return vec![x.to_string()];
        }
        let s = self.ints(&sizes.iter().map(|&n| n as i64).collect::<Vec<_>>());
        self.op_n("Split", &[x, &s], sizes.len(), vec![int_attr("axis", axis)])
    }

    /// `parts` joined on `axis`; one part is itself.
    pub fn concat(&mut self, parts: &[String], axis: i64) -> String {
        if let [one] = parts {
            return one.clone();
        }
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        self.op("Concat", &refs, vec![int_attr("axis", axis)])
    }

    /// Transposes the last two axes of a value of rank `rank`.
    pub fn swap_last(&mut self, x: &str, rank: usize) -> String {
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        self.op("Transpose", &[x], vec![ints_attr("perm", &perm)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reshapes(e: &Emitter) -> Vec<&NodeProto> {
        e.nodes.iter().filter(|n| n.op_type == "Reshape").collect()
    }

    #[test]
    fn a_reshape_asked_for_twice_is_one_node_and_a_chain_under_one_node_reads_its_source() {
        let mut e = Emitter::new(false);
        e.set_anchor(3, "layer");
        let flat = e.reshape("dY", &[32, 16]);
        assert_eq!(e.reshape("dY", &[32, 16]), flat);
        // Under the same forward node, a reshape of `flat` reads `dY` itself.
        let back = e.reshape(&flat, &[2, 16, 16]);
        assert_eq!(reshapes(&e)[1].input[0], "dY");
        assert_ne!(back, flat);
        // Under another node it reads `flat` (its stage may differ).
        e.set_anchor(2, "other");
        e.reshape(&flat, &[4, 8, 16]);
        assert_eq!(reshapes(&e)[2].input[0], flat);
        assert_eq!(reshapes(&e).len(), 3);
    }

    #[test]
    fn a_bias_gradient_is_one_product_with_no_reshape_after_it() {
        let mut e = Emitter::new(false);
        let db = e.unbroadcast("dY", &[2, 16, 8], &[8], DType::F32);
        let ops: Vec<&str> = e.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Constant", "Constant", "Reshape", "MatMul"]);
        assert_eq!(e.nodes[3].output[0], db);
        // Summed over a middle axis, kept as 1: the reduction's own shape, no reshape.
        let mut e = Emitter::new(false);
        e.unbroadcast("dY", &[2, 16, 8], &[2, 1, 8], DType::F32);
        let ops: Vec<&str> = e.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert!(!ops.contains(&"Reshape"), "{ops:?}");
    }
}
