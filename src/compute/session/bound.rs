//! [`GraphSession`] running through ONNX Runtime's I/O binding, for a stage that keeps its
//! state on its device and leaves the values it hands on there too: the parameters read
//! and the gradients written in place in the stage's device buffers (as
//! [`GraphSession::run_device`]), values an earlier run left on the device bound as they
//! are, and the outputs the stage hands on (to its backward, to the next stage) left
//! where ONNX Runtime computed them, as [`DeviceValue`]s. ONNX Runtime's plain `Run`
//! copies every output it did not get a buffer for to the host; a binding can ask for an
//! output on a device without knowing its shape beforehand
//! (`IoBinding::bind_output_to_device`).
//!
//! Every output is bound anew before each run: ONNX Runtime reuses a bound output's
//! memory in the next run of the same binding, which would write over a value handed on
//! from the last one. Host inputs (data, the backward's seed) are copied to a GPU by
//! pipetrain, on the session's own stream ahead of the run: a host value bound as it is
//! would be copied when bound, outside that stream, and the run would not wait for it
//! (ONNX Runtime leaves that to `SynchronizeBoundInputs`, a wait for the whole device,
//! which would hold each stage's run until the other stages' work on the GPU is done).

use ort::memory::MemoryInfo;
use ort::sys::ONNXTensorElementDataType as Elem;
use ort::value::DynValue;

use super::super::direct::{over, over_bytes, Target};
use super::super::resident::{memory_info, DeviceSpan};
use super::super::value::{DeviceValue, Value};
use super::super::Device;
use super::device::on_device;
use super::{to_host, GraphSession};
use crate::tensor::{TensorView, ViewData};
use crate::{Error, Result};

/// A bound run's inputs: host tensors, the stage's parameters in device memory (name,
/// span, shape), and values earlier runs left on the device.
pub struct BoundInputs<'a> {
    /// Host tensors (data, the backward's seed, messages from a stage on the host).
    pub host: Vec<(&'a str, TensorView<'a>)>,
    /// Parameters read in place from the stage's device buffer.
    pub device: Vec<(&'a str, DeviceSpan, &'a [usize])>,
    /// Values left on the device by earlier runs (messages, the stash).
    pub held: Vec<(&'a str, &'a DeviceValue)>,
}

