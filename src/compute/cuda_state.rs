//! [`DeviceState`] on a CUDA device: buffers allocated with cudarc on the stage's own
//! stream, and the kernels of `kernels/update.cu`, compiled at run time by NVRTC.
//!
//! Kernels take raw device addresses (the buffers never move while the state lives), and
//! every method synchronizes its stream before it returns: ONNX Runtime computes on
//! streams of its sessions' own, and a run starts only after the previous update ended
//! (its own end synchronizes its stream too), so host order is device order.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::cuda_launch::{compile, launch_planned, Launch};
use super::kernels::{self, SUM_BLOCKS, UPDATE_SOURCE};
use super::resident::{Buffer, DeviceSpan, DeviceState, GradBuffer};
use super::Device;
use crate::optim::ElementwiseStep;
use crate::{Error, Result};

struct Kernels {
    sgd: CudaFunction,
    sgd_momentum: CudaFunction,
    adam: CudaFunction,
    add_into: CudaFunction,
    sum_replicas: CudaFunction,
    sum_sq_blocks: CudaFunction,
    sum_blocks: CudaFunction,
}

/// A driver error while doing `what` on CUDA device `index`, as pipetrain's.
fn device_error(index: usize, what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Device {
        device: format!("cuda:{index}"),
        reason: format!("{what}: {e}"),
    }
}

/// A stage's buffers on CUDA device `index`.
pub(crate) struct CudaState {
    index: usize,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    scratch: Option<CudaSlice<f32>>,
    state: Vec<CudaSlice<f32>>,
    partial: CudaSlice<f64>,
    total: CudaSlice<f64>,
    /// The addresses a replica sum reads (`sum_replicas`), as last uploaded: the same
    /// every step, so uploaded once.
    sources: Option<(Vec<u64>, CudaSlice<u64>)>,
}

impl CudaState {
    /// Buffers for `params` and the optimizer's `state` on device `index`, uploaded;
    /// gradients zeroed.
    pub(crate) fn new(index: usize, params: &[f32], state: &[&[f32]]) -> Result<CudaState> {
        let fail = |what: &'static str| device_error(index, what);
        super::device::cuda_devices().map_err(|reason| Error::Device {
            device: format!("cuda:{index}"),
            reason,
        })?;
        let ctx = CudaContext::new(index).map_err(fail("opening the device"))?;
        let stream = ctx.new_stream().map_err(fail("creating a stream"))?;
        let ptx = compile(UPDATE_SOURCE, "update.cu").map_err(|reason| Error::Device {
            device: format!("cuda:{index}"),
            reason,
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(fail("loading the update kernels"))?;
        let f = |name: &'static str| module.load_function(name).map_err(fail(name));
        let kernels = Kernels {
            sgd: f("sgd")?,
            sgd_momentum: f("sgd_momentum")?,
            adam: f("adam")?,
            add_into: f("add_into")?,
            sum_replicas: f("sum_replicas")?,
            sum_sq_blocks: f("sum_sq_blocks")?,
            sum_blocks: f("sum_blocks")?,
        };
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(fail("allocating"))
        };
        let mut s = CudaState {
            index,
            params: alloc(params.len())?,
            grads: alloc(params.len())?,
            scratch: None,
            state: state
                .iter()
                .map(|b| alloc(b.len()))
                .collect::<Result<_>>()?,
            partial: stream
                .alloc_zeros::<f64>(SUM_BLOCKS as usize)
                .map_err(fail("allocating"))?,
            total: stream.alloc_zeros::<f64>(1).map_err(fail("allocating"))?,
            sources: None,
            kernels,
            stream,
        };
        s.upload(Buffer::Params, params)?;
        for (k, b) in state.iter().enumerate() {
            s.upload(Buffer::State(k), b)?;
        }
        Ok(s)
    }

    fn err<'a>(&self, what: &'a str) -> impl Fn(DriverError) -> Error + 'a {
        device_error(self.index, what)
    }

    fn addr(&self, buf: &CudaSlice<f32>) -> usize {
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        ptr as usize
    }

    fn span(&self, buf: &CudaSlice<f32>) -> DeviceSpan {
        DeviceSpan {
            device: Device::Cuda(self.index),
            addr: self.addr(buf),
            len: buf.len(),
        }
    }

    fn buffer(&mut self, which: Buffer) -> Result<&mut CudaSlice<f32>> {
        let index = self.index;
        match which {
            Buffer::Params => Ok(&mut self.params),
            Buffer::Grads => Ok(&mut self.grads),
            Buffer::State(k) => self.state.get_mut(k).ok_or_else(|| Error::Device {
                device: format!("cuda:{index}"),
                reason: format!("no optimizer state buffer {k}"),
            }),
        }
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(self.err("synchronizing"))
    }

    /// Queues `plan`, made by `compute::kernels` for this state's buffers.
    fn launch(&self, plan: &[Launch]) -> Result<()> {
        for l in plan {
            let k = &self.kernels;
            let f = match l.kernel {
                "sgd" => &k.sgd,
                "sgd_momentum" => &k.sgd_momentum,
                "adam" => &k.adam,
                "add_into" => &k.add_into,
                "sum_replicas" => &k.sum_replicas,
                "sum_sq_blocks" => &k.sum_sq_blocks,
                _ => &k.sum_blocks,
            };
            // SAFETY: the plans are made for this state's buffers, whose lengths they
            // reach; the emulator's tests hold them to `update.cu`'s signatures.
            unsafe { launch_planned(&self.stream, f, l) }
                .map_err(self.err("launching a kernel"))?;
        }
        Ok(())
    }
}

