//! Attention's plan without the probabilities (`flash.cu`, FlashAttention-2's scheme,
//! float32, deterministic): the forward keeps each query row's log-sum-exp
//! `L = max + ln(sum exp)` of its scores, `[B, H, T]`, instead of `P`, `[B, H, T, S]`, and
//! the backward computes `P = exp(S - L)` again a tile at a time:
//!
//! ```text
//! forward   S = scale q kt [+ mask];  O = softmax(S) v;  L = logsumexp(S)   (one kernel)
//! backward  delta = rowsum(dO O);  dS = P (dO v^T - delta);
//!           dv = P^T dO  (a kernel over the keys);  dk = scale dS^T q  (another);
//!           dq = scale dS k  (a kernel over the queries)
//! ```
//!
//! For GPT-2 small at batch 4 the probabilities are 192 MiB a layer that the step no longer
//! keeps. A thread owns a row, so the head size is a template parameter of the source
//! ([`FLASH_HEAD_SIZES`]); the queries and the values must have the same one.

use super::attention::{AttentionAt, Mat, Step};
use super::{blocks_for, Arg, Launch};
use Arg::{Ptr, F32, I32, I64};

/// Rows (threads) per block of the flash kernels.
pub const FLASH_ROWS: u32 = 64;

pub use crate::graph::custom_ops::FLASH_HEAD_SIZES;

/// Each kernel's entry for each of [`FLASH_HEAD_SIZES`].
const FORWARD: [&str; 4] = [
    "attn_flash_forward_16",
    "attn_flash_forward_32",
    "attn_flash_forward_64",
    "attn_flash_forward_128",
];
const KEYS: [&str; 4] = [
    "attn_flash_keys_16",
    "attn_flash_keys_32",
    "attn_flash_keys_64",
    "attn_flash_keys_128",
];
const VALUES: [&str; 4] = [
    "attn_flash_values_16",
    "attn_flash_values_32",
    "attn_flash_values_64",
    "attn_flash_values_128",
];
const QUERIES: [&str; 4] = [
    "attn_flash_queries_16",
    "attn_flash_queries_32",
    "attn_flash_queries_64",
    "attn_flash_queries_128",
];

/// Whether the flash kernels take heads of query size `d` and value size `e`.
pub fn flash_fits(d: usize, e: usize) -> bool {
    d == e && FLASH_HEAD_SIZES.contains(&d)
}

/// A matrix's rows as the kernels take them: where, and its batch, head, row and column
/// strides.
fn rows(m: Mat) -> [Arg; 5] {
    let [b, h, r, c] = [m.bs, m.hs, m.rs, m.cs].map(|v| I64(v as i64));
    [Ptr(m.at), b, h, r, c]
}

