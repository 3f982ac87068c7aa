//! Scaled dot-product attention, forward and backward, float32, as one kernel each.
//!
//! Exported attention is a dozen small kernels per layer in stock ONNX Runtime: the
//! transposes of Q, K and V into `[batch, heads, tokens, head dim]`, the two batched
//! products, the scale, the mask, the softmax and the transpose back; and twice as many
//! in the backward. On the tiny GPT they were a fifth of the step, mostly in copies and
//! per-kernel overhead around products of 64 x 64 x 32.
//!
//! `Attention(Q, K, V[, mask])`, attributes `scale` and the permutations `q_perm`,
//! `k_perm`, `v_perm`, `out_perm` (each `Transpose`'s `perm`, so that the transposes
//! around the products are read through strides instead of copied):
//! `q = Transpose(Q, q_perm)` is `[B, H, T, D]`, `kt = Transpose(K, k_perm)` is
//! `[B, H, D, S]` (K already turned, as the products read it), `v = Transpose(V,
//! v_perm)` is `[B, H, S, E]`; `P = Softmax(scale * q kt + mask)` over the last axis (the
//! mask broadcast to `[B, H, T, S]`), `O = Transpose(P v, out_perm)`. Outputs `O` and `P`
//! (kept for the backward, as the standard graph keeps the softmax's output). With
//! `causal = 1` the mask is the kernel's own: query `i` sees keys up to `i + S - T`
//! (the others' probabilities are 0), and the products skip what no query sees.
//!
//! `AttentionGrad(dO, Q, K, V, P)`, same attributes: `dQ, dK, dV`, each in its input's
//! layout. Per head: `dP = dO v^T`, `dS = P * (dP - rowsum(dP * P))`, `dv = P^T dO`,
//! `dq = scale * dS k`, `dk = scale * dS^T q`.
//!
//! Each (batch, head) pair is computed by one task on ONNX Runtime's intra-op threads and
//! owns its results (no sums across tasks), so results do not depend on the thread count. The
//! products are `matrixmultiply`'s strided SGEMM (vectorized for the machine, no packing
//! copies of our own); the softmax rows are the `Softmax` kernel's. Not bitwise the
//! standard graph: the products sum in another order (within float32 rounding, tested).

use std::sync::Mutex;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

mod head;
mod layout;

use super::{input, output};
use crate::graph::custom_ops::{ATTENTION, ATTENTION_GRAD};
use head::{Mask, Pair};
use layout::{mask_strides, Shared, View};

/// At most this many tasks a call (each a run of (batch, head) pairs).
const TASKS: usize = 16;

/// The attributes of a call (see the module doc).
#[derive(Debug, Clone, Copy)]
struct Attributes {
    scale: f32,
    causal: bool,
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    out: [usize; 4],
}

impl Attributes {
    fn of(info: &KernelContext<'_>, op: &str) -> ort::Result<Self> {
        let perm = |name: &str| -> ort::Result<[usize; 4]> {
            let v = info
                .get::<Vec<i64>>(name)
                .unwrap_or_else(|| vec![0, 1, 2, 3]);
            let mut p = [0usize; 4];
            let mut seen = [false; 4];
            for (i, &a) in v.iter().enumerate().take(4) {
                if (0..4).contains(&a) && !seen[a as usize] {
                    seen[a as usize] = true;
                    p[i] = a as usize;
                }
            }
            if v.len() != 4 || seen.contains(&false) {
                return Err(ort::Error::new(format!(
                    "{op}: attribute {name} = {v:?} (want a permutation of 0..4)"
                )));
            }
            Ok(p)
        };
        Ok(Self {
            scale: info.get::<f32>("scale").unwrap_or(1.0),
            causal: info.get::<i64>("causal").unwrap_or(0) != 0,
            q: perm("q_perm")?,
            k: perm("k_perm")?,
            v: perm("v_perm")?,
            out: perm("out_perm")?,
        })
    }
}

