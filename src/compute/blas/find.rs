//! Finding the CPU's BLAS: the library `PIPETRAIN_BLAS` names, else the one
//! `scripts/setup.sh` put beside ONNX Runtime, unless its kernels leave the CPU's
//! AVX-512 unused (`core.rs`).

use std::path::{Path, PathBuf};

use super::{core, Blas, BLAS_ENV};

impl Blas {
    /// The library `PIPETRAIN_BLAS` names, else MKL's (`scripts/setup.sh` on an Intel CPU) or
    /// `scipy-openblas32`'s beside the ONNX Runtime library `ort` (all from pip, in one
    /// environment); `None` where there is none or `PIPETRAIN_BLAS=off`, or where the one
    /// found is an OpenBLAS whose kernels leave the CPU's AVX-512 unused (`core.rs`), with
    /// why.
    ///
    /// # Errors
    /// Where `PIPETRAIN_BLAS` names a file that does not load.
    pub fn find(ort: &Path) -> Result<(Option<Blas>, Option<String>), String> {
        match std::env::var_os(BLAS_ENV).filter(|v| !v.is_empty()) {
            Some(v) if v == "off" => Ok((None, None)),
            Some(v) => Blas::open(Path::new(&v))
                .map(|b| (Some(b), None))
                .map_err(|e| format!("{BLAS_ENV}: {e}")),
            None => Ok(match beside(ort).map(|p| Blas::open(&p)) {
                None => (None, None),
                Some(Err(e)) => {
                    tracing::warn!("BLAS not used: {e}");
                    (None, Some(e))
                }
                Some(Ok(blas)) => match blas.idles_avx512() {
                    Some(why) => {
                        tracing::info!("{why}");
                        (None, Some(why))
                    }
                    None => (Some(blas), None),
                },
            }),
        }
    }

    /// Why an OpenBLAS whose kernels leave the CPU's AVX-512 unused is not worth using
    /// (ONNX Runtime's MLAS uses it: `core.rs`); `None` for any other library.
    fn idles_avx512(&self) -> Option<String> {
        let kernels = self.kernels.as_deref()?;
        let chosen = match std::env::var("OPENBLAS_CORETYPE") {
            Ok(v) => format!(" (OPENBLAS_CORETYPE={v})"),
            Err(_) => String::new(),
        };
        core::idles_avx512(kernels).then(|| {
            format!(
                "{} runs its {kernels} kernels{chosen}, which leave this CPU's AVX-512 \
                 unused: ONNX Runtime's own products are faster, and run them \
                 (OPENBLAS_CORETYPE=SkylakeX gives OpenBLAS's AVX-512 kernels; \
                 PIPETRAIN_BLAS={} uses it as it is)",
                self.path.display(),
                self.path.display()
            )
        })
    }
}

/// The BLAS installed beside the ONNX Runtime library `ort`
/// (`site-packages/onnxruntime/capi/...`): PyPI `mkl`'s runtime library in the
/// environment's `lib` (where the wheel puts it), else `scipy-openblas32`'s.
pub(super) fn beside(ort: &Path) -> Option<PathBuf> {
    let site = ort.parent()?.parent()?.parent()?;
    let env_lib = site.parent()?.parent()?.parent()?.join("lib");
    let mkl = std::fs::read_dir(&env_lib).ok().and_then(|d| {
        d.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libmkl_rt.so."))
        })
    });
    let openblas = site.join("scipy_openblas32/lib/libscipy_openblas.so");
    mkl.or_else(|| openblas.is_file().then_some(openblas))
}
