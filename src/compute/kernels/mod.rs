//! pipetrain's CUDA kernels: their sources (compiled at run time with NVRTC by the
//! `cuda_*` modules) and their launches as data: which kernel, on which grid, with which
//! arguments, for each operator and for the update.
//!
//! The device path queues these plans on a stream (`cuda_launch::launch_all`). The tests
//! run the same plans through the same sources compiled for the CPU ([`emu`]), so the
//! kernels' arithmetic and indexing, their grids and their argument lists are checked on
//! machines without a GPU, against the CPU kernels' formulas.

mod attention;
#[cfg(test)]
mod emu;
#[cfg(test)]
mod emu_attention;
#[cfg(test)]
mod emu_flash;
#[cfg(test)]
mod emu_replicas;
#[cfg(test)]
mod emu_tests;
mod flash;

use std::ops::Range;

use crate::optim::{ElementwiseStep, Rule};

pub use attention::{
    attention, attention_grad, attention_grad_scratch, AttentionAt, AttentionGradAt, Gemm, Mat,
    Step, ATTENTION_SOURCE,
};
pub use flash::{
    flash_attention, flash_attention_grad, flash_fits, flash_grad_scratch, FlashGradAt,
    FLASH_HEAD_SIZES,
};

/// The fused operators' kernels (`TanhGelu`, `SoftmaxGrad`, `LayerNormGrad`,
/// `KeyedDropout`).
pub const FUSED_SOURCE: &str = include_str!("fused.cu");

/// `RowsAdd`'s kernels.
pub const ROWS_ADD_SOURCE: &str = include_str!("rows_add.cu");

/// The update's kernels over a stage's flat buffers.
pub const UPDATE_SOURCE: &str = include_str!("update.cu");

/// Threads per block of every launch.
pub const THREADS: u32 = 256;

/// Blocks of the gradients' sum of squares: fixed, so that the order of the additions is.
pub const SUM_BLOCKS: u32 = 1024;

/// LayerNormGrad's column sums run in at most this many chunks of rows.
const LN_CHUNKS: usize = 64;

/// A kernel argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// An address (device memory; host memory under [`emu`]).
    Ptr(u64),
    /// `long long`.
    I64(i64),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
}

use Arg::{Ptr, F32, I32, I64};

/// One kernel launch: a grid of (x, y) blocks of `threads` threads ([`THREADS`] unless
/// the kernel says otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The kernel's name in its source.
    pub kernel: &'static str,
    /// Blocks along x and y (each at least one).
    pub grid: (u32, u32),
    /// Threads per block.
    pub threads: u32,
    /// The kernel's arguments, in order.
    pub args: Vec<Arg>,
}

impl Launch {
    fn new(kernel: &'static str, grid: (u32, u32), args: Vec<Arg>) -> Launch {
        Launch {
            kernel,
            grid: (grid.0.max(1), grid.1.max(1)),
            threads: THREADS,
            args,
        }
    }

    /// This launch with `threads` threads per block.
    fn with_threads(self, threads: u32) -> Launch {
        Launch { threads, ..self }
    }
}

/// Blocks for a grid-strided kernel over `n` values (at least one, at most 65,535).
pub fn blocks_for(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32
}

/// `y = tanh_gelu(x)` over `n` values (`TanhGelu`).
pub fn tanh_gelu(x: u64, y: u64, n: usize, (scale, coef): (f32, f32)) -> Launch {
    let args = vec![Ptr(x), Ptr(y), I64(n as i64), F32(scale), F32(coef)];
    Launch::new("tanh_gelu", (blocks_for(n), 1), args)
}

/// `dx` of `TanhGeluGrad(dy, x)` over `n` values.
pub fn tanh_gelu_grad(dy: u64, x: u64, dx: u64, n: usize, (scale, coef): (f32, f32)) -> Launch {
    let args = vec![
        Ptr(dy),
        Ptr(x),
        Ptr(dx),
        I64(n as i64),
        F32(scale),
        F32(coef),
    ];
    Launch::new("tanh_gelu_grad", (blocks_for(n), 1), args)
}

