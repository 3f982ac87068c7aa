//! A stage's gradients summed across its data-parallel replicas by NCCL, in place in the
//! stage's device memory, on a communication stream of its own (`--features cuda`).
//!
//! What is built is the step's side: a communicator on the stage's device and the
//! all-reduce of the gradient buffer between the backward and the update
//! ([`super::ReplicaLink`]). Making the communicators of replicas on several GPUs (a
//! device per replica, the NCCL id carried to every rank) is not: the machines lent to
//! this project have one GPU, on which NCCL refuses two ranks. `debug.nccl_one_rank` runs
//! a one-rank communicator through this path, where the sum is the gradients themselves.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::resident::DeviceSpan;
use crate::{Error, Result};

/// NCCL's library under a name cudarc looks for: PyPI's `nvidia-nccl-cu13` ships only
/// `libnccl.so.2`, so a link named `libnccl.so` on `LD_LIBRARY_PATH` is needed.
const NO_NCCL: &str = "NCCL not found: put a folder with libnccl.so on LD_LIBRARY_PATH (PyPI's nvidia-nccl wheel has libnccl.so.2 only: link libnccl.so to it)";

/// An NCCL communicator of one stage's replicas, this replica's rank in it.
pub(crate) struct NcclReduce {
    device: usize,
    comm: Mutex<Comm>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time: the
// mutex makes the calls one at a time, and the communicator is destroyed once.
unsafe impl Send for NcclReduce {}
// SAFETY: as above; every use goes through the mutex.
unsafe impl Sync for NcclReduce {}

/// Gradients at a device address, as cudarc's NCCL calls take a buffer.
struct Span {
    addr: u64,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<f32> for Span {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtrMut<f32> for Span {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        // Ordered by the host: the stage's calls return once their device work is done.
        (self.addr, SyncOnDrop::Sync(None))
    }
}

fn failed(device: usize, what: &str) -> impl Fn(String) -> Error + '_ {
    move |reason| Error::Device {
        device: format!("cuda:{device}"),
        reason: format!("{what}: {reason}"),
    }
}

impl NcclReduce {
    /// A communicator of one rank on device `device`, on a stream of its own.
    ///
    /// # Errors
    /// `Device` where NCCL does not load or the communicator cannot be made.
    pub(crate) fn one_rank(device: usize) -> Result<NcclReduce> {
        let fail = |what| failed(device, what);
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(fail("NCCL")(NO_NCCL.into()));
        }
        super::device::cuda_devices().map_err(fail("the device"))?;
        let ctx =
            CudaContext::new(device).map_err(|e| fail("opening the device")(e.to_string()))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| fail("creating a stream")(e.to_string()))?;
        let id = Id::new().map_err(|e| fail("ncclGetUniqueId")(format!("{e:?}")))?;
        let comm = Comm::from_rank(stream, 0, 1, id)
            .map_err(|e| fail("ncclCommInitRank (1 rank)")(format!("{e:?}")))?;
        Ok(NcclReduce {
            device,
            comm: Mutex::new(comm),
        })
    }

    /// This rank and the communicator's size.
    pub(crate) fn rank(&self) -> (usize, usize) {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        (comm.rank(), comm.world_size())
    }

    /// The stream the communicator reduces on.
    pub(crate) fn stream(&self) -> Arc<CudaStream> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner()).stream()
    }

    /// Sums `grads` across the communicator's ranks in place; returns once it is done.
    ///
    /// # Errors
    /// `Device` when the span is on another device or NCCL fails.
    pub(crate) fn all_reduce(&self, grads: DeviceSpan) -> Result<()> {
        let fail = |what| failed(self.device, what);
        if grads.device != super::Device::Cuda(self.device) {
            return Err(fail("all-reduce")(format!(
                "gradients on {}, the communicator on cuda:{}",
                grads.device, self.device
            )));
        }
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let stream = comm.stream();
        let mut span = Span {
            addr: grads.addr as u64,
            len: grads.len,
            stream: stream.clone(),
        };
        comm.all_reduce_in_place(&mut span, &ReduceOp::Sum)
            .map_err(|e| fail("ncclAllReduce")(format!("{e:?}")))?;
        stream
            .synchronize()
            .map_err(|e| fail("synchronizing")(e.to_string()))
    }
}
