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
//! `PackedAttention(QKV[, mask])`: the same with Q, K and V the parts of one `[B, T, W]`
//! tensor's last axis (a fused projection's output, before PyTorch's `split`), attributes
//! `heads_dim` (`[H, D]`) and `offsets` (where each part starts), each part read as
//! `[B, T, H, D]` before its permutation: no `Split`, `Reshape` or (backward) `Concat`.
//!
//! With `lse = 1` the forward's second output is each query row's log-sum-exp of its
//! scores, `L`, `[B, H, T]`, instead of `P` (the flash kernels' form on a GPU,
//! `compute/kernels/flash.rs`: no `[B, H, T, S]` kept between forward and backward).
//!
//! `AttentionGrad(dO, Q, K, V, P)`, same attributes: `dQ, dK, dV`, each in its input's
//! layout (`PackedAttentionGrad(dO, QKV, P)`: one `dQKV`). With `lse`:
//! `AttentionGrad(dO, Q, K, V, L, O[, mask])`, `P = exp(S - L)` computed again (here a
//! pair at a time; `O` is the GPU kernels' `rowsum(dP P) = rowsum(dO O)`). Per head: `dP = dO v^T`, `dS = P * (dP - rowsum(dP * P))`, `dv = P^T dO`,
//! `dq = scale * dS k`, `dk = scale * dS^T q`.
//!
//! Each (batch, head) pair is computed by one task on ONNX Runtime's intra-op threads and
//! owns its results (no sums across tasks), so results do not depend on the thread count. The
//! products are the session's BLAS where it has one (`compute::blas`; products of 2^18
//! multiply-adds and more, without a causal mask), else `matrixmultiply`'s strided SGEMM
//! (vectorized for the machine, no packing copies of our own); the softmax rows are the
//! `Softmax` kernel's. Not bitwise the
//! standard graph: the products sum in another order (within float32 rounding, tested).

use std::sync::{Arc, Mutex, TryLockError};

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

mod attributes;
mod head;
mod layout;

use super::{input, output};
use crate::compute::blas::Blas;
use crate::graph::custom_ops::{
    ATTENTION, ATTENTION_GRAD, PACKED_ATTENTION, PACKED_ATTENTION_GRAD,
};
pub(crate) use attributes::{views, Attributes};
use head::{Mask, Pair};
use layout::Shared;
pub(crate) use layout::{mask_strides, View};

/// At most this many tasks a call (each a run of (batch, head) pairs).
const TASKS: usize = 16;

/// Scratch values of the attention kernels' tasks, one buffer per task, kept from call to
/// call (no allocation per call once they have grown to size) and shared by every
/// attention node of a session ([`AttentionOp::sharing`]): the nodes of a session run one
/// after another, so the scratch is one node's, not one per node (for GPT-2 small at
/// 1024 tokens, 96 MiB against 1.1 GiB kept by twelve backward nodes).
pub(crate) type Scratch = Vec<Mutex<Vec<f32>>>;

/// Scratch for [`AttentionOp::sharing`].
pub(crate) fn attention_scratch() -> Arc<Scratch> {
    Arc::new((0..TASKS).map(|_| Mutex::new(Vec::new())).collect())
}