/// `dx` of `SoftmaxGrad(dy, y)` over `n` values in rows of `m`, a block a row.
pub fn softmax_grad(dy: u64, y: u64, dx: u64, n: usize, m: usize) -> Launch {
    let rows = n / m.max(1);
    let args = vec![Ptr(dy), Ptr(y), Ptr(dx), I64(rows as i64), I32(m as i32)];
    Launch::new("softmax_grad", (rows.clamp(1, 1 << 20) as u32, 1), args)
}

/// The buffers of one `LayerNormGrad` call.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormGradAt {
    /// `dY`, rows x cols.
    pub dy: u64,
    /// `X`, rows x cols.
    pub x: u64,
    /// The scale, cols.
    pub scale: u64,
    /// Each row's mean.
    pub mean: u64,
    /// Each row's inverse standard deviation.
    pub inv: u64,
    /// `dX`, rows x cols.
    pub dx: u64,
    /// `dscale`, cols.
    pub dscale: u64,
    /// `dbias`, cols.
    pub dbias: u64,
    /// [`layer_norm_grad_scratch`] floats.
    pub scratch: u64,
}

/// The chunks of rows `LayerNormGrad`'s column sums run in.
fn ln_parts(rows: usize) -> usize {
    LN_CHUNKS.min(rows.max(1))
}

/// The floats of scratch `LayerNormGrad` needs over `rows` x `cols`.
pub fn layer_norm_grad_scratch(rows: usize, cols: usize) -> usize {
    2 * ln_parts(rows) * cols
}

/// `LayerNormGrad` over `rows` x `cols`: `dx` a block a row, then the column sums of each
/// chunk of rows into the scratch, then the chunks' sums in chunk order.
pub fn layer_norm_grad(b: LayerNormGradAt, rows: usize, cols: usize) -> [Launch; 3] {
    let parts = ln_parts(rows);
    let chunk = rows.div_ceil(parts).max(1);
    let (part_s, part_b) = (Ptr(b.scratch), Ptr(b.scratch + 4 * (parts * cols) as u64));
    let column_blocks = cols.div_ceil(THREADS as usize) as u32;
    let (rows64, cols32) = (I64(rows as i64), I32(cols as i32));
    let (dy, x, mean, inv) = (Ptr(b.dy), Ptr(b.x), Ptr(b.mean), Ptr(b.inv));
    let row_args = vec![dy, x, Ptr(b.scale), mean, inv, Ptr(b.dx), rows64, cols32];
    let col_args = vec![
        dy,
        x,
        mean,
        inv,
        part_s,
        part_b,
        rows64,
        cols32,
        I64(chunk as i64),
    ];
    let finish_args = vec![
        part_s,
        part_b,
        Ptr(b.dscale),
        Ptr(b.dbias),
        I32(parts as i32),
        cols32,
    ];
    [
        Launch::new("ln_grad_rows", (rows.clamp(1, 1 << 20) as u32, 1), row_args),
        Launch::new("ln_grad_cols", (column_blocks, parts as u32), col_args),
        Launch::new("ln_grad_finish", (column_blocks, 1), finish_args),
    ]
}

/// The buffers of one `KeyedDropout` call (`mask` 0: none).
#[derive(Debug, Clone, Copy)]
pub struct KeyedDropoutAt {
    /// `X`, n values.
    pub x: u64,
    /// The ratio, one value.
    pub ratio: u64,
    /// The key, four `long long`s.
    pub key: u64,
    /// `Y`, n values.
    pub y: u64,
    /// The mask, n bytes (0: none).
    pub mask: u64,
}

/// `KeyedDropout` over `n` values with the node's `salt`.
pub fn keyed_dropout(b: KeyedDropoutAt, n: usize, salt: i64) -> Launch {
    let args = vec![
        Ptr(b.x),
        Ptr(b.ratio),
        Ptr(b.key),
        Ptr(b.y),
        Ptr(b.mask),
        I64(n as i64),
        I64(salt),
    ];
    Launch::new("keyed_dropout", (blocks_for(n), 1), args)
}

/// The buffers of one `RowsAdd` call.
#[derive(Debug, Clone, Copy)]
pub struct RowsAddAt {
    /// The indices, n `long long`s.
    pub indices: u64,
    /// The updates, n x row_len.
    pub updates: u64,
    /// The table, rows x row_len.
    pub table: u64,
    /// [`rows_add_scratch`] `int`s.
    pub scratch: u64,
}

