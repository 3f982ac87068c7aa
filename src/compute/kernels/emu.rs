//! The CUDA kernels' sources run on the CPU, for tests: a source is compiled by the
//! system's C++ compiler with `emu.hpp` (CUDA's thread indices, shared memory and
//! `__syncthreads` as user-level threads, a block at a time), and a [`Launch`] plan runs
//! on host buffers exactly as the device path queues it.
//!
//! What this checks without a GPU: a kernel's arithmetic, its indexing over the grid the
//! plan gives it, its barriers (each live thread of a block reaches the same ones), and the
//! plan's arguments against the kernel's parameter list (count and type: a `float` passed
//! where the kernel reads an `int` is garbage on the device, silently), and races within
//! a block as far as the order shows them: a block's threads run one at a time between
//! barriers, ascending ([`Emulator::run`]) or descending ([`Emulator::run_descending`]),
//! and a thread reading what another writes without a barrier between gets other values
//! one way than the other. What it cannot check: the device's own math library (`tanhf`
//! is glibc's here), races between blocks, and memory the device cannot reach. No crate
//! runs CUDA C on the CPU, so the ~130 lines of `emu.hpp` are ours.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Mutex;

use super::{Arg, Gemm, Launch, Step};

/// One kernel parameter's kind, as the source declares it.
#[derive(Debug, Clone, PartialEq)]
enum Param {
    /// A pointer, with its C type (`const float*`).
    Ptr(String),
    I64,
    I32,
    F32,
}

/// A kernel source compiled for the CPU.
pub struct Emulator {
    library: libloading::Library,
    kernels: HashMap<String, Vec<Param>>,
    _dir: tempfile::TempDir,
}

/// Launches share the emulator's globals (the current block, shared memory): one at a
/// time in the test process.
static LAUNCH: Mutex<()> = Mutex::new(());

type Entry = unsafe extern "C" fn(u32, u32, u32, *const u64) -> i32;

impl Emulator {
    /// `source` (named `name`) compiled with `emu.hpp` and a wrapper per kernel.
    ///
    /// # Panics
    /// Where no C++ compiler runs (`scripts/setup.sh` installs one) or the source does
    /// not compile: a test's failure, with the compiler's message.
    pub fn compile(source: &str, name: &str) -> Emulator {
        let kernels = signatures(source);
        let mut unit = String::from(include_str!("emu.hpp"));
        unit.push_str(&format!("#line 1 \"{name}\"\n{source}\n"));
        for (kernel, params) in &kernels {
            unit.push_str(&wrapper(kernel, params));
        }
        let dir = tempfile::tempdir().expect("a temporary folder");
        let (cpp, lib) = (dir.path().join("unit.cpp"), dir.path().join("unit.so"));
        std::fs::write(&cpp, unit).expect("writing the unit");
        let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "g++".into()))
            .args([
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                "-ffp-contract=off",
                "-w",
            ])
            .arg(&cpp)
            .arg("-o")
            .arg(&lib)
            .output()
            .expect("a C++ compiler (g++, or $CXX; scripts/setup.sh installs g++)");
        assert!(
            out.status.success(),
            "{name} does not compile for the CPU:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: the library is the unit just compiled; its initializers are the
        // emulator's globals only.
        let library = unsafe { libloading::Library::new(&lib) }.expect("loading the unit");
        Emulator {
            library,
            kernels: kernels.into_iter().collect(),
            _dir: dir,
        }
    }

    /// Runs `plan` in order on host buffers, each block's threads in ascending order
    /// between barriers.
    ///
    /// # Errors
    /// An unknown kernel, arguments that do not match its parameters, or a barrier not
    /// every live thread of a block reached.
    ///
    /// # Safety
    /// Every pointer argument must reach as far as the kernel indexes on its grid.
    pub unsafe fn run(&self, plan: &[Launch]) -> Result<(), String> {
        // SAFETY: the caller's.
        unsafe { self.run_ordered(plan, false) }
    }

    /// [`Emulator::run`] with each block's threads in descending order between barriers:
    /// a kernel that gives other results this way races (a thread reads what another
    /// writes in the same phase).
    ///
    /// # Errors
    /// As [`Emulator::run`].
    ///
    /// # Safety
    /// As [`Emulator::run`].
    pub unsafe fn run_descending(&self, plan: &[Launch]) -> Result<(), String> {
        // SAFETY: the caller's.
        unsafe { self.run_ordered(plan, true) }
    }

    /// `plan` with the threads in ascending or `descending` order.
    unsafe fn run_ordered(&self, plan: &[Launch], descending: bool) -> Result<(), String> {
        let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the unit's own setter of a flag.
        let order = unsafe {
            self.library
                .get::<unsafe extern "C" fn(i32)>(b"emu_set_descending")
        }
        .map_err(|e| e.to_string())?;
        // SAFETY: a plain store, under the launch lock.
        unsafe { order(i32::from(descending)) };
        for l in plan {
            let params = self
                .kernels
                .get(l.kernel)
                .ok_or_else(|| format!("no kernel {}", l.kernel))?;
            let words = words(l, params)?;
            let symbol = format!("emu__{}", l.kernel);
            // SAFETY: the wrapper `wrapper` wrote for this kernel.
            let entry = unsafe { self.library.get::<Entry>(symbol.as_bytes()) }
                .map_err(|e| format!("{symbol}: {e}"))?;
            // SAFETY: the caller's (the buffers reach as far as the kernel reads).
            if unsafe { entry(l.grid.0, l.grid.1, l.threads, words.as_ptr()) } != 0 {
                let error = unsafe {
                    self.library
                        .get::<unsafe extern "C" fn() -> *const i8>(b"emu_error")
                }
                .map_err(|e| e.to_string())?;
                // SAFETY: a NUL-terminated static buffer.
                let text = unsafe { std::ffi::CStr::from_ptr(error()) };
                return Err(format!("{}: {}", l.kernel, text.to_string_lossy()));
            }
        }
        Ok(())
    }
}

