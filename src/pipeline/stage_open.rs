//! What a stage starts from: its parameters' layout and initial values, its running
//! statistics, and its ONNX Runtime sessions.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::stage::Payload;
use crate::compute::{GraphSession, Runtime, SessionOptions};
use crate::graph::{Graph, StageGraphs, StageIo, TrainingGraph};
use crate::optim::ParamLayout;
use crate::pipeline::settings::StageSettings;
use crate::{Error, Result};

/// The stage's parameters: their layout in the flat buffer, and their initial values
/// (a tensor shard other than 0 starts from its own part of a split parameter).
pub(super) fn initial_params(
    tg: &TrainingGraph,
    graphs: &StageGraphs,
    settings: &StageSettings,
) -> Result<(ParamLayout, Vec<f32>)> {
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
        let not_f32 = || Error::BadTensor {
            name: p.name.clone(),
            reason: "pipelined training keeps float32 parameters".into(),
        };
        match (&tg.shards, &settings.shard) {
            (Some(plan), Some(link)) => {
                let own = plan.initial(&p.name, link.0.rank(), &p.init.to_tensor()?)?;
                flat.extend_from_slice(own.as_f32().ok_or_else(not_f32)?);
            }
            _ => flat.extend_from_slice(p.init.as_f32().ok_or_else(not_f32)?),
        }
    }
    Ok((layout, flat))
}

/// The running statistics the stage keeps (`io.buffers`), at their initial values.
pub(super) fn initial_buffers(tg: &TrainingGraph, io: &StageIo) -> Payload {
    io.buffers
        .iter()
        .filter_map(|(n, _)| tg.buffers.iter().find(|b| b.name == *n))
        .map(|b| (b.name.clone(), Arc::new(b.init.clone().into())))
        .collect()
}

/// A stage's sessions: the last stage's fused forward and backward where it has one and
/// the backward is not split, else a forward and a backward (or its two halves).
pub(super) struct Sessions {
    pub(super) forward: Option<GraphSession>,
    pub(super) backward: Option<GraphSession>,
    pub(super) backward_input: Option<GraphSession>,
    pub(super) backward_weight: Option<GraphSession>,
    /// The last stage's forward and backward in one session (see `StageGraphs::fused`):
    /// its forward then does the backward too, and the backward only hands on the result.
    pub(super) fused: Option<GraphSession>,
    /// Forward for evaluation (no stash, no gradients).
    pub(super) evaluate: Option<GraphSession>,
    /// The gradient sessions' accumulating twins (`graph::accumulating`), by the name
    /// of the graph they add to: a later micro-batch of a step runs the twin.
    pub(super) accumulating: HashMap<String, Twin>,
}

/// An accumulating session, with the accumulator input of each output it sums.
pub(super) struct Twin {
    pub(super) session: GraphSession,
    /// Output index -> the input that feeds its accumulator.
    pub(super) acc: HashMap<usize, String>,
}

impl Sessions {
    pub(super) fn open(
        rt: &Runtime,
        graphs: &StageGraphs,
        opts: &SessionOptions,
        settings: &StageSettings,
    ) -> Result<Sessions> {
        let session_with = |g: &Graph, opts: &SessionOptions| -> Result<Option<GraphSession>> {
            (!g.nodes.is_empty())
                .then(|| GraphSession::for_shard(rt, g, opts, &g.name, settings.shard.as_ref()))
                .transpose()
        };
        let session = |g: &Graph| session_with(g, opts);
        // Evaluation batches may differ in shape from the training batches: never replayed.
        let not_replayed = SessionOptions {
            cuda_graph: false,
            ..*opts
        };
        let split = settings.split_backward;
        let fused = match (&graphs.fused, split) {
            (Some(g), false) => session(g)?,
            _ => None,
        };
        let separate = fused.is_none();
        let when = |yes: bool, g: &Graph| if yes { session(g) } else { Ok(None) };
        Ok(Sessions {
            forward: when(separate, &graphs.forward)?,
            backward: when(separate && !split, &graphs.backward)?,
            backward_input: when(split, &graphs.backward_input)?,
            backward_weight: when(split, &graphs.backward_weight)?,
            fused,
            evaluate: session_with(&graphs.evaluate, &not_replayed)?,
            accumulating: HashMap::new(),
        })
    }

    /// Every session copies its outputs into `pool`'s buffers.
    pub(super) fn use_host_pool(&mut self, pool: &crate::compute::HostPool) {
        let single = [
            &mut self.forward,
            &mut self.backward,
            &mut self.backward_input,
            &mut self.backward_weight,
            &mut self.fused,
            &mut self.evaluate,
        ];
        for s in single.into_iter().flatten() {
            s.use_host_pool(pool);
        }
        for twin in self.accumulating.values_mut() {
            twin.session.use_host_pool(pool);
        }
    }

    /// Opens the accumulating twin of each gradient session (those computing any of
    /// `grads`), for steps of several micro-batches whose gradients stay on the host.
    ///
    /// # Errors
    /// `Ort` when a session cannot be made.
    pub(super) fn open_accumulating(
        &mut self,
        rt: &Runtime,
        graphs: &StageGraphs,
        opts: &SessionOptions,
        settings: &StageSettings,
        grads: &HashSet<String>,
    ) -> Result<()> {
        let opened = [
            self.fused.as_ref().and(graphs.fused.as_ref()),
            self.backward.as_ref().map(|_| &graphs.backward),
            self.backward_weight
                .as_ref()
                .map(|_| &graphs.backward_weight),
        ];
        for g in opened.into_iter().flatten() {
            let Some(twin) = crate::graph::accumulating(g, grads) else {
                continue;
            };
            let shard = settings.shard.as_ref();
            let session = GraphSession::for_shard(rt, &twin, opts, &twin.name, shard)?;
            let acc = (session.output_names().iter().enumerate())
                .filter(|(_, o)| grads.contains(*o))
                .map(|(k, o)| (k, format!("{o}{}", crate::graph::ACC_SUFFIX)))
                .collect();
            self.accumulating
                .insert(g.name.clone(), Twin { session, acc });
        }
        Ok(())
    }

    /// The graph whose run completes the parameter gradients (what gradient buckets cut).
    pub(super) fn gradient_graph<'a>(
        &self,
        graphs: &'a StageGraphs,
        split_backward: bool,
    ) -> &'a Graph {
        match (&graphs.fused, self.fused.is_some(), split_backward) {
            (Some(g), true, _) => g,
            (_, _, true) => &graphs.backward_weight,
            _ => &graphs.backward,
        }
    }
}
