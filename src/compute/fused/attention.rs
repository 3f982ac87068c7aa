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
//! (kept for the backward, as the standard graph keeps the softmax's output).
//!
//! `AttentionGrad(dO, Q, K, V, P)`, same attributes: `dQ, dK, dV`, each in its input's
//! layout. Per head: `dP = dO v^T`, `dS = P * (dP - rowsum(dP * P))`, `dv = P^T dO`,
//! `dq = scale * dS k`, `dk = scale * dS^T q`.
//!
//! Each (batch, head) pair is one task on ONNX Runtime's intra-op threads and owns its
//! results (no sums across tasks), so results do not depend on the thread count. The
//! products are `matrixmultiply`'s strided SGEMM (vectorized for the machine, no packing
//! copies of our own); the softmax rows are the `Softmax` kernel's. Not bitwise the
//! standard graph: the products sum in another order (within float32 rounding, tested).

use std::sync::Mutex;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::softmax::{softmax_grad, softmax_row};
use super::{input, output};
use crate::graph::custom_ops::{ATTENTION, ATTENTION_GRAD};

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

/// A tensor read (or written) as the logical `[B, H, rows, cols]` tensor
/// `Transpose(tensor, perm)`: its dimensions and the strides into the tensor's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct View {
    dims: [usize; 4],
    strides: [usize; 4],
}

impl View {
    /// `Transpose(x, perm)` of a row-major `x` of `shape`, `None` unless rank 4.
    fn of(shape: &[i64], perm: [usize; 4]) -> Option<View> {
        let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if shape.len() != 4 {
            return None;
        }
        let mut strides = [1usize; 4];
        for a in (0..3).rev() {
            strides[a] = strides[a + 1] * shape[a + 1];
        }
        Some(View {
            dims: perm.map(|a| shape[a]),
            strides: perm.map(|a| strides[a]),
        })
    }

    /// The row-major tensor `Transpose(logical, perm)` for a logical tensor of `dims`:
    /// its shape and the view of it as `dims`.
    fn made(dims: [usize; 4], perm: [usize; 4]) -> (Vec<i64>, View) {
        let shape: Vec<i64> = perm.iter().map(|&a| dims[a] as i64).collect();
        let mut inverse = [0usize; 4];
        for (j, &a) in perm.iter().enumerate() {
            inverse[a] = j;
        }
        let view = View::of(&shape, inverse).unwrap_or(View {
            dims,
            strides: [0; 4],
        });
        (shape, view)
    }

    /// The view with its last two axes swapped.
    fn turned(&self) -> View {
        let (mut dims, mut strides) = (self.dims, self.strides);
        dims.swap(2, 3);
        strides.swap(2, 3);
        View { dims, strides }
    }

    /// Where the (batch, head) pair `bh` (of `dims[1]` heads) starts.
    fn at(&self, bh: usize) -> usize {
        (bh / self.dims[1]) * self.strides[0] + (bh % self.dims[1]) * self.strides[1]
    }

    /// The strides of the last two axes, as SGEMM takes them (the matrix as is, or
    /// turned).
    fn matrix(&self, turned: bool) -> (isize, isize) {
        let (r, c) = (self.strides[2] as isize, self.strides[3] as isize);
        if turned {
            (c, r)
        } else {
            (r, c)
        }
    }
}

/// The mask's strides over `[B, H, T, S]` (0 where it is broadcast), `None` where its
/// shape does not broadcast to `dims`.
fn mask_strides(shape: &[i64], dims: [usize; 4]) -> Option<[usize; 4]> {
    if shape.len() > 4 {
        return None;
    }
    let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let lead = 4 - shape.len();
    let mut strides = [0usize; 4];
    let mut next = 1;
    for a in (lead..4).rev() {
        let d = shape[a - lead];
        if d != 1 && d != dims[a] {
            return None;
        }
        strides[a] = if d == 1 { 0 } else { next };
        next *= d;
    }
    Some(strides)
}

/// A tensor's values as a raw pointer, shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the tasks of one call write disjoint elements (each its own (batch, head)
// pairs) and the call waits for all of them before the tensors are read.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so that closures take the whole `Shared`).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `c = alpha * a b + beta * c` for `a` (`m x k`) and `b` (`k x n`) at the given
/// strides (`c` is not read where `beta` is 0).
///
/// # Safety
/// Every element the strides reach from `a`, `b` and `c` is in its tensor, and no other
/// task writes the elements of `c`.
unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    (a, ra, ca): (*const f32, isize, isize),
    (b, rb, cb): (*const f32, isize, isize),
    (c, rc, cc): (*mut f32, isize, isize),
) {
    // SAFETY: the caller's contract.
    unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, ra, ca, b, rb, cb, beta, c, rc, cc) }
}

/// Query rows a block under a causal mask: a block's products stop at the last key its
/// last row sees (about half the work of the full products on square scores).
const ROW_BLOCK: usize = 16;