impl Emulator {
    /// Runs `steps` in order: our kernels from this source (each block's threads in
    /// `descending` order or not), the products as cuBLAS defines
    /// `cublasSgemmStridedBatched` (column-major), with its checks of the leading
    /// dimensions.
    ///
    /// # Errors
    /// As [`Emulator::run`], and a product cuBLAS would refuse.
    ///
    /// # Safety
    /// As [`Emulator::run`], for the products' matrices too.
    pub unsafe fn run_steps(&self, steps: &[Step], descending: bool) -> Result<(), String> {
        for step in steps {
            match step {
                // SAFETY: the caller's.
                Step::Kernel(l) => {
                    unsafe { self.run_ordered(std::slice::from_ref(l), descending) }?
                }
                // SAFETY: the caller's.
                Step::Gemm(g) => unsafe { gemm(g) }?,
            }
        }
        Ok(())
    }
}

/// `cublasSgemmStridedBatched(g)` on host memory, each value's sum in `k` order.
///
/// # Safety
/// The matrices must reach as far as `g` says.
unsafe fn gemm(g: &Gemm) -> Result<(), String> {
    let (m, n, k) = (g.m as i64, g.n as i64, g.k as i64);
    let rows_a = if g.trans_a { k } else { m };
    let rows_b = if g.trans_b { n } else { k };
    if m < 0 || n < 0 || k < 0 || g.batch < 0 {
        return Err(format!("a product of negative size: {g:?}"));
    }
    if (g.lda as i64) < rows_a.max(1) || (g.ldb as i64) < rows_b.max(1) || (g.ldc as i64) < m.max(1)
    {
        return Err(format!("leading dimensions cuBLAS refuses: {g:?}"));
    }
    let (lda, ldb, ldc) = (g.lda as i64, g.ldb as i64, g.ldc as i64);
    for batch in 0..g.batch as i64 {
        let a = g.a as *const f32;
        let b = g.b as *const f32;
        let c = g.c as *mut f32;
        let (a, b, c) = (
            a.wrapping_offset((batch * g.stride_a) as isize),
            b.wrapping_offset((batch * g.stride_b) as isize),
            c.wrapping_offset((batch * g.stride_c) as isize),
        );
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for l in 0..k {
                    let ai = if g.trans_a { l + i * lda } else { i + l * lda };
                    let bi = if g.trans_b { j + l * ldb } else { l + j * ldb };
                    // SAFETY: the caller's (inside the matrices).
                    acc += unsafe { *a.offset(ai as isize) * *b.offset(bi as isize) };
                }
                // SAFETY: the caller's.
                let out = unsafe { &mut *c.offset((i + j * ldc) as isize) };
                *out = match g.beta == 0.0 {
                    true => g.alpha * acc,
                    false => g.alpha * acc + g.beta * *out,
                };
            }
        }
    }
    Ok(())
}

