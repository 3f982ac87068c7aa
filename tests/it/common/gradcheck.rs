//! Gradient checks against central finite differences.
//!
//! A small graph (usually one node) gets a loss `sum_k sum(Y_k * R_k)` with fixed random
//! `R_k`, so every output element's gradient matters and none cancels. pipetrain's
//! backward gives the analytic gradient of each checked input; the reference is
//! `(L(x + h e_i) - L(x - h e_i)) / 2h`, evaluated by ONNX Runtime on the forward graph.
#![allow(dead_code)]

use pipetrain::compute::{Runtime, SessionOptions, TensorMap, TrainSession};
use pipetrain::graph::{build_training_graph, LossSpec, TrainOptions};
use pipetrain::graph::{int_attr, make_node, untyped_value_info};
use pipetrain::onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
};
use pipetrain::tensor::{DType, Tensor, TensorData};

/// Deterministic uniform numbers in [lo, hi) (xorshift; tests need no crate for this).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
    /// A tensor of `dtype` with elements in [lo, hi).
    pub fn tensor(&mut self, dtype: DType, shape: &[usize], lo: f64, hi: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.uniform(lo, hi)).collect();
        let data = match dtype {
            DType::F64 => TensorData::F64(v),
            DType::F32 => TensorData::F32(v.iter().map(|&x| x as f32).collect()),
            _ => panic!("random tensors are float"),
        };
        Tensor::new(shape.to_vec(), data).unwrap()
    }
    /// Like `tensor`, but every element at least `gap` away from 0 (kinks of Relu & co).
    pub fn away_from_zero(&mut self, dtype: DType, shape: &[usize], gap: f64) -> Tensor {
        let mut t = self.tensor(DType::F64, shape, -1.0, 1.0);
        if let TensorData::F64(v) = &mut t.data {
            for x in v.iter_mut() {
                *x = x.signum() * (gap + x.abs());
            }
        }
        cast(&t, dtype)
    }
}

/// A float tensor converted to `dtype`.
pub fn cast(t: &Tensor, dtype: DType) -> Tensor {
    let v = t.to_f64_vec();
    let data = match dtype {
        DType::F64 => TensorData::F64(v),
        DType::F32 => TensorData::F32(v.iter().map(|&x| x as f32).collect()),
        _ => panic!("cast to float only"),
    };
    Tensor::new(t.shape.clone(), data).unwrap()
}

/// Step and tolerance of a check.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub step: f64,
    pub rtol: f64,
    pub atol: f64,
}

/// float64 graphs: h = 1e-6 gives truncation error ~1e-12 and rounding ~1e-10 relative,
/// far inside the required 1e-4.
pub const F64: Tol = Tol {
    step: 1e-6,
    rtol: 1e-4,
    atol: 1e-9,
};

/// float32 graphs (ops ONNX Runtime has no double kernel for): with h = 1e-2 the central
/// difference's truncation error (h^2 |f'''| / 6 ~ 2e-5 for these smooth ops) and its
/// rounding error (eps_f32 |L| / h ~ 1e-5 |L|, with |L| <= ~10 here) stay below 1e-3;
/// 2e-3 relative plus 2e-3 absolute leaves room for that and nothing more.
pub const F32: Tol = Tol {
    step: 1e-2,
    rtol: 2e-3,
    atol: 2e-3,
};

/// A graph to check.
pub struct GradCheck {
    nodes: Vec<NodeProto>,
    inits: Vec<(String, Tensor)>,
    wrt: Vec<String>,
    outputs: Vec<String>,
    opset: i64,
    contrib: bool,
    seed: u64,
}

impl GradCheck {
    pub fn new(opset: i64) -> GradCheck {
        GradCheck {
            nodes: vec![],
            inits: vec![],
            wrt: vec![],
            outputs: vec![],
            opset,
            contrib: true,
            seed: 7,
        }
    }
    /// A tensor whose gradient is checked.
    pub fn param(mut self, name: &str, t: Tensor) -> Self {
        self.inits.push((name.into(), t));
        self.wrt.push(name.into());
        self
    }
    /// A constant (axes, shapes, indices, conditions...).
    pub fn constant(mut self, name: &str, t: Tensor) -> Self {
        self.inits.push((name.into(), t));
        self
    }
    pub fn node(
        mut self,
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> Self {
        let name = format!("n{}", self.nodes.len());
        self.nodes
            .push(make_node(op, &name, inputs, outputs, attrs));
        self
    }
    /// Values the loss reads (default: every output of the last node).
    pub fn loss_of(mut self, outputs: &[&str]) -> Self {
        self.outputs = outputs.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn without_contrib(mut self) -> Self {
        self.contrib = false;
        self
    }

    /// The model: the nodes, then `loss = sum_k ReduceSum(Y_k * R_k)`.
    fn model(&self, rt: &Runtime) -> Result<(ModelProto, Vec<(String, Tensor)>), String> {
        let outputs = if self.outputs.is_empty() {
            self.nodes
                .last()
                .unwrap()
                .output
                .iter()
                .filter(|o| !o.is_empty())
                .cloned()
                .collect()
        } else {
            self.outputs.clone()
        };
        // Measure output shapes with a plain forward model.
        let mut g = GraphProto {
            name: "check".into(),
            node: self.nodes.clone(),
            ..Default::default()
        };
        g.initializer = self.inits.iter().map(|(n, t)| t.to_proto(n)).collect();
        g.output = outputs.iter().map(|o| untyped_value_info(o)).collect();
        let mut model = ModelProto {
            ir_version: 8,
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: self.opset,
            }],
            graph: Some(g),
            ..Default::default()
        };
        let graph = pipetrain::graph::Graph::from_model(&model).map_err(|e| e.to_string())?;
        let metas = pipetrain::compute::probe_values(rt, &graph, &[]).map_err(|e| e.to_string())?;
        let mut rng = Rng::new(self.seed + 1000);
        let g = model.graph.as_mut().unwrap();
        let mut terms = Vec::new();
        let mut weights = Vec::new();
        for (k, o) in outputs.iter().enumerate() {
            let m = &metas[o];
            let r = rng.tensor(m.dtype, &m.shape, -1.0, 1.0);
            let rn = format!("R{k}");
            g.initializer.push(r.to_proto(&rn));
            weights.push((rn.clone(), r));
            g.node.push(make_node(
                "Mul",
                &format!("lm{k}"),
                &[o, &rn],
                &[&format!("ly{k}")],
                vec![],
            ));
            g.node.push(make_node(
                "ReduceSum",
                &format!("ls{k}"),
                &[&format!("ly{k}")],
                &[&format!("lt{k}")],
                vec![int_attr("keepdims", 0)],
            ));
            terms.push(format!("lt{k}"));
        }
        let mut acc = terms[0].clone();
        for (k, t) in terms.iter().enumerate().skip(1) {
            let out = format!("lacc{k}");
            g.node
                .push(make_node("Add", &out, &[&acc, t], &[&out], vec![]));
            acc = out;
        }
        g.node
            .push(make_node("Identity", "total", &[&acc], &["total"], vec![]));
        g.output = vec![untyped_value_info("total")];
        Ok((model, weights))
    }

