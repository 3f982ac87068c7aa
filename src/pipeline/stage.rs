//! One pipeline stage of one replica on ONNX Runtime: the stage graphs' sessions, the
//! stage's parameters and gradients in flat buffers, its optimizer, and the activations
//! it keeps from a micro-batch's forward for its backward.

use std::collections::HashMap;
use std::sync::Arc;

use pipetrain_actors::{BackwardPart, BoxError, ForwardOut, StageCompute};

use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::{Graph, StageGraphs, StageIo, TrainingGraph, LOSS, LOSS_GRAD};
use crate::optim::{Optimizer, OptimizerConfig, ParamLayout};
use crate::tensor::{Tensor, TensorView, ViewData};
use crate::{Error, Result};

/// Named tensors crossing between stages; shared, so a value both sent on and kept for
/// the backward is never copied.
pub type Payload = HashMap<String, Arc<Tensor>>;

/// A stage's sessions and state.
pub struct OrtStage {
    io: StageIo,
    forward: Option<GraphSession>,
    backward: Option<GraphSession>,
    backward_input: Option<GraphSession>,
    backward_weight: Option<GraphSession>,
    /// The last stage's forward and backward in one session (see `StageGraphs::fused`):
    /// its forward then does the backward too, and the backward only hands on the result.
    fused: Option<GraphSession>,
    /// Forward for evaluation (no stash, no gradients).
    evaluate: Option<GraphSession>,
    /// Gradients for the previous stage computed by the fused forward, per micro-batch.
    fused_out: HashMap<usize, Payload>,
    layout: ParamLayout,
    params: Vec<f32>,
    grads: Vec<f32>,
    /// Gradient output name -> parameter index in the layout.
    grad_slot: HashMap<String, usize>,
    optimizer: Box<dyn Optimizer>,
    /// `loss_grad`: 1 / (micro-batches x replicas), so that summing micro-batch
    /// gradients over the step and over replicas gives the global batch's mean gradient.
    seed: Tensor,
    /// Per micro-batch: forward values the backward reads, and the data.
    stash: HashMap<usize, Payload>,
}