/// The `int`s of scratch `RowsAdd` needs for `n` indices.
pub fn rows_add_scratch(n: usize) -> usize {
    2 * n
}

/// `RowsAdd` of `n` rows of `row_len` updates into a table of `rows` rows: the chains,
/// the zeroed table, the sums.
pub fn rows_add(b: RowsAddAt, n: usize, rows: i64, row_len: usize) -> [Launch; 3] {
    let (next, first) = (Ptr(b.scratch), Ptr(b.scratch + 4 * n as u64));
    let len = rows.max(0) as usize * row_len;
    let (n32, rows64, row32) = (I32(n as i32), I64(rows), I32(row_len as i32));
    let (idx, upd, table) = (Ptr(b.indices), Ptr(b.updates), Ptr(b.table));
    let sum_grid = (row_len.div_ceil(THREADS as usize) as u32, n as u32);
    [
        Launch::new(
            "rows_chain",
            (blocks_for(n), 1),
            vec![idx, n32, rows64, next, first],
        ),
        Launch::new(
            "rows_zero",
            (blocks_for(len), 1),
            vec![table, I64(len as i64)],
        ),
        Launch::new(
            "rows_sum",
            sum_grid,
            vec![idx, upd, next, first, n32, row32, rows64, table],
        ),
    ]
}

/// `acc += x` over `n` values.
pub fn add_into(acc: u64, x: u64, n: usize) -> Launch {
    Launch::new(
        "add_into",
        (blocks_for(n), 1),
        vec![Ptr(acc), Ptr(x), I64(n as i64)],
    )
}

/// `dst = sources[0] + sources[1] + ...` (in that order) over `n` values, where
/// `sources` is the address of a table of `count` addresses (`dst` may be one of them).
pub fn sum_replicas(dst: u64, sources: u64, count: usize, n: usize) -> Launch {
    Launch::new(
        "sum_replicas",
        (blocks_for(n), 1),
        vec![Ptr(dst), Ptr(sources), I32(count as i32), I64(n as i64)],
    )
}

/// The sum of squares of `n` gradients, in float64: [`SUM_BLOCKS`] partials, then their
/// sum into `total`.
pub fn grad_sum_sq(grads: u64, n: usize, partial: u64, total: u64) -> [Launch; 2] {
    [
        Launch::new(
            "sum_sq_blocks",
            (SUM_BLOCKS, 1),
            vec![Ptr(grads), I64(n as i64), Ptr(partial)],
        ),
        Launch::new(
            "sum_blocks",
            (1, 1),
            vec![Ptr(partial), I32(SUM_BLOCKS as i32), Ptr(total)],
        ),
    ]
}

/// How many state buffers the rule keeps, and its kernel and constants.
pub fn update_kernel(rule: Rule) -> (&'static str, usize, usize) {
    match rule {
        Rule::Sgd => ("sgd", 0, 2),
        Rule::SgdMomentum => ("sgd_momentum", 1, 6),
        Rule::Adam => ("adam", 2, 8),
    }
}

/// The update `step` over flat buffers at `params`, `grads` and `state` (the rule's
/// buffers in order), the gradients scaled by `scale`: a launch a segment.
///
/// # Errors
/// When `state` holds another number of buffers than the rule keeps.
pub fn update(
    step: &ElementwiseStep,
    scale: f32,
    (params, grads): (u64, u64),
    state: &[u64],
) -> Result<Vec<Launch>, String> {
    let (kernel, states, constants) = update_kernel(step.rule);
    if state.len() != states {
        return Err(format!(
            "{:?} keeps {states} state buffers, the device {}",
            step.rule,
            state.len()
        ));
    }
    let at = |base: u64, r: &Range<usize>| Ptr(base + 4 * r.start as u64);
    let launches = step.segments.iter().map(|(r, k)| {
        let mut args = vec![at(params, r), at(grads, r)];
        args.extend(state.iter().map(|&b| at(b, r)));
        args.extend([I64(r.len() as i64), F32(scale)]);
        args.extend(k[..constants].iter().map(|&c| F32(c)));
        Launch::new(kernel, (blocks_for(r.len()), 1), args)
    });
    Ok(launches.collect())
}
