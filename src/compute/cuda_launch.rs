//! Launching NVRTC-compiled kernels with cudarc: arguments as device addresses and
//! scalars (the kernels' buffers never move while launched), grid-strided or on a grid.

use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};

/// Threads per block of pipetrain's kernels.
pub(crate) const THREADS: u32 = 256;

/// A kernel argument.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address.
    Ptr(u64),
    /// `long long`.
    I64(i64),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
}

/// Launches `f` on `stream` over a grid of (x, y) blocks of [`THREADS`] threads.
///
/// # Safety
/// `args` must match the kernel's parameters, in order and type, and every address must
/// reach as far as the kernel indexes on that grid.
pub(crate) unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32),
    args: &[Arg],
) -> Result<(), DriverError> {
    let cfg = LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::Ptr(p) => b.arg(p),
            Arg::I64(n) => b.arg(n),
            Arg::I32(n) => b.arg(n),
            Arg::F32(x) => b.arg(x),
        };
    }
    // SAFETY: the caller's (the arguments match the kernel).
    unsafe { b.launch(cfg) }.map(|_| ())
}

/// Blocks for a grid-strided kernel over `n` values (at least one, at most 65,535).
pub(crate) fn blocks_for(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32
}
