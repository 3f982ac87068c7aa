//! Running a [`GraphSession`]: its feeds lent to ONNX Runtime, its outputs directed into
//! a caller's buffer or copied to the host, and the run options that go with them.

use std::borrow::Cow;

use ort::session::{RunOptions, SelectedOutputMarker, SessionInputValue};
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};

use super::super::direct::{accumulator, in_place, DirectOutputs, Target};
use super::GraphSession;
use crate::tensor::{Tensor, TensorData, TensorView, ViewData};
use crate::{Error, Result};

impl GraphSession {
    /// Copies the float32 outputs it returns into `pool`'s buffers from now on.
    pub fn use_host_pool(&mut self, pool: &crate::compute::HostPool) {
        self.pool = Some(pool.clone());
    }

    /// [`GraphSession::run_views_into`] where ONNX Runtime writes the float32 outputs
    /// named by `targets` straight into their ranges of `buf` (a step's first gradients,
    /// into the accumulators); the other outputs go to `sink` or are returned as there.
    ///
    /// # Errors
    /// As [`GraphSession::run_views_into`]; `BadTensor` when a target does not fit `buf`
    /// or ONNX Runtime produced it with another shape.
    pub fn run_views_direct(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        buf: &mut [f32],
        targets: &[Target<'_>],
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        self.run_views_accumulating(feeds, buf, targets, &[], sink)
    }

    /// [`GraphSession::run_views_direct`], and for a graph that adds its gradients into
    /// the accumulators it reads (`graph::accumulating`), input `acc[j].0` fed the range
    /// of `buf` that `targets[acc[j].1]` names, the range the sum is written into.
    ///
    /// # Errors
    /// As [`GraphSession::run_views_direct`].
    pub fn run_views_accumulating(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        buf: &mut [f32],
        targets: &[Target<'_>],
        acc: &[(&str, usize)],
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        if !self.direct.as_ref().is_some_and(|d| d.fits(buf, targets)) {
            let mut d = DirectOutputs::new(buf, targets, &self.outputs, &self.label)?;
            if self.shrink.is_some() {
                shrinking(&mut d.options, &self.label)?;
            }
            self.direct = Some(d);
        }
        self.run_with(feeds, Some((buf, targets)), acc, sink)
    }

    /// Has ONNX Runtime hand the regions of the CPU arena that no value uses back to the
    /// system after each run of this session (its `memory.enable_memory_arena_shrinkage`).
    /// For the pieces of a gradient graph, which run one after another with outputs of
    /// many sizes: the arena would otherwise keep growing by new regions where freed
    /// ones were split for smaller values, up to the stage's gradients in all.
    ///
    /// # Errors
    /// `Ort` when ONNX Runtime refuses the option.
    pub fn shrink_arena_after_runs(&mut self) -> Result<()> {
        let mut options = RunOptions::new().map_err(Error::ort("making run options"))?;
        shrinking(&mut options, &self.label)?;
        self.shrink = Some(options);
        self.direct = None;
        Ok(())
    }

    /// Runs the graph, with the outputs directed into a buffer when `direct` says so
    /// (then `self.direct` holds the options made for it), the rest offered to `sink`.
    pub(super) fn run_with(
        &mut self,
        feeds: &[(&str, TensorView<'_>)],
        mut direct: Option<(&mut [f32], &[Target<'_>])>,
        acc: &[(&str, usize)],
        sink: &mut dyn FnMut(&str, &[f32]) -> Result<bool>,
    ) -> Result<Vec<(String, Tensor)>> {
        self.not_replayed()?;
        let GraphSession {
            session,
            label,
            outputs: names,
            direct: options,
            pool,
            shrink,
            ..
        } = self;
        let ctx = || format!("running {label}");
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(feeds.len());
        for (name, t) in feeds {
            inputs.push((Cow::Borrowed(*name), view(t).map_err(Error::ort(ctx()))?));
        }
        if let Some((buf, targets)) = direct.as_mut() {
            for &(name, j) in acc {
                let value = accumulator(buf, &targets[j]).map_err(Error::ort(ctx()))?;
                inputs.push((Cow::Borrowed(name), value));
            }
        }
        let outputs = match (&direct, options.as_ref(), shrink.as_ref()) {
            (Some(_), Some(d), _) => session.run_with_options(inputs, &d.options),
            (_, _, Some(shrink)) => session.run_with_options(inputs, shrink),
            _ => session.run(inputs),
        }
        .map_err(Error::ort(ctx()))?;
        let (buf, targets) = direct.unwrap_or((&mut [], &[]));
        let mut result = Vec::with_capacity(names.len());
        for (k, name) in names.iter().enumerate() {
            let value = produced(&outputs, name, label)?;
            if let Some(t) = targets.iter().find(|t| t.output == k) {
                in_place(value, name, t, buf, label)?;
                continue;
            }
            if let Ok((_, values)) = value.try_extract_tensor::<f32>() {
                if sink(name, values)? {
                    continue;
                }
            }
            result.push((name.clone(), to_host_in(value, name, pool.as_ref())?));
        }
        Ok(result)
    }
}

/// Output `name` of a run of `label`.
pub(super) fn produced<'a>(
    outputs: &'a ort::session::SessionOutputs<'_>,
    name: &str,
    label: &str,
) -> Result<&'a DynValue> {
    outputs.get(name).ok_or_else(|| Error::BadTensor {
        name: name.into(),
        reason: format!("{label} did not produce this output"),
    })
}

/// Lends a host tensor to ONNX Runtime.
pub(super) fn view<'a>(t: &TensorView<'a>) -> ort::Result<SessionInputValue<'a>> {
    let shape = t.shape.to_vec();
    Ok(match t.data {
        ViewData::F32(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::F64(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::I64(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::I32(v) => TensorRef::from_array_view((shape, v))?.into(),
        ViewData::Bool(v) => TensorRef::from_array_view((shape, v))?.into(),
    })
}

/// Copies an ONNX Runtime output into a host tensor.
/// Sets `options` to shrink the CPU arena after the run.
fn shrinking<O: SelectedOutputMarker>(options: &mut RunOptions<O>, label: &str) -> Result<()> {
    (options.set("memory.enable_memory_arena_shrinkage", "cpu:0"))
        .map_err(Error::ort(format!("asking {label} to shrink its arena")))
}

pub(crate) fn to_host(value: &DynValue, name: &str) -> Result<Tensor> {
    to_host_in(value, name, None)
}

/// [`to_host`], float32 values copied into a buffer of `pool`'s where one is given.
fn to_host_in(
    value: &DynValue,
    name: &str,
    pool: Option<&crate::compute::HostPool>,
) -> Result<Tensor> {
    if let (Some(pool), Ok((shape, data))) = (pool, value.try_extract_tensor::<f32>()) {
        let shape = shape.iter().map(|&d| d as usize).collect();
        return Tensor::new(shape, TensorData::F32(pool.copy_of(data)));
    }
    let bad = |reason: String| Error::BadTensor {
        name: name.into(),
        reason,
    };
    let ValueType::Tensor { ty, .. } = value.dtype() else {
        return Err(bad("output is not a tensor".into()));
    };
    let ctx = || format!("reading output `{name}`");
    macro_rules! take {
        ($t:ty, $variant:ident) => {{
            let (shape, data) = value
                .try_extract_tensor::<$t>()
                .map_err(Error::ort(ctx()))?;
            let shape = shape.iter().map(|&d| d as usize).collect();
            Tensor::new(shape, TensorData::$variant(data.to_vec()))
        }};
    }
    match ty {
        TensorElementType::Float32 => take!(f32, F32),
        TensorElementType::Float64 => take!(f64, F64),
        TensorElementType::Int64 => take!(i64, I64),
        TensorElementType::Int32 => take!(i32, I32),
        TensorElementType::Bool => take!(bool, Bool),
        other => Err(bad(format!("unsupported output element type {other:?}"))),
    }
}