impl OrtStage {
    /// Sessions for `graphs`, parameters from the training graph's initial values.
    ///
    /// # Errors
    /// `Ort` when a session cannot be made; `Config` for a bad optimizer.
    pub fn new(
        rt: &Runtime,
        tg: &TrainingGraph,
        graphs: &StageGraphs,
        opts: &SessionOptions,
        split_backward: bool,
        optimizer: &OptimizerConfig,
        seed_scale: f64,
    ) -> Result<OrtStage> {
        let session = |g: &Graph| -> Result<Option<GraphSession>> {
            (!g.nodes.is_empty())
                .then(|| GraphSession::new(rt, g, opts, &g.name))
                .transpose()
        };
        let params: Vec<&crate::graph::Param> = graphs
            .io
            .params
            .iter()
            .filter_map(|n| tg.param(n))
            .collect();
        let layout = ParamLayout::new(
            params
                .iter()
                .map(|p| (p.name.clone(), p.meta.shape.clone())),
        );
        let mut flat = Vec::with_capacity(layout.len());
        for p in &params {
            let v = p.init.as_f32().ok_or_else(|| Error::BadTensor {
                name: p.name.clone(),
                reason: "pipelined training keeps float32 parameters".into(),
            })?;
            flat.extend_from_slice(v);
        }
        let grad_slot = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.grad.clone(), i))
            .collect();
        let fused = match (&graphs.fused, split_backward) {
            (Some(g), false) => session(g)?,
            _ => None,
        };
        let separate = fused.is_none();
        Ok(OrtStage {
            forward: if separate {
                session(&graphs.forward)?
            } else {
                None
            },
            backward: if separate && !split_backward {
                session(&graphs.backward)?
            } else {
                None
            },
            fused,
            evaluate: session(&graphs.evaluate)?,
            fused_out: HashMap::new(),
            backward_input: if split_backward {
                session(&graphs.backward_input)?
            } else {
                None
            },
            backward_weight: if split_backward {
                session(&graphs.backward_weight)?
            } else {
                None
            },
            optimizer: crate::optim::build(optimizer, &layout)?,
            grads: vec![0.0; layout.len()],
            params: flat,
            grad_slot,
            layout,
            io: graphs.io.clone(),
            seed: Tensor::f32(vec![], vec![seed_scale as f32])?,
            stash: HashMap::new(),
        })
    }

    /// The stage's parameters by name (after training, for export).
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        (0..self.layout.count())
            .map(|i| {
                let t = Tensor {
                    shape: self.layout.shapes()[i].clone(),
                    data: crate::tensor::TensorData::F32(
                        self.layout.slice(&self.params, i).to_vec(),
                    ),
                };
                (self.layout.names()[i].clone(), t)
            })
            .collect()
    }

    /// Runs `session` on whatever it needs from the parameters and `sources`.
    fn run(
        &self,
        session: &mut GraphSession,
        sources: &[&Payload],
    ) -> Result<Vec<(String, Tensor)>> {
        let names = session.input_names().to_vec();
        let mut feeds: Vec<(&str, TensorView<'_>)> = Vec::with_capacity(names.len());
        for n in &names {
            let view = if n == LOSS_GRAD {
                self.seed.view()
            } else if let Some(i) = self.layout.index_of(n) {
                TensorView {
                    shape: &self.layout.shapes()[i],
                    data: ViewData::F32(self.layout.slice(&self.params, i)),
                }
            } else {
                sources
                    .iter()
                    .find_map(|s| s.get(n))
                    .map(|t| t.view())
                    .ok_or_else(|| Error::MissingValue {
                        role: "stage input",
                        name: n.clone(),
                        hint: "; a stage graph needs it and no message, data or stash held it"
                            .into(),
                    })?
            };
            feeds.push((n.as_str(), view));
        }
        // ONNX Runtime computes on this thread: the engine gives each stage actor a
        // thread of its own (`ActorThreads::Dedicated`), so no tokio worker is held up.
        let outputs = session.run_views(&feeds)?;
        Ok(session
            .output_names()
            .iter()
            .cloned()
            .zip(outputs)
            .collect())
    }

    /// Adds parameter gradients to the step's accumulators; returns the other outputs.
    fn accumulate(&mut self, outputs: Vec<(String, Tensor)>) -> Result<Payload> {
        let mut rest = Payload::new();
        for (name, t) in outputs {
            match self.grad_slot.get(&name) {
                Some(&i) => {
                    let g = t.as_f32().ok_or_else(|| Error::BadTensor {
                        name: name.clone(),
                        reason: "gradients are float32".into(),
                    })?;
                    let acc = self.layout.slice_mut(&mut self.grads, i);
                    acc.iter_mut().zip(g).for_each(|(a, x)| *a += x);
                }
                None => {
                    rest.insert(name, Arc::new(t));
                }
            }
        }
        Ok(rest)
    }
}

impl OrtStage {
    /// Runs the forward (or, for `eval`, the evaluation) graph; its outputs, shared.
    fn forward_pass(&mut self, eval: bool, input: &Payload, data: &Payload) -> Result<Payload> {
        let mut session = if eval {
            self.evaluate.take()
        } else {
            self.forward.take()
        };
        let outputs = match session.as_mut() {
            Some(s) => self.run(s, &[input, data]),
            None => Ok(Vec::new()),
        };
        if eval {
            self.evaluate = session;
        } else {
            self.forward = session;
        }
        Ok(outputs?
            .into_iter()
            .map(|(n, t)| (n, Arc::new(t)))
            .collect())
    }

    /// What a forward pass hands on: the next stage's activations (its own outputs and
    /// what it passes through) and the loss on the last stage.
    fn forward_out(
        &self,
        outputs: &Payload,
        input: &Payload,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        let loss = match outputs.get(LOSS) {
            Some(t) => Some(t.to_f64_vec().first().copied().ok_or("empty loss")?),
            None => None,
        };
        let send = pick(&self.io.fwd_send, &[outputs, input]);
        Ok(ForwardOut {
            output: (!self.io.fwd_send.is_empty()).then_some(send),
            loss,
        })
    }
}