/// The address of value `offset` of the buffer at `base`.
fn at(base: usize, offset: usize) -> u64 {
    (base + offset * size_of::<f32>()) as u64
}

impl CudaState {
    /// The device address of a table holding `addrs`, uploaded where it changed.
    fn source_table(&mut self, addrs: Vec<u64>) -> Result<u64> {
        let fresh = match &self.sources {
            Some((kept, _)) => *kept != addrs,
            None => true,
        };
        if fresh {
            let table = self
                .stream
                .clone_htod(addrs.as_slice())
                .map_err(self.err("copying the replicas' addresses"))?;
            self.sources = Some((addrs, table));
        }
        let (_, table) = self.sources.as_ref().expect("made above");
        let (ptr, _sync) = table.device_ptr(&self.stream);
        Ok(ptr)
    }

    /// Refuses a span on another device or of another length than the gradients.
    fn check_peer(&self, span: &DeviceSpan) -> Result<()> {
        if span.device == Device::Cuda(self.index) && span.len == self.grads.len() {
            return Ok(());
        }
        Err(Error::Device {
            device: format!("cuda:{}", self.index),
            reason: format!(
                "a replica's gradients are {} values on {}, these {} on cuda:{}",
                span.len,
                span.device,
                self.grads.len(),
                self.index
            ),
        })
    }
}

impl GradBuffer for CudaState {
    fn grads(&self) -> DeviceSpan {
        self.span(&self.grads)
    }

    fn sum_grads(&mut self, sources: &[DeviceSpan], range: Range<usize>) -> Result<()> {
        sources.iter().try_for_each(|s| self.check_peer(s))?;
        if sources.is_empty() || range.is_empty() {
            return Ok(());
        }
        let addrs = sources.iter().map(|s| at(s.addr, range.start)).collect();
        let table = self.source_table(addrs)?;
        let dst = at(self.addr(&self.grads), range.start);
        self.launch(&[kernels::sum_replicas(
            dst,
            table,
            sources.len(),
            range.len(),
        )])?;
        self.sync()
    }

    fn copy_grads(&mut self, source: DeviceSpan, range: Range<usize>) -> Result<()> {
        self.check_peer(&source)?;
        if range.is_empty() {
            return Ok(());
        }
        let dst = at(self.addr(&self.grads), range.start);
        let bytes = range.len() * size_of::<f32>();
        // SAFETY: both spans hold `range` (checked against the gradients' length), on
        // this device; the replica that owns `source` does not write it during the
        // round (`compute/replicas.rs`).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst,
                at(source.addr, range.start),
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(self.err("copying a replica's gradients"))?;
        self.sync()
    }
}

impl DeviceState for CudaState {
    fn params(&self) -> DeviceSpan {
        self.span(&self.params)
    }

    fn scratch(&mut self) -> Result<DeviceSpan> {
        if self.scratch.is_none() {
            let n = self.grads.len();
            let buf = self
                .stream
                .alloc_zeros::<f32>(n)
                .map_err(self.err("allocating"))?;
            self.scratch = Some(buf);
        }
        Ok(self.span(self.scratch.as_ref().expect("made above")))
    }

