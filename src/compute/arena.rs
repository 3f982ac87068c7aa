//! One CPU memory arena for the process's training sessions, grown by what is asked for.
//!
//! Each ONNX Runtime session has its own CPU arena by default, and an arena grows to the
//! next power of two of what it is asked for: a training step of GPT-2 small (4 x 128
//! tokens) planned about 2 GB of activations and kept an arena of about 2.5 GB. This
//! registers one arena in the environment with ONNX Runtime's `kSameAsRequested` growth,
//! which the training sessions share (`session.use_env_allocators`): the step's memory is
//! what its plan needs, and sessions that do not run at once share it.
//!
//! `ort` offers no arena settings for the CPU provider, so this calls ONNX Runtime's C
//! API (`CreateArenaCfgV2`, `CreateAndRegisterAllocator`) through `ort::api()`.

use std::ffi::{c_char, CStr};

use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::AsPointer;

use crate::{Error, Result};

/// ONNX Runtime's `ArenaExtendStrategy::kSameAsRequested`.
const SAME_AS_REQUESTED: usize = 1;

/// Registers the shared CPU arena in `env` (once per environment, which is once per
/// process: see `Runtime::init`).
///
/// # Errors
/// `Ort`-like `RuntimeLibrary` when ONNX Runtime refuses the arena.
pub(crate) fn register(env: &ort::environment::Environment) -> Result<()> {
    let api = ort::api();
    let keys: [*const c_char; 1] = [c"arena_extend_strategy".as_ptr()];
    let values: [usize; 1] = [SAME_AS_REQUESTED];
    let mut cfg = std::ptr::null_mut();
    // SAFETY: two arrays of one key and one value, and an out pointer ONNX Runtime fills.
    let status = unsafe { (api.CreateArenaCfgV2)(keys.as_ptr(), values.as_ptr(), 1, &mut cfg) };
    check(status, "configuring the CPU arena")?;
    let info = MemoryInfo::new(
        AllocationDevice::CPU,
        0,
        AllocatorType::Arena,
        MemoryType::Default,
    )
    .map_err(|e| Error::RuntimeLibrary {
        reason: format!("the CPU arena's memory info: {e}"),
    })?;
    // SAFETY: the environment, memory info and arena configuration are live; ONNX Runtime
    // copies what it keeps of them.
    let status = unsafe { (api.CreateAndRegisterAllocator)(env.ptr().cast_mut(), info.ptr(), cfg) };
    // SAFETY: made by CreateArenaCfgV2 above, released once.
    unsafe { (api.ReleaseArenaCfg)(cfg) };
    check(status, "registering the CPU arena")
}

/// An error for a non-null ONNX Runtime status (which is released).
pub(super) fn check(status: ort::sys::OrtStatusPtr, what: &str) -> Result<()> {
    let api = ort::api();
    let Some(ptr) = std::ptr::NonNull::new(status.0) else {
        return Ok(());
    };
    // SAFETY: a live status; its message is read before the status is released.
    let message = unsafe { CStr::from_ptr((api.GetErrorMessage)(ptr.as_ptr())) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: released once, after its message was copied.
    unsafe { (api.ReleaseStatus)(ptr.as_ptr()) };
    Err(Error::RuntimeLibrary {
        reason: format!("{what}: {message}"),
    })
}
