//! A CBLAS single-precision product (`sgemm`), loaded at run time, for the float32 matrix
//! products of a CPU training graph (`graph::fusion::blas_products`, kernel in
//! `compute/fused/product.rs`): Intel MKL's `libmkl_rt` (PyPI `mkl`, which
//! `scripts/setup.sh` installs on an Intel CPU) where it is installed, else OpenBLAS from
//! PyPI's `scipy-openblas32` (installed by `scripts/setup.sh`), else none (ONNX Runtime's
//! own products).
//!
//! Why: at real sizes the products are 60-85% of a CPU step, and ONNX Runtime's own
//! (MLAS) runs them slower than PyTorch's BLAS on this machine's AVX-512 cores: at
//! BERT-base's shapes on 2 threads, MLAS's `MatMul` 287-339 GFLOP/s and its
//! `FusedMatMul` with a transposed first operand (every weight gradient) 259-292, against
//! OpenBLAS 0.3.31 split over the two threads 280-368 and MKL 2026.2 310-357
//! (`benches/gemm_rates.py`; PyTorch's own MKL on its own threads: 349-394). The crates
//! that do matrix products in Rust measured slower still (`gemm` 0.18 185-203,
//! `matrixmultiply` 247-287). With MKL, BERT-base trains at 1.10x PyTorch eager's
//! steps/s where OpenBLAS gives 0.99x (`benches/real_sizes.sh`, README "What is measured").
//!
//! Each library runs sequentially (MKL's sequential threading layer: no OpenMP or TBB
//! runtime is loaded), one block of rows or columns on each of ONNX Runtime's intra-op
//! threads. MKL on its own two OpenMP threads measured no faster at these shapes (335-357
//! GFLOP/s against the split's 310-357, alternating runs), and would run beside ONNX
//! Runtime's spinning pool on the same cores.
//!
//! Why loaded by hand: `cblas-sys` with `openblas-src` or `intel-mkl-src` links a library
//! at build time (a C toolchain and a system package, or a download, in every build). The
//! wheels are loaded the way ONNX Runtime's own library is, from the same Python
//! environment; `libloading` does the loading. `PIPETRAIN_BLAS` names another CBLAS
//! instead (a system OpenBLAS or MKL), `PIPETRAIN_BLAS=off` none.

use std::ffi::c_int;
use std::path::{Path, PathBuf};

mod core;
mod cut;
mod find;
mod strided;

/// `cblas_sgemm`'s arguments: order, transA, transB, M, N, K, alpha, A, lda, B, ldb,
/// beta, C, ldc.
type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// The environment variable naming the library (`off` for none).
pub const BLAS_ENV: &str = "PIPETRAIN_BLAS";

/// A loaded CBLAS (MKL or OpenBLAS), its own threads set to one: each call runs on the
/// thread that makes it (ONNX Runtime's intra-op threads, one block each).
pub struct Blas {
    sgemm: Sgemm,
    /// Intel MKL (else an OpenBLAS).
    mkl: bool,
    /// Whether a row or column of a product has the same bits in any block (`cut.rs`).
    cut_keeps_bits: bool,
    /// The kernels an OpenBLAS runs (`Haswell`, `SkylakeX`; `core.rs`), where it says.
    kernels: Option<String>,
    path: PathBuf,
    // Keeps the library mapped while `sgemm` may be called.
    _library: libloading::Library,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").field("path", &self.path).finish()
    }
}

/// One product `C = alpha op(A) op(B) + beta C`, row-major, as `cblas_sgemm` takes it:
/// `op(A)` is `m x k`, `op(B)` `k x n`, each stored with its leading dimension.
#[derive(Debug, Clone, Copy)]
pub struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
}