/// Runs `task(bh, scratch)` for each of `pairs` (batch, head) pairs, in up to [`TASKS`]
/// runs on ONNX Runtime's intra-op threads, each with its own `scratch` values.
fn per_pair(
    ctx: &ComputeContext,
    pairs: usize,
    scratch: usize,
    task: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> ort::Result<()> {
    let runs = pairs.clamp(1, TASKS);
    let per = pairs.div_ceil(runs);
    let buffers: Vec<Mutex<Vec<f32>>> = (0..runs).map(|_| Mutex::new(Vec::new())).collect();
    ctx.par_for(runs, runs, |r| {
        if let Ok(mut buffer) = buffers[r].lock() {
            buffer.resize(scratch, 0.0);
            for bh in r * per..((r + 1) * per).min(pairs) {
                task(bh, &mut buffer);
            }
        }
    })
}

/// The logical views of `Q`, `K` (turned), `V` and their agreement: `[B, H, T, D]`,
/// `[B, H, D, S]`, `[B, H, S, E]`.
fn views(op: &str, a: &Attributes, shapes: [&[i64]; 3]) -> ort::Result<[View; 3]> {
    let bad = || {
        ort::Error::new(format!(
            "{op}: Q {:?}, K {:?}, V {:?} with permutations {:?}, {:?}, {:?} are not \
             [B, H, T, D], [B, H, D, S], [B, H, S, E]",
            shapes[0], shapes[1], shapes[2], a.q, a.k, a.v
        ))
    };
    let (Some(q), Some(k), Some(v)) = (
        View::of(shapes[0], a.q),
        View::of(shapes[1], a.k),
        View::of(shapes[2], a.v),
    ) else {
        return Err(bad());
    };
    let agree = q.dims[..2] == k.dims[..2]
        && k.dims[..2] == v.dims[..2]
        && q.dims[3] == k.dims[2]
        && k.dims[3] == v.dims[2];
    if !agree {
        return Err(bad());
    }
    Ok([q, k, v])
}

/// `Attention` or its backward `AttentionGrad` (see the module doc).
#[derive(Clone, Copy)]
pub(crate) struct AttentionOp {
    backward: bool,
}

/// Scaled dot-product attention as one kernel.
pub(crate) const ATTENTION_OP: AttentionOp = AttentionOp { backward: false };
/// Its backward as one kernel.
pub(crate) const ATTENTION_GRAD_OP: AttentionOp = AttentionOp { backward: true };

impl Operator for AttentionOp {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        if self.backward {
            ATTENTION_GRAD
        } else {
            ATTENTION
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let f32 = TensorElementType::Float32;
        // `Q, K, V[, mask]`; backward `dO, Q, K, V, P`.
        let (required, optional) = if self.backward { (5, 0) } else { (3, 1) };
        let required = (0..required).map(move |_| OperatorInput::required(f32));
        required.chain((0..optional).map(move |_| OperatorInput::optional(f32)))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        let n = if self.backward { 3 } else { 2 };
        (0..n).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let (op, a) = (*self, Attributes::of(info, self.name())?);
        Ok(Box::new(move |ctx: &ComputeContext| match op.backward {
            true => backward(ctx, &a),
            false => forward(ctx, &a),
        }))
    }
}

fn forward(ctx: &ComputeContext, a: &Attributes) -> ort::Result<()> {
    let op = ATTENTION;
    let (q_in, k_in, v_in) = (input(ctx, op, 0)?, input(ctx, op, 1)?, input(ctx, op, 2)?);
    let (q_shape, q) = q_in.try_extract_tensor::<f32>()?;
    let (k_shape, k) = k_in.try_extract_tensor::<f32>()?;
    let (v_shape, v) = v_in.try_extract_tensor::<f32>()?;
    let [qv, kv, vv] = views(op, a, [q_shape, k_shape, v_shape])?;
    let [b, h, t, _] = qv.dims;
    let (s, e) = (kv.dims[3], vv.dims[3]);
    let mask_in = match ctx.num_inputs()? > 3 {
        true => ctx.input(3)?,
        false => None,
    };
    let mask = match &mask_in {
        Some(m) => {
            let (shape, values) = m.try_extract_tensor::<f32>()?;
            let strides = mask_strides(shape, [b, h, t, s]).ok_or_else(|| {
                ort::Error::new(format!(
                    "{op}: a mask of {shape:?} for scores [{b}, {h}, {t}, {s}]"
                ))
            })?;
            Some((strides, values))
        }
        None => None,
    };
    let (out_shape, ov) = View::made([b, h, t, e], a.out);
    let mut out = output(ctx, op, 0, &out_shape)?;
    let (_, out) = out.try_extract_tensor_mut::<f32>()?;
    let mut probs = output(ctx, op, 1, &[b as i64, h as i64, t as i64, s as i64])?;
    let (_, probs) = probs.try_extract_tensor_mut::<f32>()?;
    let (out, probs) = (Shared(out.as_mut_ptr()), Shared(probs.as_mut_ptr()));
    let mask = mask.map(|(strides, values)| Mask { strides, values });
    let pair = Pair {
        a,
        q: (q, qv),
        k: (k, kv),
        v: (v, vv),
    };
    per_pair(ctx, b * h, s, |bh, row| {
        pair.forward(bh, mask.as_ref(), (out, ov), probs, row)
    })
}

fn backward(ctx: &ComputeContext, a: &Attributes) -> ort::Result<()> {
    let op = ATTENTION_GRAD;
    let values = (0..5)
        .map(|i| input(ctx, op, i))
        .collect::<ort::Result<Vec<_>>>()?;
    let mut tensors = Vec::with_capacity(5);
    for v in &values {
        tensors.push(v.try_extract_tensor::<f32>()?);
    }
    let [(do_shape, d_out), (q_shape, q), (k_shape, k), (v_shape, v), (p_shape, p)] =
        <[_; 5]>::try_from(tensors).map_err(|_| ort::Error::new(format!("{op}: 5 inputs")))?;
    let [qv, kv, vv] = views(op, a, [q_shape, k_shape, v_shape])?;
    let [b, h, t, _] = qv.dims;
    let (s, e) = (kv.dims[3], vv.dims[3]);
    let (want_do, ov) = View::made([b, h, t, e], a.out);
    let want_p = [b, h, t, s].map(|x| x as i64);
    if do_shape[..] != want_do[..] || p_shape[..] != want_p[..] {
        return Err(ort::Error::new(format!(
            "{op}: dO {do_shape:?} and P {p_shape:?} (want {want_do:?} and {want_p:?})"
        )));
    }
    let mut grads = Vec::with_capacity(3);
    for (i, shape) in [q_shape, k_shape, v_shape].into_iter().enumerate() {
        grads.push(output(ctx, op, i, shape)?);
    }
    let mut ptrs = Vec::with_capacity(3);
    for g in &mut grads {
        ptrs.push(Shared(g.try_extract_tensor_mut::<f32>()?.1.as_mut_ptr()));
    }
    let grads = [ptrs[0], ptrs[1], ptrs[2]];
    let pair = Pair {
        a,
        q: (q, qv),
        k: (k, kv),
        v: (v, vv),
    };
    per_pair(ctx, b * h, 2 * t * s, |bh, scratch| {
        pair.backward(bh, (d_out, ov), p, grads, scratch)
    })
}
