//! Finding and loading the ONNX Runtime shared library.
//!
//! pipetrain links no ONNX Runtime at build time (`ort`'s `load-dynamic`): the library
//! comes from PyPI's `onnxruntime` wheel, which ships `onnxruntime/capi/libonnxruntime.so.*`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::{Error, Result};

/// The ONNX Runtime version pipetrain is built and tested against.
pub const ORT_VERSION: &str = "1.31.1";

/// Where the library was found, and how.
#[derive(Debug, Clone)]
pub struct RuntimeInfo {
    /// The shared library.
    pub library: PathBuf,
    /// How it was found ("ORT_DYLIB_PATH", "project .venv", "python3 on PATH").
    pub found_by: String,
    /// The version string the library reports.
    pub version: String,
    /// The execution providers the library offers.
    pub providers: Vec<String>,
    /// The BLAS library (MKL or OpenBLAS) the CPU's large float32 products run on
    /// (`None`: ONNX Runtime's own); see `compute/blas`.
    pub blas: Option<PathBuf>,
    /// That library's name: `MKL` or `OpenBLAS`.
    pub blas_name: Option<&'static str>,
    /// The kernels an OpenBLAS runs (`Haswell`, `SkylakeX`), where it says.
    pub blas_kernels: Option<String>,
    /// Why the BLAS found was not used, where it was not.
    pub blas_declined: Option<String>,
}

/// Finds the library: `explicit` (from `ORT_DYLIB_PATH` or a config) when given; else a
/// `.venv` made by `scripts/setup.sh` in the current folder, the executable's folders or
/// their parents; else the `onnxruntime` package of `python3` on `PATH`.
///
/// # Errors
/// `RuntimeLibrary` saying where it looked and how to install the library.
pub fn find_library(explicit: Option<&Path>) -> Result<(PathBuf, String)> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok((p.to_path_buf(), "ORT_DYLIB_PATH".into()))
        } else {
            Err(Error::RuntimeLibrary {
                reason: format!("ORT_DYLIB_PATH is {} but no such file exists", p.display()),
            })
        };
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    for root in &roots {
        if let Some(lib) = library_in_venv(&root.join(".venv")) {
            return Ok((lib, format!("project .venv at {}", root.display())));
        }
    }
    if let Some(lib) = library_of_python("python3") {
        return Ok((lib, "python3 on PATH".into()));
    }
    Err(Error::RuntimeLibrary {
        reason: format!(
            "no libonnxruntime found (looked at ORT_DYLIB_PATH, .venv/ in {} and its parents, \
             and python3's onnxruntime package). Install it with `bash scripts/setup.sh` \
             (pip install onnxruntime=={ORT_VERSION} into .venv) or set ORT_DYLIB_PATH to the \
             library file",
            roots
                .first()
                .map_or_else(|| "the current folder".into(), |r| r.display().to_string())
        ),
    })
}

fn library_in_venv(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    for entry in entries.flatten() {
        let capi = entry.path().join("site-packages/onnxruntime/capi");
        if let Some(found) = library_in(&capi) {
            return Some(found);
        }
    }
    None
}

fn library_of_python(python: &str) -> Option<PathBuf> {
    let out = Command::new(python)
        .args([
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('onnxruntime'); \
             print(os.path.join(os.path.dirname(s.origin), 'capi') if s else '')",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    library_in(Path::new(dir.trim()))
}

fn library_in(capi: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(capi)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libonnxruntime.so"))
        })
        .collect();
    // Prefer the fully versioned file name (libonnxruntime.so.1.31.1).
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found.into_iter().next()
}

/// A loaded ONNX Runtime: the environment every session is created in.
#[derive(Clone)]
pub struct Runtime {
    env: ort::environment::Environment,
    info: RuntimeInfo,
    /// MKL or OpenBLAS for the CPU's float32 products, where one was found
    /// ([`super::blas::Blas::find`]).
    blas: Option<std::sync::Arc<super::blas::Blas>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("info", &self.info).finish()
    }
}