impl Blas {
    /// Loads the library at `path`: PyPI's `scipy-openblas32` (its symbols prefixed
    /// `scipy_`), another OpenBLAS, or Intel MKL's single runtime library (`libmkl_rt`),
    /// each set to one thread of its own.
    ///
    /// # Errors
    /// The loader's message when it is not a library with a `cblas_sgemm` and a way to
    /// set its threads.
    pub fn open(path: &Path) -> Result<Blas, String> {
        // SAFETY: loading a BLAS runs its initializers, which only read the CPU's
        // features and set up its buffers.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let missing = |what: &str| {
            format!(
                "{}: no {what} (scipy-openblas32's, OpenBLAS's or MKL's)",
                path.display()
            )
        };
        // SAFETY: the symbols are the CBLAS product and the libraries' thread setters,
        // with these signatures.
        let sgemm = [&b"scipy_cblas_sgemm\0"[..], b"cblas_sgemm\0"]
            .into_iter()
            .find_map(|name| unsafe { library.get::<Sgemm>(name).ok().map(|s| *s) })
            .ok_or_else(|| missing("cblas_sgemm"))?;
        let setters: [&[u8]; 3] = [
            b"scipy_openblas_set_num_threads\0",
            b"openblas_set_num_threads\0",
            b"MKL_Set_Num_Threads\0",
        ];
        let (threads, setter) = setters
            .into_iter()
            .find_map(|name| unsafe {
                let setter = library.get::<unsafe extern "C" fn(c_int)>(name).ok()?;
                Some((*setter, name))
            })
            .ok_or_else(|| missing("thread setter"))?;
        // SAFETY: MKL's threading layer (1: sequential, no OpenMP runtime needed) and the
        // library's own thread count, set before any product.
        unsafe {
            if let Ok(layer) =
                library.get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
            {
                layer(1);
            }
            threads(1);
        }
        let corename = [
            &b"scipy_openblas_get_corename\0"[..],
            b"openblas_get_corename\0",
        ]
        .into_iter()
        .find_map(|name| unsafe {
            let f = library
                .get::<unsafe extern "C" fn() -> *const std::ffi::c_char>(name)
                .ok()?;
            let name = f();
            // SAFETY: OpenBLAS returns a static NUL-terminated string.
            (!name.is_null()).then(|| {
                std::ffi::CStr::from_ptr(name)
                    .to_string_lossy()
                    .into_owned()
            })
        });
        let mut blas = Blas {
            sgemm,
            mkl: setter.starts_with(b"MKL"),
            kernels: corename,
            cut_keeps_bits: true,
            path: path.to_path_buf(),
            _library: library,
        };
        blas.cut_keeps_bits = cut::keeps_bits(&blas);
        Ok(blas)
    }

    /// Whether the library gives a row (or column) of a product the same bits whatever
    /// block of rows (or columns) it computes it in, so that a product cut into blocks
    /// gives the same bits however it is cut (`cut.rs`).
    pub fn cut_keeps_bits(&self) -> bool {
        self.cut_keeps_bits
    }

    /// The library's name, for the log: `MKL` or `OpenBLAS`.
    pub fn name(&self) -> &'static str {
        match self.mkl {
            true => "MKL",
            false => "OpenBLAS",
        }
    }

    /// The kernels an OpenBLAS runs (`Haswell`, `SkylakeX`), where it says.
    pub fn kernels(&self) -> Option<&str> {
        self.kernels.as_deref()
    }

    /// The fewest multiply-adds of a product with a transposed first operand (a weight
    /// gradient), and of any other product, this library runs faster than ONNX Runtime's
    /// MLAS on the intra-op threads, one block each (`cargo bench --bench products`,
    /// 2 threads, 2026-11-29; GFLOP/s MLAS against the library). OpenBLAS packs the
    /// other operand whole in each block: weight gradients from 2^26 (302 M: 279 / 322),
    /// the rest from 2^30 (302 M: 311 / 274, 1.2 G: 276 / 312). MKL: the rest from 2^29
    /// (302 M: 311 / 301, 604 M: 310 / 329 and 303 / 324 transposed).
    pub fn smallest_products(&self) -> (usize, usize) {
        match self.mkl {
            true => (1 << 26, 1 << 29),
            false => (1 << 26, 1 << 30),
        }
    }

    /// The library's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `p` on `a`, `b` and `c` (`lda`, `ldb`, `ldc` their leading dimensions).
    ///
    /// # Panics
    /// Where a slice is shorter than `p` and the leading dimensions need, or a size
    /// exceeds `i32`.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(
        &self,
        p: &Product,
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
    ) {
        // SAFETY: `c` is a live, exclusive slice of `c.len()` values.
        unsafe { self.sgemm_into(p, (a, lda), (b, ldb), (c.as_mut_ptr(), c.len(), ldc)) }
    }

    /// [`Blas::sgemm`] writing through `c`, a pointer to `len` values of which the
    /// product writes only its `m` rows of `n` (at `ldc` apart): for blocks of one
    /// output that several threads write at once.
    ///
    /// # Safety
    /// `c` must point to `len` live values, and no other thread may read or write the
    /// elements this product writes while it runs.
    ///
    /// # Panics
    /// As [`Blas::sgemm`].
    pub unsafe fn sgemm_into(
        &self,
        p: &Product,
        (a, lda): (&[f32], usize),
        (b, ldb): (&[f32], usize),
        (c, len, ldc): (*mut f32, usize, usize),
    ) {
        let (ar, ac) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
        let (br, bc) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
        if p.m == 0 || p.n == 0 {
            return;
        }
        assert!(
            ar == 0 || a.len() >= (ar - 1) * lda + ac,
            "sgemm: A too short"
        );
        assert!(
            br == 0 || b.len() >= (br - 1) * ldb + bc,
            "sgemm: B too short"
        );
        assert!(len >= (p.m - 1) * ldc + p.n, "sgemm: C too short");
        let int = |v: usize| c_int::try_from(v).expect("sgemm: a size over i32");
        let trans = |t: bool| if t { TRANS } else { NO_TRANS };
        // SAFETY: the asserts above keep every element OpenBLAS reads or writes inside
        // `a`, `b` and `c`'s `len` values; OpenBLAS with one thread of its own keeps no
        // pointer after the call.
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                trans(p.trans_a),
                trans(p.trans_b),
                int(p.m),
                int(p.n),
                int(p.k),
                p.alpha,
                a.as_ptr(),
                int(lda.max(1)),
                b.as_ptr(),
                int(ldb.max(1)),
                p.beta,
                c,
                int(ldc.max(1)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library beside this checkout's ONNX Runtime, whether or not the runtime
    /// uses it (it declines an OpenBLAS whose kernels idle the CPU's AVX-512).
    pub(super) fn venv_blas() -> Option<std::sync::Arc<Blas>> {
        let rt = crate::compute::Runtime::from_env().ok()?;
        let path = find::beside(&rt.info().library)?;
        Blas::open(&path).ok().map(std::sync::Arc::new)
    }

    pub(super) fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|l| f64::from(a[i * k + l]) * f64::from(b[l * n + j]))
                    .sum();
            }
        }
        c
    }

    #[test]
    fn sgemm_matches_the_sum_and_keeps_a_rows_bits_in_any_block_where_found_to() {
        let Some(blas) = venv_blas() else {
            eprintln!("skipped: no scipy-openblas32 beside ONNX Runtime");
            return;
        };
        let (m, k, n) = (131, 1000, 75);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729) % 89) as f32 / 89.0 - 0.5)
            .collect();
        let p = Product {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
        };
        let mut whole = vec![0.0; m * n];
        blas.sgemm(&p, &a, k, &b, n, &mut whole, n);
        for (got, want) in whole.iter().zip(naive(&a, &b, m, k, n)) {
            assert!((f64::from(*got) - want).abs() < 1e-3, "{got} vs {want}");
        }
        // Rows 16.. alone, and columns 32.. alone: the same bits as in the whole.
        let mut rows = vec![0.0; (m - 16) * n];
        blas.sgemm(
            &Product { m: m - 16, ..p },
            &a[16 * k..],
            k,
            &b,
            n,
            &mut rows,
            n,
        );
        let mut cols = vec![0.0; m * n];
        blas.sgemm(
            &Product { n: n - 32, ..p },
            &a,
            k,
            &b[32..],
            n,
            &mut cols[32..],
            n,
        );
        let cols_keep =
            (0..m).all(|i| cols[i * n + 32..(i + 1) * n] == whole[i * n + 32..(i + 1) * n]);
        let rows_keep = rows == whole[16 * n..];
        // What the library was found to do when it loaded (`cut.rs`) holds here too.
        match blas.cut_keeps_bits() {
            true => assert!(rows_keep && cols_keep, "rows {rows_keep}, columns {cols_keep}"),
            false => eprintln!(
                "{} here changes a row's bits with its block (rows {rows_keep}, columns {cols_keep})",
                blas.name()
            ),
        }
    }
}
