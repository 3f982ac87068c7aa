//! cuBLAS on ONNX Runtime's compute stream, for pipetrain's CUDA operators: a handle an
//! operator's kernel keeps, set to the session's stream at each call, and one planned
//! `cublasSgemmStridedBatched` (`compute::kernels::Gemm`, whose plans the emulator's
//! tests run on the CPU as cuBLAS defines them).

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::CudaStream;

use super::cuda_fused::fail;
use super::kernels::Gemm;

/// A cuBLAS handle, destroyed with it.
pub(super) struct Handle(blas_sys::cublasHandle_t);

// SAFETY: the handle is used by one thread at a time (behind the kernel's mutex), as
// cuBLAS allows.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle` and destroyed once, here.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// The cuBLAS handle in `slot`, made on first use, set to `stream` (an operator's
/// kernel keeps one; cuBLAS allows a handle one thread at a time).
pub(super) fn handle(
    slot: &mut Option<Handle>,
    stream: &CudaStream,
    op: &str,
) -> ort::Result<blas_sys::cublasHandle_t> {
    if slot.is_none() {
        // SAFETY: only tries to open the library.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(ort::Error::new(format!(
                "{op}: cuBLAS not found (PyPI's nvidia-cublas wheel; `scripts/setup.sh --cuda`)"
            )));
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| fail(op, "binding the device", e))?;
        let h = blas::create_handle().map_err(|e| fail(op, "cublasCreate", e))?;
        *slot = Some(Handle(h));
    }
    let h = slot.as_ref().expect("made above").0;
    // SAFETY: a live handle and the session's live stream.
    unsafe { blas::set_stream(h, stream.cu_stream() as blas_sys::cudaStream_t) }
        .map_err(|e| fail(op, "cublasSetStream", e))?;
    Ok(h)
}

/// One planned product.
///
/// # Safety
/// `g`'s matrices must be device memory reachable on the handle's stream.
pub(super) unsafe fn gemm(h: blas_sys::cublasHandle_t, g: &Gemm) -> Result<(), blas::CublasError> {
    if g.m == 0 || g.n == 0 || g.batch == 0 {
        return Ok(());
    }
    let op = |t: bool| match t {
        true => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        false => blas_sys::cublasOperation_t::CUBLAS_OP_N,
    };
    // SAFETY: the caller's; alpha and beta are host values read during the call.
    unsafe {
        blas::sgemm_strided_batched(
            h,
            op(g.trans_a),
            op(g.trans_b),
            g.m,
            g.n,
            g.k,
            &g.alpha,
            g.a as *const f32,
            g.lda,
            g.stride_a,
            g.b as *const f32,
            g.ldb,
            g.stride_b,
            &g.beta,
            g.c as *mut f32,
            g.ldc,
            g.stride_c,
            g.batch,
        )
    }
}
