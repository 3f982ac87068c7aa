//! A stage's gradients summed across its data-parallel replicas by NCCL, in place in the
//! stage's device memory, on a communication stream of its own (`--features cuda`).
//!
//! A communicator's ranks are a stage's data-parallel replicas, each on a GPU of its own:
//! [`NcclReduce::ranks`] makes this process's ranks of it (several inside one NCCL group,
//! as NCCL asks when one thread initializes several), from an id one rank made
//! ([`new_id`]) and the others received, over the job's bus between processes
//! (`train/replica_links.rs`). The all-reduce of the gradient buffer runs between the
//! backward and the update ([`super::ReplicaLink`]).
//!
//! The machines lent to this project have one GPU, on which NCCL refuses two ranks: only
//! a one-rank communicator has run (`debug.nccl_one_rank`, made by the same
//! [`NcclReduce::ranks`]), where the sum is the gradients themselves. Two ranks or more,
//! in one process or across processes, are built and have not run.

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

/// Whether NCCL's library loads here.
///
/// # Errors
/// Where it is not found, saying how to provide it.
pub(crate) fn loads() -> std::result::Result<(), String> {
    // SAFETY: only tries to open the library.
    match unsafe { cudarc::nccl::sys::is_culib_present() } {
        true => Ok(()),
        false => Err(NO_NCCL.into()),
    }
}

/// A new NCCL unique id, made by the rank that hands it to the others.
///
/// # Errors
/// Where NCCL does not load or cannot make one.
pub(crate) fn new_id() -> std::result::Result<[u8; 128], String> {
    loads()?;
    let id = Id::new().map_err(|e| format!("{e:?}"))?;
    Ok(id.internal().map(|b| b as u8))
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
        let id = new_id().map_err(failed(device, "ncclGetUniqueId"))?;
        let mut made = NcclReduce::ranks(&[(device, 0)], 1, id)?;
        made.pop()
            .ok_or_else(|| failed(device, "ncclCommInitRank")("no communicator".into()))
    }

    /// This process's ranks of a communicator of `world` ranks made from `id`: for each
    /// (device, rank) of `local`, that rank on that device, on a stream of its own. Every
    /// rank of the communicator must be made at about the same time, each process making
    /// its own: NCCL's initialization waits until all have joined.
    ///
    /// # Errors
    /// `Device` where NCCL does not load, a device cannot be opened, or NCCL refuses
    /// (for instance two ranks on one GPU).
    pub(crate) fn ranks(
        local: &[(usize, usize)],
        world: usize,
        id: [u8; 128],
    ) -> Result<Vec<NcclReduce>> {
        let first = local.first().map_or(0, |&(d, _)| d);
        loads().map_err(failed(first, "NCCL"))?;
        super::device::cuda_devices().map_err(failed(first, "the device"))?;
        // Every device opened and bound once before the group: a rank that failed inside
        // it would leave the others waiting for it.
        let mut streams = Vec::with_capacity(local.len());
        for &(device, _) in local {
            let fail = |what| failed(device, what);
            let ctx =
                CudaContext::new(device).map_err(|e| fail("opening the device")(e.to_string()))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| fail("creating a stream")(e.to_string()))?;
            (ctx.bind_to_thread()).map_err(|e| fail("binding the device")(e.to_string()))?;
            streams.push(stream);
        }
        let raw = id.map(|b| b as std::ffi::c_char);
        let grouped = local.len() > 1;
        let what = format!("ncclCommInitRank ({} of {world} ranks)", local.len());
        if grouped {
            cudarc::nccl::result::group_start()
                .map_err(|e| failed(first, "ncclGroupStart")(format!("{e:?}")))?;
        }
        let made: Vec<_> = local
            .iter()
            .zip(streams)
            .map(|(&(device, rank), stream)| {
                // NCCL takes the device of a rank from the thread's current one.
                (stream.context().bind_to_thread())
                    .map_err(|e| failed(device, "binding the device")(e.to_string()))?;
                Comm::from_rank(stream, rank, world, Id::uninit(raw))
                    .map_err(|e| failed(device, &what)(format!("{e:?}")))
                    .map(|comm| NcclReduce {
                        device,
                        comm: Mutex::new(comm),
                    })
            })
            .collect();
        if grouped {
            cudarc::nccl::result::group_end()
                .map_err(|e| failed(first, "ncclGroupEnd")(format!("{e:?}")))?;
        }
        made.into_iter().collect()
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