impl Runtime {
    /// Loads the library found by [`find_library`] and creates the environment.
    ///
    /// ONNX Runtime loads into a process once (that is `ort`'s and ONNX Runtime's own
    /// design): a second `init` in the same process returns the runtime already loaded.
    ///
    /// # Errors
    /// `RuntimeLibrary` when the library cannot be found or loaded, `Ort` when the
    /// environment cannot be created.
    pub fn init(explicit: Option<&Path>) -> Result<Runtime> {
        // ONNX Runtime allows one environment per process, and `ort` refuses a second
        // one even after the first is dropped; so the process's runtime is kept here
        // and handed out again. This is the only process-wide state in pipetrain.
        static LOADED: Mutex<Option<Runtime>> = Mutex::new(None);
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rt) = loaded.as_ref() {
            if explicit.is_some_and(|p| p != rt.info.library) {
                return Err(Error::RuntimeLibrary {
                    reason: format!(
                        "{} is already loaded in this process; cannot switch to {}",
                        rt.info.library.display(),
                        explicit
                            .map(Path::display)
                            .map(|d| d.to_string())
                            .unwrap_or_default()
                    ),
                });
            }
            return Ok(rt.clone());
        }
        let (library, found_by) = find_library(explicit)?;
        let env = ort::init_from(&library)
            .map_err(|e| Error::RuntimeLibrary {
                reason: format!("{}: {e}", library.display()),
            })?
            .with_name("pipetrain")
            .with_logger(super::ort_log::logger())
            .build()
            .map_err(Error::ort("creating the environment"))?;
        super::ort_log::set_level(&env)?;
        super::arena::register(&env)?;
        let (blas, declined) =
            super::blas::Blas::find(&library).map_err(|reason| Error::RuntimeLibrary { reason })?;
        let info = RuntimeInfo {
            version: version(&library),
            providers: providers().unwrap_or_default(),
            library,
            found_by,
            blas: blas.as_ref().map(|b| b.path().to_path_buf()),
            blas_name: blas.as_ref().map(|b| b.name()),
            blas_kernels: blas.as_ref().and_then(|b| b.kernels().map(str::to_string)),
            blas_declined: declined,
        };
        let rt = Runtime {
            env,
            info,
            blas: blas.map(std::sync::Arc::new),
        };
        *loaded = Some(rt.clone());
        Ok(rt)
    }

    /// [`Runtime::init`] with the library in `ORT_DYLIB_PATH` when that is set: what the
    /// binary, tests and benchmarks call.
    ///
    /// # Errors
    /// As [`Runtime::init`].
    pub fn from_env() -> Result<Runtime> {
        let explicit = std::env::var_os("ORT_DYLIB_PATH")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Runtime::init(explicit.as_deref())
    }

    /// What was loaded.
    pub fn info(&self) -> &RuntimeInfo {
        &self.info
    }

    /// MKL or OpenBLAS, where the float32 products of CPU graphs run on it.
    pub(crate) fn blas(&self) -> Option<&std::sync::Arc<super::blas::Blas>> {
        self.blas.as_ref()
    }

    pub(crate) fn env(&self) -> &ort::environment::Environment {
        &self.env
    }
}

fn version(library: &Path) -> String {
    // The wheel names the file by its version (libonnxruntime.so.1.31.1); the build info
    // string says the same in other words and is shown by `pipetrain doctor`.
    library
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("libonnxruntime.so."))
        .map_or_else(|| ort::info().to_string(), str::to_string)
}

fn providers() -> Option<Vec<String>> {
    let api = ort::api();
    let mut list: *mut *mut std::ffi::c_char = std::ptr::null_mut();
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the API writes an array of `n` C strings that we read, copy, and hand back to
    // ReleaseAvailableProviders exactly once.
    unsafe {
        let status = (api.GetAvailableProviders)(&mut list, &mut n);
        if !status.0.is_null() || list.is_null() {
            return None;
        }
        let names = (0..n as isize)
            .map(|i| {
                std::ffi::CStr::from_ptr(*list.offset(i))
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        let _ = (api.ReleaseAvailableProviders)(list, n);
        Some(names)
    }
}
