//! [`OrtStage`] running one of its graphs: feeds from the parameters, the messages and
//! the backward seed; parameter gradients into the step's accumulators (a step's first
//! written there by ONNX Runtime itself, later micro-batches' added).

use std::collections::HashMap;
use std::sync::Arc;

use super::stage::{OrtStage, Payload};
use crate::compute::{GraphSession, Target, Value};
use crate::graph::LOSS_GRAD;
use crate::optim::ParamLayout;
use crate::tensor::{TensorView, ViewData};
use crate::{Error, Result};

impl OrtStage {
    /// Runs `session` on whatever it needs from the parameters and `sources`. Parameter
    /// gradients go straight from ONNX Runtime's outputs into the step's accumulators
    /// (the first contribution of a step is copied, later ones added, so the buffer is
    /// never zeroed); the other outputs are returned, shared.
    pub(super) fn run(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Payload> {
        if self.device_state.is_some() {
            return self.run_on_device(session, sources);
        }
        let names = session.input_names().to_vec();
        let seed = if names.iter().any(|n| n == LOSS_GRAD) {
            Some(self.seed(sources)?)
        } else {
            None
        };
        self.pinned.keep(&self.params);
        self.pinned.keep(&self.grads);
        let OrtStage {
            layout,
            params,
            grads,
            written,
            grad_slot,
            buffers,
            sessions,
            ..
        } = self;
        let feeds = feeds_of(&names, seed.as_ref(), (layout, params), sources, buffers)?;
        // A step's first gradients of every parameter this graph computes are written by
        // ONNX Runtime straight into the accumulators; later micro-batches' are added.
        let (targets, slots) = grad_targets(session.output_names(), grad_slot, layout);
        let first = !slots.is_empty() && slots.iter().all(|&i| !written[i]);
        // Later micro-batches add theirs as they are made, where the session has an
        // accumulating twin (`graph::accumulating`).
        let all_written = !slots.is_empty() && slots.iter().all(|&i| written[i]);
        let twin = match all_written {
            true => sessions.accumulating.get_mut(session.label()),
            false => None,
        };
        // ONNX Runtime computes on this thread: the engine gives each stage actor a
        // thread of its own (`ActorThreads::Dedicated`), so no tokio worker is held up.
        let rest = if first {
            let rest = session.run_views_direct(&feeds, grads, &targets, &mut |_, _| Ok(false))?;
            for &i in &slots {
                written[i] = true;
            }
            rest
        } else if let Some(twin) = twin {
            let acc: Vec<(&str, usize)> = (targets.iter().enumerate())
                .filter_map(|(j, t)| Some((twin.acc.get(&t.output)?.as_str(), j)))
                .collect();
            let no_sink = &mut |_: &str, _: &[f32]| Ok(false);
            (twin.session).run_views_accumulating(&feeds, grads, &targets, &acc, no_sink)?
        } else {
            let mut sink = |name: &str, g: &[f32]| -> Result<bool> {
                let Some(&i) = grad_slot.get(name) else {
                    return Ok(false);
                };
                let acc = layout.slice_mut(grads, i);
                if acc.len() != g.len() {
                    return Err(Error::BadTensor {
                        name: name.into(),
                        reason: format!("{} values, the parameter has {}", g.len(), acc.len()),
                    });
                }
                if written[i] {
                    acc.iter_mut().zip(g).for_each(|(a, x)| *a += x);
                } else {
                    acc.copy_from_slice(g);
                    written[i] = true;
                }
                Ok(true)
            };
            session.run_views_into(&feeds, &mut sink)?
        };
        Ok(rest
            .into_iter()
            .map(|(n, t)| (n, Arc::new(t.into())))
            .collect())
    }

    /// Runs `session`, a piece of the gradient graph, writing the gradients of `params`
    /// (layout indices) one after another into `bucket` (those it does not compute are
    /// zero); the other outputs are returned, shared.
    pub(super) fn run_into_bucket(
        &mut self,
        session: &mut GraphSession,
        sources: &[&Payload],
        bucket: &mut Vec<f32>,
        params: &[usize],
    ) -> Result<Payload> {
        let names = session.input_names().to_vec();
        let seed = match names.iter().any(|n| n == LOSS_GRAD) {
            true => Some(self.seed(sources)?),
            false => None,
        };
        let layout = &self.layout;
        let mut at_of = HashMap::with_capacity(params.len());
        let mut len = 0;
        for &i in params {
            at_of.insert(i, len);
            len += layout.shapes()[i].iter().product::<usize>();
        }
        bucket.clear();
        bucket.resize(len, 0.0);
        let mut targets = Vec::new();
        for (k, n) in session.output_names().iter().enumerate() {
            let Some(&i) = self.grad_slot.get(n) else {
                continue;
            };
            let offset = *at_of.get(&i).ok_or_else(|| Error::BadTensor {
                name: n.clone(),
                reason: "a gradient this piece computes is not in its bucket".into(),
            })?;
            let shape = &layout.shapes()[i];
            targets.push(Target {
                output: k,
                offset,
                shape,
            });
        }
        let feeds = feeds_of(
            &names,
            seed.as_ref(),
            (layout, &self.params),
            sources,
            &self.buffers,
        )?;
        let no_sink = &mut |_: &str, _: &[f32]| Ok(false);
        let rest = session.run_views_direct(&feeds, bucket, &targets, no_sink)?;
        Ok(rest
            .into_iter()
            .map(|(n, t)| (n, Arc::new(t.into())))
            .collect())
    }

    /// Zeroes the gradients of parameters nothing contributed to this step (their buffer
    /// still holds an older step's): the step's gradients are then complete. With the
    /// gradients sharded (ZeRO stage 2), of this replica's part only: the rest is never
    /// written.
    pub(super) fn complete_grads(&mut self) {
        if self.device_state.is_some() {
            if let Err(e) = self.complete_device_grads() {
                self.device_error.get_or_insert(e);
            }
            return;
        }
        let mine = match &self.zero {
            Some(z) if z.gradients => z.own_tensors(),
            _ => 0..self.layout.count(),
        };
        for i in mine {
            if !self.written[i] {
                self.layout.slice_mut(&mut self.grads, i).fill(0.0);
                self.written[i] = true;
            }
        }
    }

    /// Starts a new step's accumulation.
    pub(super) fn reset_grads(&mut self) {
        self.written.fill(false);
        self.contributions = 0;
    }

    /// Starts a new accumulation: the next gradients overwrite the accumulators instead
    /// of adding to them (ORT's lazy gradient reset; nothing is zeroed now).
    pub fn reset_accumulation(&mut self) {
        self.reset_grads();
    }
}

/// The feeds of a run of a graph whose inputs are `names`: the backward's seed, the
/// parameters (`layout` over `params`), and the rest from `sources` or `buffers`.
fn feeds_of<'a>(
    names: &'a [String],
    seed: Option<&'a crate::tensor::Tensor>,
    (layout, params): (&'a ParamLayout, &'a [f32]),
    sources: &[&'a Payload],
    buffers: &'a Payload,
) -> Result<Vec<(&'a str, TensorView<'a>)>> {
    let mut feeds = Vec::with_capacity(names.len());
    for n in names {
        let view = if let Some(seed) = seed.filter(|_| n == LOSS_GRAD) {
            seed.view()
        } else if let Some(i) = layout.index_of(n) {
            TensorView {
                shape: &layout.shapes()[i],
                data: ViewData::F32(layout.slice(params, i)),
            }
        } else {
            fed(n, sources, buffers)?.host(n)?.view()
        };
        feeds.push((n.as_str(), view));
    }
    Ok(feeds)
}

/// Where input `n` of a stage graph comes from: a message, the data, the stash (in
/// `sources`), or the stage's running statistics.
pub(super) fn fed<'a>(
    n: &str,
    sources: &[&'a Payload],
    buffers: &'a Payload,
) -> Result<&'a Arc<Value>> {
    sources
        .iter()
        .find_map(|s| s.get(n))
        .or_else(|| buffers.get(n))
        .ok_or_else(|| Error::MissingValue {
            role: "stage input",
            name: n.into(),
            hint: "; a stage graph needs it and no message, data or stash held it".into(),
        })
}