/// Runs `task(bh, scratch)` for each of `pairs` (batch, head) pairs, in up to [`TASKS`]
/// runs on ONNX Runtime's intra-op threads, each with `len` values of its own `scratch`.
fn per_pair(
    ctx: &ComputeContext,
    (scratch, len): (&Scratch, usize),
    pairs: usize,
    task: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> ort::Result<()> {
    let runs = pairs.clamp(1, scratch.len());
    let per = pairs.div_ceil(runs);
    ctx.par_for(runs, runs, |r| {
        // A buffer is only scratch: one a failed task left behind is as good as any. One
        // another call holds (nodes run at once) leaves this task its own, for this call.
        let (mut own, mut kept) = (Vec::new(), None);
        match scratch[r].try_lock() {
            Ok(b) => kept = Some(b),
            Err(TryLockError::Poisoned(e)) => kept = Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        let buffer: &mut Vec<f32> = kept.as_deref_mut().unwrap_or(&mut own);
        buffer.resize(len, 0.0);
        for bh in r * per..((r + 1) * per).min(pairs) {
            task(bh, &mut buffer[..len]);
        }
    })
}

/// `Attention` or its backward `AttentionGrad`, each also on one packed `Q, K, V`
/// tensor (`PackedAttention`, `PackedAttentionGrad`; see the module doc).
#[derive(Clone)]
pub(crate) struct AttentionOp {
    backward: bool,
    packed: bool,
    /// The BLAS each head's products run on, where the session has one.
    blas: Option<Arc<Blas>>,
    /// The session's attention scratch, where it shares one.
    scratch: Option<Arc<Scratch>>,
}

/// Scaled dot-product attention as one kernel.
pub(crate) const ATTENTION_OP: AttentionOp = AttentionOp {
    backward: false,
    packed: false,
    blas: None,
    scratch: None,
};
/// Its backward as one kernel.
pub(crate) const ATTENTION_GRAD_OP: AttentionOp = AttentionOp {
    backward: true,
    packed: false,
    blas: None,
    scratch: None,
};
/// Attention on a packed `Q, K, V` tensor.
pub(crate) const PACKED_ATTENTION_OP: AttentionOp = AttentionOp {
    backward: false,
    packed: true,
    blas: None,
    scratch: None,
};
/// Its backward: one gradient, of the packed tensor.
pub(crate) const PACKED_ATTENTION_GRAD_OP: AttentionOp = AttentionOp {
    backward: true,
    packed: true,
    blas: None,
    scratch: None,
};

impl AttentionOp {
    /// This operator with each head's products on `blas`.
    pub(crate) fn with_blas(self, blas: Option<Arc<Blas>>) -> AttentionOp {
        AttentionOp { blas, ..self }
    }

    /// This operator with its nodes' tasks on `scratch` (shared with the session's other
    /// attention operators); without, each node keeps its own.
    pub(crate) fn sharing(self, scratch: &Arc<Scratch>) -> AttentionOp {
        let scratch = Some(scratch.clone());
        AttentionOp { scratch, ..self }
    }

    /// The tensors `Q, K, V` come in as (one packed tensor, or three).
    fn parts(&self) -> usize {
        if self.packed {
            1
        } else {
            3
        }
    }
}

impl Operator for AttentionOp {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        match (self.packed, self.backward) {
            (false, false) => ATTENTION,
            (false, true) => ATTENTION_GRAD,
            (true, false) => PACKED_ATTENTION,
            (true, true) => PACKED_ATTENTION_GRAD,
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let f32 = TensorElementType::Float32;
        // `Q, K, V[, mask]`; backward `dO, Q, K, V, P`, or with `lse` `dO, Q, K, V, L, O
        // [, mask]` (a packed `QKV` for `Q, K, V`).
        let (required, optional) = match self.backward {
            true => (self.parts() + 2, 2),
            false => (self.parts(), 1),
        };
        let required = (0..required).map(move |_| OperatorInput::required(f32));
        required.chain((0..optional).map(move |_| OperatorInput::optional(f32)))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        let n = if self.backward { self.parts() } else { 2 };
        (0..n).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let (op, a) = (self.clone(), Attributes::of(info, self.name())?);
        if a.packed.is_some() != op.packed {
            return Err(ort::Error::new(format!(
                "{}: heads_dim and offsets are the packed operator's attributes",
                op.name()
            )));
        }
        let scratch = op.scratch.clone().unwrap_or_else(attention_scratch);
        Ok(Box::new(move |ctx: &ComputeContext| match op.backward {
            true => backward(ctx, &op, &a, &scratch),
            false => forward(ctx, &op, &a, &scratch),
        }))
    }
}

/// The BLAS the heads' products run on: none under a causal mask, whose row blocks give
/// the masked kernel's bits only on one library (`matrixmultiply`).
fn heads_blas<'a>(op: &'a AttentionOp, a: &Attributes) -> Option<&'a Blas> {
    op.blas.as_deref().filter(|_| !a.causal)
}

/// The values of `Q, K, V` (from inputs `first..` of `ctx`: three, or one packed tensor
/// for all), their views, and each one's shape.
type Parts<'a> = ([&'a [f32]; 3], [View; 3], [&'a [i64]; 3]);

fn parts<'a>(
    op: &str,
    a: &Attributes,
    tensors: &[(&'a [i64], &'a [f32])],
) -> ort::Result<Parts<'a>> {
    let at = |i: usize| tensors[i.min(tensors.len() - 1)];
    let [(sq, q), (sk, k), (sv, v)] = [at(0), at(1), at(2)];
    let shapes = [sq, sk, sv];
    Ok(([q, k, v], views(op, a, shapes)?, shapes))
}

/// The shapes and float32 values of a call's inputs `values`.
fn extracted<'a>(
    values: &'a [ort::value::ValueRef<'a>],
) -> ort::Result<Vec<(&'a [i64], &'a [f32])>> {
    values
        .iter()
        .map(|v| {
            let (shape, data) = v.try_extract_tensor::<f32>()?;
            Ok((&shape[..], data))
        })
        .collect()
}