    fn take_scratch(&mut self, ranges: &[(Range<usize>, bool)]) -> Result<()> {
        let from = self.scratch()?.addr;
        let to = self.addr(&self.grads);
        for (r, add) in ranges {
            let (acc, x) = (at(to, r.start), at(from, r.start));
            match add {
                true => self.launch(&[kernels::add_into(acc, x, r.len())])?,
                false => {
                    let scratch = self.scratch.as_ref().expect("made above");
                    let src = scratch.slice(r.clone());
                    let mut dst = self.grads.slice_mut(r.clone());
                    self.stream
                        .memcpy_dtod(&src, &mut dst)
                        .map_err(self.err("copying"))?;
                }
            }
        }
        self.sync()
    }

    fn zero_grads(&mut self, range: Range<usize>) -> Result<()> {
        let mut dst = self.grads.slice_mut(range);
        self.stream
            .memset_zeros(&mut dst)
            .map_err(self.err("zeroing"))?;
        self.sync()
    }

    fn set_grad(&mut self, index: usize, value: f32) -> Result<()> {
        let mut dst = self.grads.slice_mut(index..index + 1);
        self.stream
            .memcpy_htod(&[value], &mut dst)
            .map_err(self.err("copying"))?;
        self.sync()
    }

    fn grad_sum_sq(&mut self) -> Result<f64> {
        let g = self.addr(&self.grads) as u64;
        let (partial, _s) = self.partial.device_ptr(&self.stream);
        let (total, _t) = self.total.device_ptr(&self.stream);
        self.launch(&kernels::grad_sum_sq(g, self.grads.len(), partial, total))?;
        let mut out = [0f64];
        self.stream
            .memcpy_dtoh(&self.total, &mut out)
            .map_err(self.err("copying"))?;
        self.sync()?;
        Ok(out[0])
    }

    fn apply(&mut self, step: &ElementwiseStep, scale: f32) -> Result<()> {
        let (p, g) = (
            self.addr(&self.params) as u64,
            self.addr(&self.grads) as u64,
        );
        let st: Vec<u64> = self.state.iter().map(|b| self.addr(b) as u64).collect();
        let plan = kernels::update(step, scale, (p, g), &st).map_err(|reason| Error::Device {
            device: format!("cuda:{}", self.index),
            reason,
        })?;
        self.launch(&plan)?;
        self.sync()
    }

    fn download(&self, which: Buffer, host: &mut [f32]) -> Result<()> {
        let stream = self.stream.clone();
        let index = self.index;
        let buf = match which {
            Buffer::Params => &self.params,
            Buffer::Grads => &self.grads,
            Buffer::State(k) => self.state.get(k).ok_or_else(|| Error::Device {
                device: format!("cuda:{index}"),
                reason: format!("no optimizer state buffer {k}"),
            })?,
        };
        check_len(index, which, buf.len(), host.len())?;
        if !host.is_empty() {
            stream
                .memcpy_dtoh(&buf.slice(..host.len()), host)
                .map_err(|e| Error::Device {
                    device: format!("cuda:{index}"),
                    reason: format!("copying {which:?} to the host: {e}"),
                })?;
        }
        self.sync()
    }

    fn upload(&mut self, which: Buffer, host: &[f32]) -> Result<()> {
        let stream = self.stream.clone();
        let index = self.index;
        let buf = self.buffer(which)?;
        check_len(index, which, buf.len(), host.len())?;
        if !host.is_empty() {
            let mut dst = buf.slice_mut(..host.len());
            stream
                .memcpy_htod(host, &mut dst)
                .map_err(|e| Error::Device {
                    device: format!("cuda:{index}"),
                    reason: format!("copying {which:?} to the device: {e}"),
                })?;
        }
        self.sync()
    }
}

/// Refuses a host buffer of another length than the device's (which holds at least one
/// value, even for an empty stage).
fn check_len(index: usize, which: Buffer, device: usize, host: usize) -> Result<()> {
    if host == device || (host == 0 && device == 1) {
        return Ok(());
    }
    Err(Error::Device {
        device: format!("cuda:{index}"),
        reason: format!("{which:?}: {host} values on the host, {device} on the device"),
    })
}

#[cfg(test)]
mod tests;
