//! Host buffers page-locked for a GPU stage, so that ONNX Runtime's copies of the
//! parameters to the device and of the gradients back run at the bus's speed.
//!
//! A stage on a GPU keeps its parameters and gradients in flat host buffers, which ONNX
//! Runtime copies around every run. From ordinary (pageable) memory the driver stages
//! such a copy through a bounce buffer of its own; from page-locked memory it copies
//! directly (the driver recognizes registered memory by address, nothing else changes).
//! [`PinnedBuffers`] registers a stage's buffers with the driver (`cuMemHostRegister`)
//! and unregisters them before they can be freed or handed away: memory that is freed
//! while registered would leave the driver copying from pages no longer the buffer's.
//!
//! On the CPU, and in builds without `--features cuda`, nothing is registered.

use super::Device;

/// The page-locked buffers of one stage, by address and length.
pub struct PinnedBuffers {
    device: Device,
    #[cfg(feature = "cuda")]
    inner: locked::Locks,
}

impl std::fmt::Debug for PinnedBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffers")
            .field("device", &self.device)
            .finish()
    }
}

impl PinnedBuffers {
    /// Buffers of a stage computing on `device` (nothing is locked on the CPU).
    pub fn new(device: Device) -> PinnedBuffers {
        PinnedBuffers {
            device,
            #[cfg(feature = "cuda")]
            inner: locked::Locks::default(),
        }
    }

    /// Page-locks `buf` unless it already is (same address and length). A failure is
    /// logged once and the buffer stays pageable: copies are slower, nothing else.
    pub fn keep(&mut self, buf: &[f32]) {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(index) = self.device {
            self.inner.keep(index, buf);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = buf;
    }

    /// Unlocks `buf` (if it was locked): call before the buffer is handed away or freed.
    pub fn release(&mut self, buf: &[f32]) {
        #[cfg(feature = "cuda")]
        self.inner.release(buf);
        #[cfg(not(feature = "cuda"))]
        let _ = buf;
    }
}

#[cfg(feature = "cuda")]
mod locked {
    use std::ffi::c_void;
    use std::sync::Arc;

    use cudarc::driver::{sys, CudaContext};

    /// One registered range.
    struct Lock {
        addr: usize,
        len: usize,
    }

    impl Drop for Lock {
        fn drop(&mut self) {
            // SAFETY: `addr` was registered by `Locks::keep` and is unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.addr as *mut c_void) }.result();
        }
    }

    #[derive(Default)]
    pub(super) struct Locks {
        /// The device's primary context, current on the registering thread.
        ctx: Option<Arc<CudaContext>>,
        /// Emptied first when dropped (see `Drop`), while the context is still held.
        locks: Vec<Lock>,
        warned: bool,
    }

    impl Drop for Locks {
        fn drop(&mut self) {
            // The driver unregisters within a context: the one the ranges were locked
            // in, made current on whatever thread drops the stage.
            if let Some(ctx) = &self.ctx {
                let _ = ctx.bind_to_thread();
            }
            self.locks.clear();
        }
    }

    impl Locks {
        pub(super) fn keep(&mut self, index: usize, buf: &[f32]) {
            let (addr, len) = (buf.as_ptr() as usize, std::mem::size_of_val(buf));
            if len == 0 || self.locks.iter().any(|l| l.addr == addr && l.len == len) {
                return;
            }
            // A range that moved or changed length is no longer this buffer's.
            self.locks.retain(|l| !overlaps(l, addr, len));
            match self.register(index, addr, len) {
                Ok(()) => self.locks.push(Lock { addr, len }),
                Err(e) if !self.warned => {
                    self.warned = true;
                    tracing::warn!(
                        "cuda:{index}: page-locking a {len}-byte buffer failed ({e}); \
                         its copies to and from the device stay slower"
                    );
                }
                Err(_) => {}
            }
        }

        pub(super) fn release(&mut self, buf: &[f32]) {
            let addr = buf.as_ptr() as usize;
            self.locks.retain(|l| l.addr != addr);
        }

        fn register(&mut self, index: usize, addr: usize, len: usize) -> Result<(), String> {
            if self.ctx.is_none() {
                crate::compute::cuda_devices()?;
                self.ctx = Some(CudaContext::new(index).map_err(|e| e.to_string())?);
            }
            if let Some(ctx) = &self.ctx {
                ctx.bind_to_thread().map_err(|e| e.to_string())?;
            }
            // SAFETY: `addr..addr + len` is a live host buffer the caller borrows; the
            // registration is undone (`Lock::drop`) before the stage lets it go.
            unsafe {
                sys::cuMemHostRegister_v2(
                    addr as *mut c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result()
            .map_err(|e| e.to_string())
        }
    }

    fn overlaps(l: &Lock, addr: usize, len: usize) -> bool {
        l.addr < addr + len && addr < l.addr + l.len
    }
}