/// The blocks of query rows `(first, end, keys)` of `t` rows over `s` keys: one block of
/// every row and key, or under a causal mask (row `i` sees keys up to `i + s - t`) blocks
/// of [`ROW_BLOCK`] rows with the keys their last row sees.
fn row_blocks(t: usize, s: usize, causal: bool) -> Vec<(usize, usize, usize)> {
    if !causal {
        return vec![(0, t, s)];
    }
    (0..t)
        .step_by(ROW_BLOCK)
        .map(|r0| {
            let r1 = (r0 + ROW_BLOCK).min(t);
            (r0, r1, (r1 + s - t).min(s))
        })
        .collect()
}

/// Sets the `rows x cols` matrix of pair `bh` in view `v` of `x` to zeros.
///
/// # Safety
/// `x` holds the viewed tensor, and no other task writes pair `bh`'s elements.
unsafe fn zero(x: Shared, v: &View, bh: usize) {
    let at = v.at(bh);
    for i in 0..v.dims[2] {
        for j in 0..v.dims[3] {
            // SAFETY: the caller's contract; the view is the tensor's.
            unsafe { *x.get().add(at + i * v.strides[2] + j * v.strides[3]) = 0.0 };
        }
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

/// Scaled dot-product attention (see the module doc).
pub(crate) struct Attention;

impl Operator for Attention {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ATTENTION
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        let f32 = TensorElementType::Float32;
        [
            OperatorInput::required(f32),
            OperatorInput::required(f32),
            OperatorInput::required(f32),
            OperatorInput::optional(f32),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..2).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let a = Attributes::of(info, ATTENTION)?;
        Ok(Box::new(move |ctx: &ComputeContext| forward(ctx, &a)))
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
    let pair = Pair { a, q: (q, qv), k: (k, kv), v: (v, vv) };
    per_pair(ctx, b * h, s, |bh, row| {
        pair.forward(bh, mask.as_ref(), (out, ov), probs, row)
    })
}

/// An additive mask: its values and strides over `[B, H, T, S]`.
struct Mask<'a> {
    strides: [usize; 4],
    values: &'a [f32],
}

/// What a call's tasks read: the attributes and the viewed `Q`, `K`, `V`.
struct Pair<'a> {
    a: &'a Attributes,
    q: (&'a [f32], View),
    k: (&'a [f32], View),
    v: (&'a [f32], View),
}

impl Pair<'_> {
    /// `(pointer, row stride, column stride)` of pair `bh`'s matrix in `x`'s view `v`
    /// from row `row` on (turned: rows and columns swapped).
    fn at(x: &[f32], v: &View, bh: usize, row: usize, turned: bool) -> (*const f32, isize, isize) {
        let (r, c) = v.matrix(turned);
        (x.as_ptr().wrapping_add(v.at(bh) + row * r as usize), r, c)
    }

    /// The forward of pair `bh` (see the module doc); `row` is scratch of `S` values.
    fn forward(
        &self,
        bh: usize,
        mask: Option<&Mask>,
        (out, ov): (Shared, View),
        probs: Shared,
        row: &mut [f32],
    ) {
        let (qv, kv) = (self.q.1, self.k.1);
        let ([_, h, t, d], s, e) = (qv.dims, kv.dims[3], self.v.1.dims[3]);
        let p = probs.get().wrapping_add(bh * t * s);
        let (one, st) = (1isize, s as isize);
        for (r0, r1, keys) in row_blocks(t, s, self.a.causal) {
            let q = Self::at(self.q.0, &qv, bh, r0, false);
            let k = Self::at(self.k.0, &kv, bh, 0, false);
            let p0 = p.wrapping_add(r0 * s);
            // SAFETY: the views are the tensors' own shapes and strides; `P`'s rows and
            // `O`'s elements of this pair are written by this task alone.
            unsafe { gemm((r1 - r0, d, keys), (self.a.scale, 0.0), q, k, (p0, st, one)) };
            for i in r0..r1 {
                let seen = if self.a.causal { (i + s - t + 1).min(s) } else { s };
                // SAFETY: row `i` of this pair's `P` block, this task's alone.
                let y = unsafe { std::slice::from_raw_parts_mut(p.add(i * s), s) };
                let x = &mut row[..seen];
                x.copy_from_slice(&y[..seen]);
                if let Some(m) = mask {
                    let ms = m.strides;
                    let base = (bh / h) * ms[0] + (bh % h) * ms[1] + i * ms[2];
                    for (j, x) in x.iter_mut().enumerate() {
                        *x += m.values[base + j * ms[3]];
                    }
                }
                softmax_row(x, &mut y[..seen]);
                y[seen..].fill(0.0);
            }
            let v = Self::at(self.v.0, &self.v.1, bh, 0, false);
            let (or, oc) = ov.matrix(false);
            let o = out.get().wrapping_add(ov.at(bh) + r0 * ov.strides[2]);
            // SAFETY: as above.
            unsafe { gemm((r1 - r0, keys, e), (1.0, 0.0), (p0, st, one), v, (o, or, oc)) };
        }
    }
}

/// The backward of [`Attention`] (see the module doc).
pub(crate) struct AttentionGrad;

impl Operator for AttentionGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ATTENTION_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..5).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..3).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let a = Attributes::of(info, ATTENTION_GRAD)?;
        Ok(Box::new(move |ctx: &ComputeContext| backward(ctx, &a)))
    }
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
    let pair = Pair { a, q: (q, qv), k: (k, kv), v: (v, vv) };
    per_pair(ctx, b * h, 2 * t * s, |bh, scratch| {
        pair.backward(bh, (d_out, ov), p, grads, scratch)
    })
}