fn forward(
    ctx: &ComputeContext,
    op: &AttentionOp,
    a: &Attributes,
    scratch: &Scratch,
) -> ort::Result<()> {
    let name = op.name();
    let values = (0..op.parts())
        .map(|i| input(ctx, name, i))
        .collect::<ort::Result<Vec<_>>>()?;
    let tensors = extracted(&values)?;
    let ([q, k, v], [qv, kv, vv], _) = parts(name, a, &tensors)?;
    let [b, h, t, _] = qv.dims;
    let (s, e) = (kv.dims[3], vv.dims[3]);
    let mask_in = optional(ctx, op.parts())?;
    let mask = mask_of(name, mask_in.as_ref(), [b, h, t, s])?;
    let (out_shape, ov) = View::made([b, h, t, e], a.out);
    let mut out = output(ctx, name, 0, &out_shape)?;
    let (_, out) = out.try_extract_tensor_mut::<f32>()?;
    let mut kept = output(ctx, name, 1, &a.kept([b, h, t, s]))?;
    let (_, kept) = kept.try_extract_tensor_mut::<f32>()?;
    let (out, kept) = (Shared(out.as_mut_ptr()), Shared(kept.as_mut_ptr()));
    let pair = Pair {
        a,
        blas: heads_blas(op, a),
        q: (q, qv),
        k: (k, kv),
        v: (v, vv),
    };
    // With `lse`, each task's P is scratch after its row; else the output's.
    let len = if a.lse { s + t * s } else { s };
    per_pair(ctx, (scratch, len), b * h, |bh, buffer| {
        let (row, own) = buffer.split_at_mut(s);
        let at = match a.lse {
            true => (own.as_mut_ptr(), Some(kept.get().wrapping_add(bh * t))),
            false => (kept.get().wrapping_add(bh * t * s), None),
        };
        pair.forward(bh, mask.as_ref(), (out, ov), at, row)
    })
}

/// The mask input `at` of a call (`None`: absent), as read over scores `[b, h, t, s]`.
fn mask_of<'a>(
    name: &str,
    m: Option<&'a ort::value::ValueRef<'a>>,
    [b, h, t, s]: [usize; 4],
) -> ort::Result<Option<Mask<'a>>> {
    let Some(m) = m else { return Ok(None) };
    let (shape, values) = m.try_extract_tensor::<f32>()?;
    let strides = mask_strides(shape, [b, h, t, s]).ok_or_else(|| {
        ort::Error::new(format!(
            "{name}: a mask of {shape:?} for scores [{b}, {h}, {t}, {s}]"
        ))
    })?;
    Ok(Some(Mask { strides, values }))
}

/// Input `i` of a call, `None` where it is absent.
fn optional<'a>(
    ctx: &'a ComputeContext,
    i: usize,
) -> ort::Result<Option<ort::value::ValueRef<'a>>> {
    match ctx.num_inputs()? > i {
        true => ctx.input(i),
        false => Ok(None),
    }
}

fn backward(
    ctx: &ComputeContext,
    op: &AttentionOp,
    a: &Attributes,
    scratch: &Scratch,
) -> ort::Result<()> {
    let name = op.name();
    let n = op.parts() + 2;
    let values = (0..n)
        .map(|i| input(ctx, name, i))
        .collect::<ort::Result<Vec<_>>>()?;
    let tensors = extracted(&values)?;
    let ((do_shape, d_out), (p_shape, p)) = (tensors[0], tensors[n - 1]);
    let ([q, k, v], [qv, kv, vv], shapes) = parts(name, a, &tensors[1..n - 1])?;
    let [b, h, t, _] = qv.dims;
    let (s, e) = (kv.dims[3], vv.dims[3]);
    let (want_do, ov) = View::made([b, h, t, e], a.out);
    let want_p = a.kept([b, h, t, s]);
    if do_shape[..] != want_do[..] || p_shape[..] != want_p[..] {
        let kept = if a.lse { "L" } else { "P" };
        return Err(ort::Error::new(format!(
            "{name}: dO {do_shape:?} and {kept} {p_shape:?} (want {want_do:?} and {want_p:?})"
        )));
    }
    // With `lse`: `O` (input n, read by the GPU's kernels only), then the mask.
    let mask_in = match a.lse {
        true => optional(ctx, n + 1)?,
        false => None,
    };
    let mask = mask_of(name, mask_in.as_ref(), [b, h, t, s])?;
    // One gradient per input tensor: with a packed input, its three parts' views write
    // disjoint parts of the one gradient.
    let mut grads = Vec::with_capacity(3);
    for (i, shape) in shapes.iter().take(op.parts()).enumerate() {
        grads.push(output(ctx, name, i, shape)?);
    }
    let mut ptrs = Vec::with_capacity(3);
    for g in &mut grads {
        ptrs.push(Shared(g.try_extract_tensor_mut::<f32>()?.1.as_mut_ptr()));
    }
    let at = |i: usize| ptrs[i.min(ptrs.len() - 1)];
    let grads = [at(0), at(1), at(2)];
    let pair = Pair {
        a,
        blas: heads_blas(op, a),
        q: (q, qv),
        k: (k, kv),
        v: (v, vv),
    };
    // With `lse`, each task computes its P again into scratch (after a row of scores).
    let len = if a.lse { 3 * t * s + s } else { 2 * t * s };
    per_pair(ctx, (scratch, len), b * h, |bh, buffer| {
        let (buffer, own) = buffer.split_at_mut(2 * t * s);
        if !a.lse {
            let pb = &p[bh * t * s..(bh + 1) * t * s];
            return pair.backward(bh, (d_out, ov), pb, grads, buffer);
        }
        let (pb, row) = own.split_at_mut(t * s);
        let lse = &p[bh * t..(bh + 1) * t];
        pair.probabilities(bh, mask.as_ref(), lse, pb, row);
        pair.backward(bh, (d_out, ov), pb, grads, buffer)
    })
}