/// `l`'s arguments as the wrapper reads them, checked against `params`.
fn words(l: &Launch, params: &[Param]) -> Result<Vec<u64>, String> {
    if l.args.len() != params.len() {
        return Err(format!(
            "{}: {} arguments for {} parameters",
            l.kernel,
            l.args.len(),
            params.len()
        ));
    }
    let word = |(k, (a, p)): (usize, (&Arg, &Param))| match (a, p) {
        (Arg::Ptr(v), Param::Ptr(_)) => Ok(*v),
        (Arg::I64(v), Param::I64) => Ok(*v as u64),
        (Arg::I32(v), Param::I32) => Ok(*v as u32 as u64),
        (Arg::F32(v), Param::F32) => Ok(v.to_bits() as u64),
        _ => Err(format!(
            "{}: argument {k} is {a:?}, the parameter {p:?}",
            l.kernel
        )),
    };
    l.args.iter().zip(params).enumerate().map(word).collect()
}

/// Every `extern "C" __global__ void NAME(PARAMS)` of `source`, in order (object-like
/// macros of the source in `PARAMS` expanded).
fn signatures(source: &str) -> Vec<(String, Vec<Param>)> {
    const HEAD: &str = "extern \"C\" __global__ void";
    let macros = defines(source);
    let mut found = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(HEAD) {
        rest = &rest[at + HEAD.len()..];
        let open = rest.find('(').expect("a parameter list");
        let close = rest.find(')').expect("a parameter list's end");
        let name = rest[..open].trim().to_string();
        let params = expand(&rest[open + 1..close], &macros)
            .split(',')
            .map(|p| param(&name, p))
            .collect();
        found.push((name, params));
    }
    found
}

/// The object-like `#define NAME TEXT` of `source` (continued lines joined).
fn defines(source: &str) -> HashMap<String, String> {
    let mut macros = HashMap::new();
    let mut lines = source.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim_start().strip_prefix("#define ") else {
            continue;
        };
        let mut text = rest.to_string();
        while text.ends_with('\\') {
            text.pop();
            text.push(' ');
            text.push_str(lines.next().unwrap_or(""));
        }
        let end = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        if !text[end..].starts_with('(') {
            macros.insert(text[..end].to_string(), text[end..].trim().to_string());
        }
    }
    macros
}

/// `text` with each macro of `macros` replaced by its text, until none is left.
fn expand(text: &str, macros: &HashMap<String, String>) -> String {
    let mut out = text.to_string();
    for _ in 0..16 {
        let words: Vec<&str> = out
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| macros.contains_key(*w))
            .collect();
        if words.is_empty() {
            break;
        }
        let mut next = String::new();
        let mut word = String::new();
        for c in out.chars().chain(std::iter::once(' ')) {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            next.push_str(macros.get(&word).map_or(&word, |m| m));
            word.clear();
            next.push(c);
        }
        next.pop();
        out = next;
    }
    out
}

/// One declared parameter (`const float* x`, `long long n`).
fn param(kernel: &str, declared: &str) -> Param {
    let words: Vec<&str> = declared.split_whitespace().collect();
    let ty = words[..words.len() - 1].join(" ");
    let ty = ty.replace(" __restrict__", "");
    if ty.ends_with('*') || declared.contains('*') {
        let ty = declared[..declared.rfind('*').expect("a pointer") + 1].trim();
        return Param::Ptr(ty.replace(" __restrict__", ""));
    }
    match ty.as_str() {
        "long long" => Param::I64,
        "int" => Param::I32,
        "float" => Param::F32,
        other => panic!("{kernel}: a parameter of type {other} (the emulator knows pointers, long long, int and float)"),
    }
}

/// The C wrapper that launches `kernel` from a word array.
fn wrapper(kernel: &str, params: &[Param]) -> String {
    let args: Vec<String> = params
        .iter()
        .enumerate()
        .map(|(k, p)| match p {
            Param::Ptr(ty) => format!("({ty})(uintptr_t)a[{k}]"),
            Param::I64 => format!("(long long)a[{k}]"),
            Param::I32 => format!("(int)(uint32_t)a[{k}]"),
            Param::F32 => format!("emu::f32(a[{k}])"),
        })
        .collect();
    format!(
        "extern \"C\" int emu__{kernel}(unsigned gx, unsigned gy, unsigned bx, const uint64_t* a) {{\n\
         \x20   return emu::launch(dim3{{gx, gy, 1}}, dim3{{bx, 1, 1}}, [a] {{ {kernel}({}); }});\n}}\n",
        args.join(", ")
    )
}