/// The entry of `table` for `x`'s head size.
///
/// # Errors
/// Head sizes the kernels do not take, or more (batch entry, head) pairs than a grid's
/// second axis holds.
fn entry(table: [&'static str; 4], x: &AttentionAt) -> Result<&'static str, String> {
    let pairs = x.batch * x.heads;
    if pairs > 65_535 {
        return Err(format!(
            "{pairs} (batch entry, head) pairs: the flash kernels take at most 65,535 a call"
        ));
    }
    let (d, e) = (x.q.cols, x.v.cols);
    let at = FLASH_HEAD_SIZES.iter().position(|&n| n == d);
    match at {
        Some(at) if d == e => Ok(table[at]),
        _ => Err(format!(
            "heads of {d} (queries) and {e} (values): the flash kernels take equal sizes \
             of {FLASH_HEAD_SIZES:?}"
        )),
    }
}

/// Q, K (a key a row) and V's arguments.
fn qkv(x: &AttentionAt) -> Vec<Arg> {
    let mut args = Vec::with_capacity(40);
    args.extend(rows(x.q));
    args.extend(rows(x.kt.t()));
    args.extend(rows(x.v));
    args
}

/// The mask's and the sizes' arguments, the last of every flash kernel's.
fn tail(x: &AttentionAt, scale: f32, causal: bool) -> Vec<Arg> {
    let (mask, strides) = x.mask.unwrap_or((0, [0; 4]));
    let mut args = vec![Ptr(mask)];
    args.extend(strides.map(|s| I64(s as i64)));
    args.extend([
        I32(x.heads as i32),
        I32(x.q.rows as i32),
        I32(x.kt.cols as i32),
        F32(scale),
        I32(causal as i32),
    ]);
    args
}

/// A flash kernel's launch over `rows` rows a (batch entry, head).
fn launch(kernel: &'static str, x: &AttentionAt, rows: usize, args: Vec<Arg>) -> Step {
    let grid = (
        rows.div_ceil(FLASH_ROWS as usize) as u32,
        (x.batch * x.heads) as u32,
    );
    Step::Kernel(Launch::new(kernel, grid, args).with_threads(FLASH_ROWS))
}

/// The forward: `O` at `x.o`, and `L` (`[B, H, T]`, row-major) at `x.p`.
///
/// # Errors
/// Head sizes the kernels do not take ([`flash_fits`]).
pub fn flash_attention(x: &AttentionAt, scale: f32, causal: bool) -> Result<Vec<Step>, String> {
    let kernel = entry(FORWARD, x)?;
    let mut args = qkv(x);
    args.extend(rows(x.o));
    args.push(Ptr(x.p));
    args.extend(tail(x, scale, causal));
    Ok(vec![launch(kernel, x, x.q.rows, args)])
}

/// Where the flash backward reads the forward's output and writes: the gradients of q,
/// kt and v (each laid out as its tensor), values of a packed gradient no part covers
/// (zeroed first), and its scratch ([`flash_grad_scratch`] floats).
#[derive(Debug, Clone, Copy)]
pub struct FlashGradAt {
    /// The forward's output `O`, laid out as `dO`.
    pub out: Mat,
    /// q's gradient.
    pub dq: Mat,
    /// kt's gradient.
    pub dkt: Mat,
    /// v's gradient.
    pub dv: Mat,
    /// Values to zero first: where, and how many.
    pub zero: Option<(u64, usize)>,
    /// `delta`, a value a query row.
    pub delta: u64,
}

/// The floats of scratch the flash backward needs: `delta`, `[B, H, T]`.
pub fn flash_grad_scratch(x: &AttentionAt) -> usize {
    x.batch * x.heads * x.q.rows
}

/// The backward (`x.o` is `dO`, `x.p` the forward's `L`).
///
/// # Errors
/// Head sizes the kernels do not take, or a gradient laid out unlike its tensor.
pub fn flash_attention_grad(
    x: &AttentionAt,
    g: &FlashGradAt,
    scale: f32,
    causal: bool,
) -> Result<Vec<Step>, String> {
    let (keys, values, queries) = (entry(KEYS, x)?, entry(VALUES, x)?, entry(QUERIES, x)?);
    let same = |a: Mat, b: Mat| Mat { at: 0, ..a } == Mat { at: 0, ..b };
    if !(same(g.dq, x.q) && same(g.dkt, x.kt) && same(g.dv, x.v) && same(g.out, x.o)) {
        return Err("the flash backward writes each gradient in its tensor's layout".into());
    }
    let mut steps = Vec::with_capacity(4);
    if let Some((at, n)) = g.zero {
        let args = vec![Ptr(at), I64(n as i64)];
        steps.push(Step::Kernel(Launch::new(
            "attn_zero",
            (blocks_for(n), 1),
            args,
        )));
    }
    let n = flash_grad_scratch(x);
    let mut args = vec![Ptr(g.out.at), Ptr(x.o.at)];
    args.extend(rows(x.o).into_iter().skip(1));
    args.extend([
        Ptr(g.delta),
        I32(x.heads as i32),
        I32(x.q.rows as i32),
        I32(x.v.cols as i32),
        I64(n as i64),
    ]);
    let delta = Launch::new("attn_flash_delta", (blocks_for(n), 1), args);
    steps.push(Step::Kernel(delta));
    let mut read = qkv(x);
    read.extend(rows(x.o));
    read.extend([Ptr(x.p), Ptr(g.delta)]);
    let mut args = read.clone();
    args.extend([Ptr(g.dkt.at), Ptr(g.dv.at)]);
    args.extend(tail(x, scale, causal));
    steps.push(launch(values, x, x.kt.cols, args.clone()));
    steps.push(launch(keys, x, x.kt.cols, args));
    let mut args = read;
    args.push(Ptr(g.dq.at));
    args.extend(tail(x, scale, causal));
    steps.push(launch(queries, x, x.q.rows, args));
    Ok(steps)
}