    /// Runs the check; returns the worst `|analytic - numeric| / (rtol |numeric| + atol)`
    /// (<= 1 passes) or a description of the first failure.
    pub fn run(&self, rt: &Runtime, tol: Tol) -> Result<f64, String> {
        let (model, _) = self.model(rt)?;
        let opts = TrainOptions {
            inputs: Default::default(),
            loss: LossSpec::Output {
                name: "total".into(),
            },
            trainable: Some(self.wrt.clone()),
            contrib_ops: self.contrib,
            fused_kernels: self.contrib,
            cuda_kernels: false,
            cuda_kernels_untried: false,
            flash_attention: false,
            params: Default::default(),
        };
        let tg = build_training_graph(rt, &model, &opts, &[]).map_err(|e| e.to_string())?;
        let mut session = TrainSession::new(
            rt,
            &tg,
            &SessionOptions {
                intra_threads: 1,
                inter_threads: 1,
                optimize: true,
                spin: false,
                profile: false,
                device: pipetrain::compute::Device::Cpu,
                deterministic: true,
                mixed_precision: None,
                state_on_device: true,
                device_path_on_host: false,
                cuda_kernels: true,
                cuda_graph: false,
            },
        )
        .map_err(|e| e.to_string())?;
        let mut params = super::initial_params(&tg);
        let data = TensorMap::new();
        let dtype = tg.params[0].meta.dtype;
        let loss_dtype = tg.metas["loss"].dtype;
        let seed = cast(&Tensor::f64(vec![], vec![1.0]).unwrap(), loss_dtype);
        let out = session
            .step(&params, &data, &seed)
            .map_err(|e| e.to_string())?;
        let mut worst: f64 = 0.0;
        for w in &self.wrt {
            let analytic = out
                .grads
                .get(w)
                .ok_or(format!("no gradient for `{w}`"))?
                .to_f64_vec();
            let n = analytic.len();
            // At most 40 elements per tensor, spread over it.
            let picks: Vec<usize> = if n <= 40 {
                (0..n).collect()
            } else {
                (0..40).map(|i| i * n / 40).collect()
            };
            for i in picks {
                let base = params[w].clone();
                let at = |delta: f64, params: &mut TensorMap, session: &mut TrainSession| -> f64 {
                    let mut v = base.to_f64_vec();
                    v[i] += delta;
                    let mut t = cast(&Tensor::f64(base.shape.clone(), v).unwrap(), dtype);
                    std::mem::swap(params.get_mut(w).unwrap(), &mut t);
                    let l = session.step(params, &data, &seed).unwrap().loss;
                    *params.get_mut(w).unwrap() = base.clone();
                    l
                };
                let numeric = (at(tol.step, &mut params, &mut session)
                    - at(-tol.step, &mut params, &mut session))
                    / (2.0 * tol.step);
                let err = (analytic[i] - numeric).abs() / (tol.rtol * numeric.abs() + tol.atol);
                if err > 1.0 {
                    return Err(format!(
                        "d loss / d {w}[{i}]: analytic {:.9e}, finite difference {numeric:.9e}",
                        analytic[i]
                    ));
                }
                worst = worst.max(err);
            }
        }
        Ok(worst)
    }
}

/// Runs one check, panicking with `name` and the failure; prints how close it came.
pub fn check(name: &str, case: GradCheck, tol: Tol) {
    let rt = super::runtime();
    match case.run(&rt, tol) {
        Ok(worst) => eprintln!("{name}: worst error {worst:.3} of tolerance"),
        Err(e) => panic!("{name}: {e}"),
    }
}

/// An int64 vector constant (axes, shapes, pads).
pub fn ints(v: &[i64]) -> Tensor {
    Tensor::i64(vec![v.len()], v.to_vec()).unwrap()
}
