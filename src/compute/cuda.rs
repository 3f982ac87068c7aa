//! What pipetrain owns on a GPU itself (`--features cuda`): a CUDA stream for each session,
//! lent to ONNX Runtime's CUDA provider as its compute stream, and NCCL.
//!
//! cudarc opens the driver and NCCL at run time (`dynamic-loading`), so this module builds
//! on a machine without CUDA; nothing here runs before [`super::check_device`] found the
//! device (cudarc's context constructor panics where the driver is missing).
//!
//! A session's stream belongs to the session (so to the actor that owns the session) and
//! outlives it: [`super::GraphSession`] drops ONNX Runtime's session before its stream.
//! Feeds and outputs are host memory for now: ONNX Runtime copies them to and from the
//! device around each run, on this stream, and the run returns once they are back.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::Id;

/// A CUDA stream on one device, created by pipetrain and lent to ONNX Runtime.
#[derive(Debug)]
pub struct DeviceStream {
    stream: Arc<CudaStream>,
}

impl DeviceStream {
    /// A new stream on device `index` (its primary context, the one ONNX Runtime uses).
    ///
    /// # Errors
    /// The driver's error, in words, when the device is missing or the stream cannot be
    /// made.
    pub fn new(index: usize) -> Result<DeviceStream, String> {
        super::device::cuda_devices()?;
        let ctx = CudaContext::new(index).map_err(|e| format!("cuda:{index}: {e}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("cuda:{index}: creating a stream: {e}"))?;
        Ok(DeviceStream { stream })
    }

    /// The raw `cudaStream_t`, as ONNX Runtime's `user_compute_stream` takes it.
    pub(crate) fn raw(&self) -> *mut () {
        self.stream.cu_stream() as *mut ()
    }

    /// `bytes` copied into a new buffer on this stream's device, in stream order: work
    /// queued on the stream later reads them complete. The buffer lives as long as the
    /// value returned, and goes back to the device in stream order too.
    ///
    /// # Errors
    /// The driver's error, in words.
    pub(crate) fn upload(&self, bytes: &[u8]) -> Result<Uploaded, String> {
        let buf = self
            .stream
            .clone_htod(bytes)
            .map_err(|e| format!("copying {} bytes to the device: {e}", bytes.len()))?;
        let addr = {
            let (ptr, _sync) = buf.device_ptr(&self.stream);
            ptr as usize
        };
        Ok(Uploaded { addr, _buf: buf })
    }
}

impl DeviceStream {
    /// A buffer of `bytes` bytes (zeroed) on this stream's device, at one address for as
    /// long as it lives: a fixed home for a value a CUDA graph reads or writes.
    ///
    /// # Errors
    /// The driver's error, in words.
    pub(crate) fn home(&self, bytes: usize) -> Result<DeviceHome, String> {
        let buf = (self.stream.alloc_zeros::<u8>(bytes.max(1)))
            .map_err(|e| format!("allocating {bytes} bytes on the device: {e}"))?;
        let addr = {
            let (ptr, _sync) = buf.device_ptr(&self.stream);
            ptr as usize
        };
        Ok(DeviceHome { addr, buf })
    }

    /// `bytes` copied into `home` in stream order: work queued on the stream later reads
    /// them (the host's bytes are free to change once this returns: a copy from pageable
    /// memory has taken them by then).
    ///
    /// # Errors
    /// The driver's error, in words, or a home of another size.
    pub(crate) fn write(&self, home: &mut DeviceHome, bytes: &[u8]) -> Result<(), String> {
        if bytes.len() > home.buf.len() {
            return Err(format!(
                "{} bytes for a home of {}",
                bytes.len(),
                home.buf.len()
            ));
        }
        let mut dst = home.buf.slice_mut(..bytes.len());
        (self.stream.memcpy_htod(bytes, &mut dst))
            .map_err(|e| format!("copying {} bytes to the device: {e}", bytes.len()))
    }
}

/// A device buffer at a fixed address ([`DeviceStream::home`]).
pub(crate) struct DeviceHome {
    /// The first byte's device address.
    pub addr: usize,
    buf: cudarc::driver::CudaSlice<u8>,
}

/// A host input copied to the device on a session's stream ([`DeviceStream::upload`]).
pub(crate) struct Uploaded {
    /// The first byte's device address.
    pub addr: usize,
    _buf: cudarc::driver::CudaSlice<u8>,
}

/// Copies `bytes.len()` bytes at device address `addr` of device `index` to `bytes`,
/// returning once they are there (`cuMemcpyDtoH`, ordered after all work on the device's
/// legacy stream; a value handed out by a finished run is complete).
///
/// # Errors
/// The driver's error, in words.
pub(crate) fn copy_to_host(index: usize, addr: usize, bytes: &mut [u8]) -> Result<(), String> {
    let ctx = CudaContext::new(index).map_err(|e| format!("cuda:{index}: {e}"))?;
    ctx.bind_to_thread()
        .map_err(|e| format!("cuda:{index}: {e}"))?;
    // SAFETY: the caller's `addr` holds `bytes.len()` bytes of a device value it keeps
    // alive for the call, on this context's device.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(bytes, addr as u64) }
        .map_err(|e| format!("cuda:{index}: copying a value to the host: {e}"))
}

/// Whether cuBLAS loads (pipetrain's CUDA attention runs its products there), in words.
pub fn cublas_found() -> &'static str {
    // SAFETY: only tries to open the library.
    match unsafe { cudarc::cublas::sys::is_culib_present() } {
        true => "found",
        false => "not found (PyPI's nvidia-cublas wheel: put its lib folder on LD_LIBRARY_PATH)",
    }
}

/// What the driver made of the flash attention kernels (`compute/kernels/flash.rs`) on
/// device `index`, for GPT-2's head size (64) and the emulator's (32): per kernel its
/// registers, local memory (spills) a thread and blocks of 64 threads an SM can hold, in
/// words. NVRTC compiles them here; the machine that builds cannot run ptxas.
///
/// # Errors
/// Where NVRTC or the device is missing, or a kernel does not load.
pub fn flash_kernels(index: usize) -> Result<String, String> {
    let ptx = super::cuda_launch::compile(super::kernels::ATTENTION_SOURCE, "attention.cu")?;
    let ctx = CudaContext::new(index).map_err(|e| format!("cuda:{index}: {e}"))?;
    let module = ctx
        .load_module(ptx)
        .map_err(|e| format!("loading attention.cu: {e}"))?;
    let mut parts = Vec::new();
    for d in [32, 64] {
        for kind in ["forward", "keys", "values", "queries"] {
            let name = format!("attn_flash_{kind}_{d}");
            let f = module
                .load_function(&name)
                .map_err(|e| format!("{name}: {e}"))?;
            let (regs, local, blocks) = (
                f.num_regs(),
                f.local_size_bytes(),
                f.occupancy_max_active_blocks_per_multiprocessor(64, 0, None),
            );
            let (regs, local, blocks) = (
                regs.map_err(|e| e.to_string())?,
                local.map_err(|e| e.to_string())?,
                blocks.map_err(|e| e.to_string())?,
            );
            parts.push(format!(
                "{kind}_{d} {regs} regs {local} B local {blocks} blocks/SM"
            ));
        }
    }
    Ok(parts.join("; "))
}

/// An NCCL unique id as text (hex), the form in which the rendezvous carries it from the
/// rank that made it to the others.
pub fn id_to_hex(id: &Id) -> String {
    id.internal()
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect()
}

/// Reads an id written by [`id_to_hex`].
///
/// # Errors
/// What is wrong with `text` (length, a character that is no hex digit).
pub fn id_from_hex(text: &str) -> Result<Id, String> {
    let bytes = text.as_bytes();
    let mut raw = [0 as std::ffi::c_char; 128];
    if bytes.len() != 2 * raw.len() {
        return Err(format!(
            "an NCCL id is {} hex digits, not {}",
            2 * raw.len(),
            bytes.len()
        ));
    }
    for (slot, pair) in raw.iter_mut().zip(bytes.chunks(2)) {
        let digits = std::str::from_utf8(pair).map_err(|e| e.to_string())?;
        let byte = u8::from_str_radix(digits, 16)
            .map_err(|_| format!("`{digits}` in an NCCL id is not a hex byte"))?;
        *slot = byte as std::ffi::c_char;
    }
    Ok(Id::uninit(raw))
}

/// Sums `[1, 2, 3, 4]` over an NCCL communicator of one rank on device `index` and reads
/// it back: the check `pipetrain doctor` runs that NCCL loads, makes a communicator and
/// reduces in place on its stream, as the step's all-reduce does (`cuda_nccl.rs`).
///
/// # Errors
/// Which step failed, with NCCL's or the driver's error.
pub fn nccl_self_check(index: usize) -> Result<(), String> {
    let nccl = super::cuda_nccl::NcclReduce::one_rank(index).map_err(|e| e.to_string())?;
    let stream = nccl.stream();
    let sent = [1.0f32, 2.0, 3.0, 4.0];
    let buf = stream.clone_htod(&sent).map_err(|e| e.to_string())?;
    let (addr, sync) = buf.device_ptr(&stream);
    let span = super::DeviceSpan {
        device: super::Device::Cuda(index),
        addr: addr as usize,
        len: sent.len(),
    };
    nccl.all_reduce(span).map_err(|e| e.to_string())?;
    drop(sync);
    let back = stream.clone_dtoh(&buf).map_err(|e| e.to_string())?;
    if back == sent {
        Ok(())
    } else {
        Err(format!(
            "all-reduce of {sent:?} over one rank gave {back:?}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_ids_survive_the_trip_through_text_and_bad_text_says_why() {
        let mut raw = [0 as std::ffi::c_char; 128];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = (i * 37 % 256) as u8 as std::ffi::c_char;
        }
        let text = id_to_hex(&Id::uninit(raw));
        assert_eq!(text.len(), 256);
        assert_eq!(id_from_hex(&text).unwrap().internal(), &raw);
        assert!(id_from_hex("00").unwrap_err().contains("256 hex digits"));
        let bad = format!("zz{}", &text[2..]);
        assert!(id_from_hex(&bad).unwrap_err().contains("`zz`"));
    }
}
