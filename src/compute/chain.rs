//! Running a training step: the whole training graph in one session, or the stage graphs
//! one after another in a chain (what a pipeline does, without the overlap).

use std::collections::HashMap;

use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::{buffers_as_constants, Graph, StageGraphs, TrainingGraph, LOSS, LOSS_GRAD};
use crate::tensor::Tensor;
use crate::{Error, Result};

pub use crate::tensor::TensorMap;

/// The loss and parameter gradients of one micro-batch.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The loss value.
    pub loss: f64,
    /// Gradient of each parameter, by parameter name.
    pub grads: TensorMap,
}

/// The whole training graph (forward, loss, backward) in one session: the fastest way to
/// run one stage.
#[derive(Debug)]
pub struct TrainSession {
    session: GraphSession,
    grad_to_param: HashMap<String, String>,
}

impl TrainSession {
    /// Creates the session.
    ///
    /// # Errors
    /// `Ort` when ONNX Runtime rejects the graph.
    pub fn new(rt: &Runtime, tg: &TrainingGraph, opts: &SessionOptions) -> Result<TrainSession> {
        // Running statistics stay at their initial values here (one micro-batch at a
        // time, no state kept between steps).
        let g = buffers_as_constants(&tg.graph, &tg.buffers);
        Ok(TrainSession {
            session: GraphSession::new(rt, &g, opts, "the training graph")?,
            grad_to_param: tg
                .params
                .iter()
                .map(|p| (p.grad.clone(), p.name.clone()))
                .collect(),
        })
    }

    /// Stops profiling (see [`SessionOptions::profile`]) and returns the profile's path.
    ///
    /// # Errors
    /// `Ort` when the session was not profiling.
    pub fn end_profiling(&mut self) -> Result<std::path::PathBuf> {
        self.session.end_profiling()
    }

    /// Forward, loss and backward on one micro-batch; `seed` is the loss's gradient.
    ///
    /// # Errors
    /// `MissingValue` for an input neither `params` nor `data` holds; `Ort` on failure.
    pub fn step(
        &mut self,
        params: &TensorMap,
        data: &TensorMap,
        seed: &Tensor,
    ) -> Result<StepOutput> {
        let names = self.session.input_names().to_vec();
        let feeds = gather(&names, &[params, data], seed, "training graph")?;
        let outputs = self.session.run(&feeds)?;
        let mut grads = TensorMap::new();
        let mut loss = None;
        for (name, t) in self.session.output_names().iter().zip(outputs) {
            if name == LOSS {
                loss = Some(t.to_f64_vec()[0]);
            } else if let Some(p) = self.grad_to_param.get(name) {
                grads.insert(p.clone(), t);
            }
        }
        Ok(StepOutput {
            loss: loss.ok_or_else(|| Error::graph("the training graph has no loss output"))?,
            grads,
        })
    }
}

/// One stage's sessions.
#[derive(Debug)]
struct StageSessions {
    forward: Option<GraphSession>,
    backward: Option<GraphSession>,
    backward_input: Option<GraphSession>,
    backward_weight: Option<GraphSession>,
}

/// The stage graphs run in order: every forward, then every backward in reverse. Values
/// cross between stages by name, as the pipeline's messages would carry them.
#[derive(Debug)]
pub struct StageChain {
    stages: Vec<StageSessions>,
    grad_to_param: HashMap<String, String>,
    split_backward: bool,
}

impl StageChain {
    /// Creates the sessions; with `split_backward` the backward runs as its
    /// input-gradient and weight-gradient halves.
    ///
    /// # Errors
    /// `Ort` when ONNX Runtime rejects a stage graph.
    pub fn new(
        rt: &Runtime,
        tg: &TrainingGraph,
        stages: &[StageGraphs],
        opts: &SessionOptions,
        split_backward: bool,
    ) -> Result<StageChain> {
        let session = |g: &Graph| -> Result<Option<GraphSession>> {
            if g.nodes.is_empty() {
                return Ok(None);
            }
            let g = buffers_as_constants(g, &tg.buffers);
            GraphSession::new(rt, &g, opts, &g.name).map(Some)
        };
        let mut out = Vec::with_capacity(stages.len());
        for s in stages {
            out.push(StageSessions {
                forward: session(&s.forward)?,
                backward: if split_backward {
                    None
                } else {
                    session(&s.backward)?
                },
                backward_input: if split_backward {
                    session(&s.backward_input)?
                } else {
                    None
                },
                backward_weight: if split_backward {
                    session(&s.backward_weight)?
                } else {
                    None
                },
            });
        }
        Ok(StageChain {
            stages: out,
            grad_to_param: tg
                .params
                .iter()
                .map(|p| (p.grad.clone(), p.name.clone()))
                .collect(),
            split_backward,
        })
    }

    /// Forward through every stage, then backward through every stage in reverse.
    ///
    /// # Errors
    /// `MissingValue` when a stage needs a value nobody provided; `Ort` on failure.
    pub fn step(
        &mut self,
        params: &TensorMap,
        data: &TensorMap,
        seed: &Tensor,
    ) -> Result<StepOutput> {
        let mut values = TensorMap::new();
        for st in &mut self.stages {
            run_into(st.forward.as_mut(), params, data, seed, &mut values)?;
        }
        let loss = values
            .get(LOSS)
            .map(|t| t.to_f64_vec()[0])
            .ok_or_else(|| Error::graph("no stage computed the loss"))?;
        for st in self.stages.iter_mut().rev() {
            if self.split_backward {
                run_into(st.backward_input.as_mut(), params, data, seed, &mut values)?;
                run_into(st.backward_weight.as_mut(), params, data, seed, &mut values)?;
            } else {
                run_into(st.backward.as_mut(), params, data, seed, &mut values)?;
            }
        }
        let mut grads = TensorMap::new();
        for (g, p) in &self.grad_to_param {
            if let Some(t) = values.remove(g) {
                grads.insert(p.clone(), t);
            }
        }
        Ok(StepOutput { loss, grads })
    }
}

fn run_into(
    session: Option<&mut GraphSession>,
    params: &TensorMap,
    data: &TensorMap,
    seed: &Tensor,
    values: &mut TensorMap,
) -> Result<()> {
    let Some(session) = session else {
        return Ok(());
    };
    let names = session.input_names().to_vec();
    let outputs = {
        let feeds = gather(&names, &[params, data, values], seed, "stage graph")?;
        session.run(&feeds)?
    };
    for (name, t) in session.output_names().iter().zip(outputs) {
        values.insert(name.clone(), t);
    }
    Ok(())
}

/// The feeds for `names`, looked up in `maps` in order (`loss_grad` is `seed`).
fn gather<'a>(
    names: &'a [String],
    maps: &[&'a TensorMap],
    seed: &'a Tensor,
    what: &str,
) -> Result<Vec<(&'a str, &'a Tensor)>> {
    names
        .iter()
        .map(|n| {
            if n == LOSS_GRAD {
                return Ok((n.as_str(), seed));
            }
            maps.iter()
                .find_map(|m| m.get(n))
                .map(|t| (n.as_str(), t))
                .ok_or_else(|| Error::MissingValue {
                    role: "input",
                    name: n.clone(),
                    hint: format!("; the {what} needs it and nothing provided it"),
                })
        })
        .collect()
}
