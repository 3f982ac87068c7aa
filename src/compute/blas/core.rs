//! Which of its kernels OpenBLAS runs, and whether they use the CPU. Its builds for every
//! x86 CPU (`DYNAMIC_ARCH`, as PyPI's `scipy-openblas32` is) pick them when the library
//! loads, from the CPU's family or from `OPENBLAS_CORETYPE`. Where they leave the cores'
//! AVX-512 unused (`OPENBLAS_CORETYPE=Haswell`, as the environment of the machine below
//! set it, or an OpenBLAS that does not know the CPU), ONNX Runtime's MLAS, which uses
//! AVX-512, is the faster of the two. On an AMD EPYC of family 26 (Zen 5; OpenBLAS 0.3.34
//! picks its Skylake-X kernels there when nothing says otherwise), 2026-12-02:
//! - one thread at BERT-base's shapes (4096 x 768 x 3072, and the transposed weight
//!   gradient; `ctypes` against the wheel's library, best of four): Haswell's kernels
//!   113-118 GFLOP/s, MLAS 146-159, OpenBLAS's Skylake-X kernels 218-223;
//! - a 2-layer GPT-2 of width 768 (vocabulary 8,000, 8 x 128 tokens, SGD), two threads,
//!   three rounds in turn (`bash benches/blas_kernels.sh`): 0.82-0.85 steps/s with
//!   Haswell's kernels, 1.33-1.36 with MLAS, 1.44-1.50 with Skylake-X's
//!   (`OPENBLAS_CORETYPE=SkylakeX`).
//!
//! pipetrain does not set `OPENBLAS_CORETYPE` itself: the library loads after threads
//! that may read the environment have started, and writing it then is not sound.

/// OpenBLAS's kernels that use AVX-512.
const AVX512_KERNELS: [&str; 3] = ["SkylakeX", "Cooperlake", "SapphireRapids"];

/// Whether an OpenBLAS running `kernels` leaves this CPU's AVX-512 unused.
pub(super) fn idles_avx512(kernels: &str) -> bool {
    cpu_has_avx512()
        && !AVX512_KERNELS
            .iter()
            .any(|k| k.eq_ignore_ascii_case(kernels))
}

fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx512_kernels_never_idle_it_and_others_do_only_where_the_cpu_has_it() {
        assert!(!idles_avx512("SkylakeX") && !idles_avx512("cooperlake"));
        assert_eq!(idles_avx512("Haswell"), cpu_has_avx512());
        assert_eq!(idles_avx512("Zen"), cpu_has_avx512());
    }
}