/// The values of `names` found in `sources` (first match wins).
fn pick(names: &[String], sources: &[&Payload]) -> Payload {
    names
        .iter()
        .filter_map(|n| {
            sources
                .iter()
                .find_map(|s| s.get(n))
                .map(|t| (n.clone(), t.clone()))
        })
        .collect()
}

impl StageCompute for OrtStage {
    type Payload = Payload;

    async fn forward(
        &mut self,
        mb: usize,
        input: Option<Payload>,
        data: Option<Payload>,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        let input = input.unwrap_or_default();
        let data = data.unwrap_or_default();
        if let Some(mut session) = self.fused.take() {
            let outputs = self.run(&mut session, &[&input, &data]);
            self.fused = Some(session);
            let rest = self.accumulate(outputs?)?;
            let loss = rest
                .get(LOSS)
                .and_then(|t| t.to_f64_vec().first().copied())
                .ok_or("the fused stage computed no loss")?;
            let send = pick(&self.io.bwd_send, &[&rest, &input]);
            self.fused_out.insert(mb, send);
            return Ok(ForwardOut {
                output: None,
                loss: Some(loss),
            });
        }
        let outputs = self.forward_pass(false, &input, &data)?;
        let mut keep = pick(&self.io.stash, &[&outputs, &input]);
        keep.extend(data.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.stash.insert(mb, keep);
        self.forward_out(&outputs, &input)
    }

    async fn backward(
        &mut self,
        mb: usize,
        part: BackwardPart,
        grad: Option<Payload>,
    ) -> Result<Option<Payload>, BoxError> {
        if self.fused.is_some() {
            let send = self
                .fused_out
                .remove(&mb)
                .ok_or_else(|| format!("backward of micro-batch {mb} before its forward"))?;
            return Ok((!self.io.bwd_send.is_empty()).then_some(send));
        }
        let grad = grad.unwrap_or_default();
        let stash = match part {
            BackwardPart::Input => self.stash.get(&mb).cloned(),
            BackwardPart::Full | BackwardPart::Weight => self.stash.remove(&mb),
        }
        .ok_or_else(|| format!("backward of micro-batch {mb} before its forward"))?;
        let slot = match part {
            BackwardPart::Full => &mut self.backward,
            BackwardPart::Input => &mut self.backward_input,
            BackwardPart::Weight => &mut self.backward_weight,
        };
        let mut session = slot.take();
        let outputs = match session.as_mut() {
            Some(s) => self.run(s, &[&grad, &stash]),
            None => Ok(Vec::new()),
        };
        match part {
            BackwardPart::Full => self.backward = session,
            BackwardPart::Input => self.backward_input = session,
            BackwardPart::Weight => self.backward_weight = session,
        }
        let rest = self.accumulate(outputs?)?;
        if part == BackwardPart::Input {
            // What the weight half will read: values the input half computed for it, and
            // the gradients that arrived from the next stage.
            let handoff = pick(&self.io.i_to_w, &[&rest]);
            if let Some(s) = self.stash.get_mut(&mb) {
                s.extend(handoff);
                s.extend(grad.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        }
        if part == BackwardPart::Weight {
            return Ok(None);
        }
        let send = pick(&self.io.bwd_send, &[&rest, &grad]);
        Ok((!self.io.bwd_send.is_empty()).then_some(send))
    }

    async fn evaluate(
        &mut self,
        _mb: usize,
        input: Option<Payload>,
        data: Option<Payload>,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        let input = input.unwrap_or_default();
        let data = data.unwrap_or_default();
        let outputs = self.forward_pass(true, &input, &data)?;
        self.forward_out(&outputs, &input)
    }

    fn take_grads(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.grads)
    }

    fn put_grads(&mut self, grads: Vec<f32>) {
        self.grads = grads;
    }

    async fn update(&mut self, _step: u64, lr: f64) -> Result<(), BoxError> {
        self.optimizer.step(&mut self.params, &self.grads, lr)?;
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        Ok(())
    }
}