impl OrtStage {
    /// `payload` as this stage reads it: where the stage computes on the host, values a
    /// neighbour left in its device's memory are copied here first.
    ///
    /// # Errors
    /// `Device` when a copy fails.
    pub(super) fn readable(&self, payload: Payload) -> Result<Payload> {
        match self.device_state {
            Some(_) => Ok(payload),
            None => on_host(payload),
        }
    }
}

/// `payload` with every value held in a device's memory copied to the host: what a
/// stage computing on the host receives from one that leaves its values on the device.
///
/// # Errors
/// `Device` when a copy fails.
fn on_host(payload: Payload) -> Result<Payload> {
    if payload.values().all(|v| matches!(**v, Value::Host(_))) {
        return Ok(payload);
    }
    payload
        .into_iter()
        .map(|(n, v)| {
            let host = match &*v {
                Value::Host(_) => v,
                Value::Device(d) => Arc::new(Value::Host(d.to_host(&n)?)),
            };
            Ok((n, host))
        })
        .collect()
}

/// The outputs of a session that are parameter gradients, as targets at their
/// parameters' places in the flat buffer, and those parameters' indices.
pub(super) fn grad_targets<'a>(
    outputs: &[String],
    grad_slot: &HashMap<String, usize>,
    layout: &'a ParamLayout,
) -> (Vec<Target<'a>>, Vec<usize>) {
    let mut slots = Vec::new();
    let targets = outputs
        .iter()
        .enumerate()
        .filter_map(|(k, n)| {
            let &i = grad_slot.get(n)?;
            slots.push(i);
            Some(Target {
                output: k,
                offset: layout.offsets()[i],
                shape: &layout.shapes()[i],
            })
        })
        .collect();
    (targets, slots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{Device, DeviceValue, Runtime};
    use crate::tensor::Tensor;

    /// A stage on the host reads a value a neighbour left on its device as a copy of
    /// it, and its own host values as they are (the same allocation).
    #[test]
    fn values_left_on_a_device_reach_a_host_stage_as_copies() {
        let _rt = Runtime::from_env().unwrap();
        let data = vec![1.5f32, -2.0, 0.25, 8.0, -0.5, 3.0];
        let ort = ort::value::Tensor::from_array((vec![2usize, 3], data.clone())).unwrap();
        let held = DeviceValue::new(ort.into_dyn(), "h", Device::Cpu).unwrap();
        let host = Arc::new(Value::from(
            Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]).unwrap(),
        ));
        let payload: Payload = [
            ("h".to_string(), Arc::new(Value::Device(held))),
            ("x".to_string(), host.clone()),
        ]
        .into();
        let read = on_host(payload).unwrap();
        let h = read["h"].host("h").unwrap();
        assert_eq!(
            (h.shape.as_slice(), h.as_f32().unwrap()),
            ([2, 3].as_slice(), data.as_slice())
        );
        assert!(Arc::ptr_eq(&read["x"], &host), "a host value is not copied");
        assert!(read["x"].host("x").is_ok());
    }
}
