//! pipetrain's CUDA kernels with cudarc: compiled by NVRTC as they run (no FMA
//! contraction, IEEE division and square root, so the CPU's formulas give the same bits),
//! and launched as `compute::kernels` plans them, with arguments as device addresses and
//! scalars (the kernels' buffers never move while launched).

use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

/// Compiles `source` (named `name` in NVRTC's messages) with pipetrain's options.
///
/// # Errors
/// NVRTC's log, or that NVRTC is missing (the message says "not found").
pub(crate) fn compile(source: &str, name: &str) -> Result<Ptx, String> {
    // SAFETY: only tries to open the library (cudarc panics on first use where none is).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("NVRTC not found: put the folder with libnvrtc.so on LD_LIBRARY_PATH (PyPI's nvidia-cuda-nvrtc wheel)".into());
    }
    let opts = CompileOptions {
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some(name.into()),
        ..Default::default()
    };
    compile_ptx_with_opts(source, opts).map_err(|e| format!("NVRTC: {e}"))
}

pub(crate) use super::kernels::{Arg, Launch};

/// Launches `l` (a plan of `compute::kernels`; its kernel is `f`) on `stream`: a grid of
/// (x, y) blocks of `l.threads` threads.
///
/// # Safety
/// `l`'s arguments must match the kernel's parameters, in order and type (the emulator's
/// tests check the plans against the sources), and every address must reach as far as
/// the kernel indexes on that grid.
pub(crate) unsafe fn launch_planned(
    stream: &CudaStream,
    f: &CudaFunction,
    l: &Launch,
) -> Result<(), DriverError> {
    let cfg = LaunchConfig {
        grid_dim: (l.grid.0.max(1), l.grid.1.max(1), 1),
        block_dim: (l.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    for a in &l.args {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::kernels::{ATTENTION_SOURCE, FUSED_SOURCE, ROWS_ADD_SOURCE, UPDATE_SOURCE};

    /// `source` compiled, as PTX text; `None` (the test passes, saying so) where NVRTC
    /// is missing, unless `PIPETRAIN_REQUIRE_NVRTC` is set (CI sets it, after
    /// `scripts/setup.sh` installed NVRTC).
    fn compiled(source: &str, name: &str) -> Option<String> {
        match compile(source, name) {
            Ok(ptx) => Some(ptx.to_src()),
            Err(e)
                if e.contains("not found")
                    && std::env::var_os("PIPETRAIN_REQUIRE_NVRTC").is_none() =>
            {
                eprintln!("skipped: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Every kernel compiles with NVRTC (no GPU needed) and has its entry point; the
    /// update keeps its products and sums apart (no float32 fused multiply-add) with
    /// IEEE square root and division, which is what makes it bitwise the CPU's.
    #[test]
    fn every_kernel_compiles_with_nvrtc_without_fused_multiply_adds() {
        let Some(update) = compiled(UPDATE_SOURCE, "update.cu") else {
            return;
        };
        let entries = [
            "sgd",
            "sgd_momentum",
            "adam",
            "add_into",
            "sum_sq_blocks",
            "sum_blocks",
        ];
        for name in entries {
            assert!(
                update.contains(&format!(".entry {name}(")),
                "no entry {name} in\n{update}"
            );
        }
        assert!(!update.contains("fma.rn.f32"), "a float32 FMA in\n{update}");
        assert!(
            update.contains("sqrt.rn.f32") && update.contains("div.rn.f32"),
            "IEEE sqrt and division"
        );
        let rows = compiled(ROWS_ADD_SOURCE, "rows_add.cu").expect("NVRTC was found above");
        for name in ["rows_chain", "rows_zero", "rows_sum"] {
            assert!(rows.contains(&format!(".entry {name}(")), "no entry {name}");
        }
        let fused = compiled(FUSED_SOURCE, "fused.cu").expect("NVRTC was found above");
        let entries = [
            "tanh_gelu",
            "tanh_gelu_grad",
            "softmax_grad",
            "ln_grad_rows",
            "ln_grad_cols",
            "ln_grad_finish",
            "keyed_dropout",
        ];
        for name in entries {
            assert!(
                fused.contains(&format!(".entry {name}(")),
                "no entry {name}"
            );
        }
        let attention = compiled(ATTENTION_SOURCE, "attention.cu").expect("NVRTC was found above");
        let mut names = vec![
            "attn_softmax",
            "attn_softmax_grad",
            "attn_zero",
            "attn_flash_delta",
        ];
        let flash: Vec<String> = super::super::kernels::FLASH_HEAD_SIZES
            .iter()
            .flat_map(|d| {
                ["forward", "keys", "values", "queries"].map(|k| format!("attn_flash_{k}_{d}"))
            })
            .collect();
        names.extend(flash.iter().map(String::as_str));
        for name in names {
            assert!(
                attention.contains(&format!(".entry {name}(")),
                "no entry {name}"
            );
        }
    }
}