impl GraphSession {
    /// Runs the graph on `inputs`, the float32 outputs named by `targets` written in place
    /// into their ranges of the device buffer `out`, the outputs `keep` names left in
    /// `out`'s device's memory, and the others copied to the host; all but the targets
    /// come back by name, in the graph's order. Returns once the device has finished the
    /// run (ONNX Runtime synchronizes its stream at a run's end).
    ///
    /// # Errors
    /// As [`GraphSession::run_device`].
    pub fn run_bound(
        &mut self,
        inputs: &BoundInputs<'_>,
        out: DeviceSpan,
        targets: &[Target<'_>],
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<(String, Value)>> {
        self.not_replayed()?;
        let ctx = || format!("running {}", self.label);
        let info = memory_info(out.device).map_err(Error::ort(ctx()))?;
        let host_info = memory_info(Device::Cpu).map_err(Error::ort(ctx()))?;
        let mut binding = self.session.create_binding().map_err(Error::ort(ctx()))?;
        let mut uploads = Vec::new();
        for (name, t) in &inputs.host {
            let value = self.host_input(t, (&info, &host_info), &mut uploads)?;
            binding
                .bind_input(*name, &value)
                .map_err(Error::ort(ctx()))?;
        }
        for (name, span, shape) in &inputs.device {
            let value = over(&info, span.addr as *mut f32, shape, &self.label)?;
            binding
                .bind_input(*name, &value)
                .map_err(Error::ort(ctx()))?;
        }
        for (name, held) in &inputs.held {
            binding
                .bind_input(*name, held.ort())
                .map_err(Error::ort(ctx()))?;
        }
        for (k, name) in self.outputs.iter().enumerate() {
            let bound = match targets.iter().find(|t| t.output == k) {
                Some(t) => {
                    t.check_fits(out.len, name)?;
                    let at = out.addr + t.offset * size_of::<f32>();
                    let value = over(&info, at as *mut f32, t.shape, &self.label)?;
                    binding.bind_output(name.as_str(), value)
                }
                None if keep(name) => binding.bind_output_to_device(name.as_str(), &info),
                None => binding.bind_output_to_device(name.as_str(), &host_info),
            };
            bound.map_err(Error::ort(ctx()))?;
        }
        let started = std::time::Instant::now();
        let mut outputs = self
            .session
            .run_binding(&binding)
            .map_err(Error::ort(ctx()))?;
        let run_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(target: "pipetrain::device", session = %self.label, run_ms, "run, bound");
        let taken = distinct_outputs(&self.outputs, &mut outputs, &self.label)?;
        drop(outputs);
        let mut result = Vec::with_capacity(taken.len());
        for (k, value) in taken {
            let name = &self.outputs[k];
            match targets.iter().find(|t| t.output == k) {
                Some(t) => on_device(&value, name, t, &out, &self.label)?,
                None if keep(name) => {
                    let held = DeviceValue::new(value, name, out.device)?;
                    result.push((name.clone(), Value::Device(held)));
                }
                None => result.push((name.clone(), Value::Host(to_host(&value, name)?))),
            }
        }
        drop(uploads);
        Ok(result)
    }

    /// A host input as the run reads it: on a GPU, copied to the device on the
    /// session's own stream, ahead of the run's kernels (the buffer kept in `uploads`
    /// until the run is over); on the CPU, lent as it is.
    fn host_input(
        &self,
        t: &TensorView<'_>,
        (info, host_info): (&MemoryInfo, &MemoryInfo),
        uploads: &mut Vec<Upload>,
    ) -> Result<DynValue> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.stream.as_ref() {
            let up = stream.upload(bytes_of(t)).map_err(|reason| Error::Device {
                device: self.label.clone(),
                reason,
            })?;
            let at = up.addr as *mut std::ffi::c_void;
            uploads.push(up);
            // SAFETY: the upload holds the view's bytes on the device until the run is
            // over (`uploads` outlives it).
            return unsafe { over_bytes(info, at, t.bytes(), (t.shape, elem(t)), &self.label) };
        }
        let _ = (info, &uploads);
        // SAFETY: the view's elements outlive the run that reads them through the
        // value, and an input is never written.
        let at = bytes_of(t).as_ptr().cast_mut().cast();
        unsafe { over_bytes(host_info, at, t.bytes(), (t.shape, elem(t)), &self.label) }
    }
}

/// A bound run's outputs (`names`, the graph's) taken from `outputs` by index, in the
/// graph's order: each once, since a graph may list an output twice, and it is bound,
/// and comes back, once.
///
/// # Errors
/// `BadTensor` naming an output the run of `label` did not produce.
pub(super) fn distinct_outputs(
    names: &[String],
    outputs: &mut ort::session::SessionOutputs<'_>,
    label: &str,
) -> Result<Vec<(usize, DynValue)>> {
    let mut taken = Vec::with_capacity(names.len());
    for (k, name) in names.iter().enumerate() {
        if names[..k].contains(name) {
            continue;
        }
        let value: DynValue = outputs.remove(name).ok_or_else(|| Error::BadTensor {
            name: name.clone(),
            reason: format!("{label} did not produce this output"),
        })?;
        taken.push((k, value));
    }
    Ok(taken)
}

/// What keeps an uploaded host input on the device for a run.
#[cfg(feature = "cuda")]
type Upload = super::super::cuda::Uploaded;
#[cfg(not(feature = "cuda"))]
type Upload = ();

/// ONNX's element type of a view's elements.
pub(super) fn elem(t: &TensorView<'_>) -> Elem {
    match t.data {
        ViewData::F32(_) => Elem::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
        ViewData::F64(_) => Elem::ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
        ViewData::I64(_) => Elem::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
        ViewData::I32(_) => Elem::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
        ViewData::Bool(_) => Elem::ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
    }
}

/// A view's elements as bytes (a `bool` is one byte, as ONNX's).
pub(super) fn bytes_of<'a>(t: &TensorView<'a>) -> &'a [u8] {
    match t.data {
        ViewData::F32(v) => bytemuck::cast_slice(v),
        ViewData::F64(v) => bytemuck::cast_slice(v),
        ViewData::I64(v) => bytemuck::cast_slice(v),
        ViewData::I32(v) => bytemuck::cast_slice(v),
        // SAFETY: a `bool` is one byte holding 0 or 1.
        ViewData::Bool(v) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{Buffer, DeviceState, HostState, Runtime, SessionOptions};
    use crate::graph::{make_node, ValueMeta};
    use crate::tensor::Tensor;

    fn model(
        name: &str,
        nodes: Vec<crate::onnx::proto::NodeProto>,
        inputs: &[&str],
        outputs: &[&str],
    ) -> crate::onnx::proto::ModelProto {
        let typed: Vec<(&str, ValueMeta)> = (inputs.iter())
            .map(|n| (*n, ValueMeta::f32(&[2, 3])))
            .collect();
        crate::compute::test_model::standard_model(name, nodes, &typed, outputs)
    }

    /// A run leaves `y = x * w` where it computed it (once, though the graph lists it
    /// twice) and writes `g = x + x` into the state's gradient buffer; a second session
    /// reads `y` as it is and hands `y + y` to the host; `y` copied to the host holds its
    /// values.
    fn hand_off(device: Device, state: Box<dyn DeviceState>) {
        let rt = Runtime::from_env().unwrap();
        let opts = SessionOptions {
            device,
            ..SessionOptions::default()
        };
        let first = model(
            "first",
            vec![
                make_node("Mul", "mul", &["x", "w"], &["y"], vec![]),
                make_node("Add", "add", &["x", "x"], &["g"], vec![]),
                make_node("Identity", "id", &["x"], &["x_out"], vec![]),
            ],
            &["x", "w"],
            // An output listed twice, as a gradient graph may list one.
            &["y", "g", "x_out", "y"],
        );
        let second = model(
            "second",
            vec![make_node("Add", "add", &["y", "y"], &["z"], vec![])],
            &["y"],
            &["z"],
        );
        let mut a = GraphSession::from_model(&rt, &first, &opts, "first").unwrap();
        let mut b = GraphSession::from_model(&rt, &second, &opts, "second").unwrap();
        let x: Vec<f32> = vec![1.0, -2.0, 3.5, 0.25, 8.0, -0.5];
        let xt = Tensor::f32(vec![2, 3], x.clone()).unwrap();
        let shape = [2usize, 3];
        let inputs = BoundInputs {
            host: vec![("x", xt.view())],
            device: vec![("w", state.params(), &shape)],
            held: vec![],
        };
        let g = Target {
            output: 1,
            offset: 0,
            shape: &shape,
        };
        let out = a
            .run_bound(&inputs, state.grads(), &[g], &|n| n == "y")
            .unwrap();
        let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["y", "x_out"]);
        let Value::Device(y) = &out[0].1 else {
            panic!("y came to the host")
        };
        assert_eq!(y.device(), device);
        assert!(
            matches!(out[1].1, Value::Host(_)),
            "x_out stays on the host"
        );
        let want: Vec<f32> = x.iter().zip(w()).map(|(a, b)| a * b).collect();
        assert_eq!(y.to_host("y").unwrap().as_f32().unwrap(), want);
        let mut grads = vec![0f32; 6];
        state.download(Buffer::Grads, &mut grads).unwrap();
        assert_eq!(grads, x.iter().map(|v| v + v).collect::<Vec<_>>());
        let inputs = BoundInputs {
            host: vec![],
            device: vec![],
            held: vec![("y", y)],
        };
        let z = b
            .run_bound(&inputs, state.grads(), &[], &|_| false)
            .unwrap();
        let Value::Host(z) = &z[0].1 else {
            panic!("z stayed on the device")
        };
        let twice: Vec<f32> = want.iter().map(|v| v + v).collect();
        assert_eq!(z.as_f32().unwrap(), twice);
    }

    fn w() -> Vec<f32> {
        (0..6).map(|i| i as f32 * 0.5 - 1.0).collect()
    }

    #[test]
    fn a_value_left_where_it_was_computed_feeds_the_next_session_and_comes_back_intact() {
        hand_off(Device::Cpu, Box::new(HostState::new(&w(), &[])));
    }

    /// The same on a GPU (skipped without one): `y` in device memory, `x` uploaded on
    /// the session's stream, `y` copied back with the driver.
    #[cfg(feature = "cuda")]
    #[test]
    fn on_a_gpu_a_value_left_on_the_device_feeds_the_next_session_and_comes_back_intact() {
        if crate::compute::test_model::no_gpu() {
            return;
        }
        let state = crate::compute::cuda_state::CudaState::new(0, &w(), &[]).unwrap();
        hand_off(Device::Cuda(0), Box::new(state));
    }
}