impl Pair<'_> {
    /// The backward of pair `bh` (see the module doc): `dO` in its view, the kept
    /// probabilities `P`, the gradients of `Q`, `K`, `V` (written in their views); `scratch`
    /// of `2 T S` values.
    fn backward(
        &self,
        bh: usize,
        (d_out, ov): (&[f32], View),
        p: &[f32],
        [dq, dk, dv]: [Shared; 3],
        scratch: &mut [f32],
    ) {
        let (qv, kv, vv) = (self.q.1, self.k.1, self.v.1);
        let ([_, _, t, d], s, e) = (qv.dims, kv.dims[3], vv.dims[3]);
        let (dp, ds) = scratch.split_at_mut(t * s);
        let pb = &p[bh * t * s..(bh + 1) * t * s];
        let (st, one) = (s as isize, 1isize);
        // Blocks after the first add to the keys' gradients; under a causal mask the
        // first does not reach every key, so they start from zeros.
        let causal = self.a.causal;
        if causal {
            // SAFETY: this pair's elements of `dK` and `dV`, this task's alone.
            unsafe { zero(dk, &kv.turned(), bh) };
            unsafe { zero(dv, &vv, bh) };
        }
        let beta = if causal { 1.0 } else { 0.0 };
        let scale = self.a.scale;
        let at = |g: Shared, v: &View, row: usize, turned: bool| {
            let (r, c) = v.matrix(turned);
            (g.get().wrapping_add(v.at(bh) + row * r as usize), r, c)
        };
        for (r0, r1, keys) in row_blocks(t, s, causal) {
            let rows = r1 - r0;
            let d_o = Self::at(d_out, &ov, bh, r0, false);
            let v_turned = Self::at(self.v.0, &vv, bh, 0, true);
            let dp0 = dp[r0 * s..].as_mut_ptr();
            // SAFETY: the views are the tensors' own shapes and strides; the gradients'
            // elements of this pair are written by this task alone.
            unsafe { gemm((rows, e, keys), (1.0, 0.0), d_o, v_turned, (dp0, st, one)) };
            for i in r0..r1 {
                let at = i * s..i * s + keys;
                softmax_grad(&dp[at.clone()], &pb[at.clone()], keys, &mut ds[at]);
            }
            let p_turned = (pb[r0 * s..].as_ptr(), one, st);
            let ds_rows = (ds[r0 * s..].as_ptr(), st, one);
            let ds_turned = (ds[r0 * s..].as_ptr(), one, st);
            let k_rows = Self::at(self.k.0, &kv, bh, 0, true);
            let q_rows = Self::at(self.q.0, &qv, bh, r0, false);
            // SAFETY: as above.
            unsafe {
                gemm((keys, rows, e), (1.0, beta), p_turned, d_o, at(dv, &vv, 0, false));
                gemm((rows, keys, d), (scale, 0.0), ds_rows, k_rows, at(dq, &qv, r0, false));
                gemm((keys, rows, d), (scale, beta), ds_turned, q_rows, at(dk, &kv, 0, true));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_reads_the_transposed_tensor() {
        // `[B, T, H, D]` read as `[B, H, T, D]` (`perm [0, 2, 1, 3]`).
        let v = View::of(&[2, 5, 3, 4], [0, 2, 1, 3]).unwrap();
        assert_eq!(v.dims, [2, 3, 5, 4]);
        assert_eq!(v.strides, [60, 4, 12, 1]);
        // The second pair is batch 0, head 1.
        assert_eq!(v.at(1), 4);
        assert_eq!(v.at(3), 60);
    }

    #[test]
    fn a_made_tensor_is_the_logical_one_transposed() {
        let (shape, view) = View::made([2, 3, 5, 4], [0, 2, 1, 3]);
        assert_eq!(shape, vec![2, 5, 3, 4]);
        assert_eq!(view, View::of(&[2, 5, 3, 4], [0, 2, 1, 3]).unwrap());
        let (shape, view) = View::made([2, 3, 5, 4], [0, 1, 2, 3]);
        assert_eq!(shape, vec![2, 3, 5, 4]);
        assert_eq!(view.strides, [60, 20, 4, 1]);
    }

    #[test]
    fn masks_broadcast_from_the_right() {
        assert_eq!(mask_strides(&[5, 7], [2, 3, 5, 7]), Some([0, 0, 7, 1]));
        assert_eq!(
            mask_strides(&[2, 1, 1, 7], [2, 3, 5, 7]),
            Some([7, 0, 0, 1])
        );
        assert_eq!(mask_strides(&[], [2, 3, 5, 7]), Some([0; 4]));
        assert_eq!(mask_strides(&[5, 6], [2, 3, 5, 7]), None);
    }
}
