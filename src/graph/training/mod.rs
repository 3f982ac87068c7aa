//! Building the training graph: forward model, loss, and backward, with parameters as
//! inputs bound to pipetrain-owned buffers.

use std::collections::{BTreeMap, HashSet};

use crate::graph::autodiff::{differentiate, Backward, OpChoice};
use crate::graph::ir::{untyped_value_info, value_info, Graph, Metas, ValueMeta};
use crate::graph::loss::{attach_loss, LossSpec, LOSS};
use crate::graph::model_inputs::{add_outputs_backward_needs, fit_inputs_to_example, meta_of};
use crate::graph::params::{declared_buffers, rows_to_freeze, trainable_names, ParamOptions};
use crate::graph::running_stats::{track_running_stats, Buffer};
use crate::graph::sequences::split_sequences;
use crate::graph::shape_probe::ShapeProbe;
use crate::graph::tensor_parallel::{shard_graph, ShardPlan};
use crate::graph::unfed_inputs::{bind_unfed_inputs, Bound, InputValue};
use crate::onnx::proto::ModelProto;
use crate::tensor::Tensor;
use crate::{Error, Result};

mod init_value;
mod phases;

pub use init_value::InitValue;

/// The input that seeds the backward pass: the gradient of the loss (1, or a scale for
/// gradient accumulation or loss scaling).
pub const LOSS_GRAD: &str = "loss_grad";

/// How to build a training graph.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// The loss.
    pub loss: LossSpec,
    /// Parameters to train; `None` trains every floating-point initializer.
    pub trainable: Option<Vec<String>>,
    /// Allow ONNX Runtime's contrib ops (`com.microsoft.FusedMatMul`) in backward graphs.
    pub contrib_ops: bool,
    /// Use pipetrain's fused kernels (custom operators) in backward graphs.
    pub fused_kernels: bool,
    /// Use the fused kernels pipetrain has for ONNX Runtime's CUDA provider (a graph
    /// for a GPU): tanh GELU whole (as `fused_kernels` does on the CPU), and softmax's
    /// backward (`compute/cuda_fused.rs`).
    pub cuda_kernels: bool,
    /// With `cuda_kernels`, those of pipetrain's CUDA kernels not yet run on a GPU too
    /// (`runtime.cuda_kernels_untried`): scaled dot-product attention as pipetrain's
    /// `Attention` (or `PackedAttention`) and its backward as one node each
    /// (`compute/cuda_attention.rs`), LayerNorm's backward as `LayerNormGrad`
    /// (`compute/cuda_layer_norm.rs`).
    pub cuda_kernels_untried: bool,
    /// Fused attention (`fused_kernels` on the CPU, `cuda_kernels_untried` on a GPU) keeps
    /// each query row's log-sum-exp instead of its probabilities, and its backward
    /// computes them again (`runtime.flash_attention`; on a GPU the flash kernels,
    /// `compute/kernels/flash.rs`).
    pub flash_attention: bool,
    /// Initializers not to train, and embedding rows whose lookups give them no
    /// gradient (padding rows).
    pub params: ParamOptions,
    /// Values of model inputs the data does not feed (`[inputs]`).
    pub inputs: BTreeMap<String, InputValue>,
}

/// A trainable parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Initializer name in the model.
    pub name: String,
    /// Its gradient's name in the training graph.
    pub grad: String,
    /// Type and shape.
    pub meta: ValueMeta,
    /// Initial value (the model's bytes, shared: see [`InitValue`]).
    pub init: InitValue,
}

/// A forward model with its loss and backward graph.
#[derive(Debug, Clone)]
pub struct TrainingGraph {
    /// Forward and loss nodes (the first `forward_len` nodes of `graph`), then backward.
    pub graph: Graph,
    /// How many of `graph.nodes` are forward (model and loss) nodes.
    pub forward_len: usize,
    /// For each backward node, the forward node it belongs to.
    pub anchors: Vec<usize>,
    /// Trainable parameters (graph inputs).
    pub params: Vec<Param>,
    /// Data inputs (model inputs and the label), fed per micro-batch.
    pub data_inputs: Vec<String>,
    /// Type and shape of every value, measured on the example batch.
    pub metas: Metas,
    /// Parameters the loss does not depend on.
    pub unused_params: Vec<String>,
    /// State that is not trained but updated by each forward (BatchNorm's running
    /// statistics): graph inputs, each with the forward value that replaces it.
    pub buffers: Vec<Buffer>,
    /// How the graph is split across tensor shards (`None`: not split). Parameters'
    /// shapes and initial values are shard 0's.
    pub shards: Option<ShardPlan>,
}

impl TrainingGraph {
    /// The forward model with the loss attached (ORT's `model_with_loss_func_path`):
    /// the model's inputs and the label in, the loss out, the parameters as initializers
    /// holding their initial values.
    ///
    /// # Errors
    /// As [`TrainingGraph::forward_graph`].
    pub fn model_with_loss(&self) -> Result<crate::onnx::proto::ModelProto> {
        let mut g = self.forward_graph(&[LOSS])?;
        g.name = "model_with_loss".into();
        self.params_as_defaults(&mut g);
        Ok(g.to_model())
    }

    /// The whole training graph (ORT's `model_with_training_graph_path`): forward, loss
    /// and backward in standard ONNX ops (plus `com.microsoft.FusedMatMul` unless
    /// `standard_ops_only`), the loss and every parameter's gradient out. Parameters and
    /// `loss_grad` are inputs with defaults (initializers: the initial values, and 1), so
    /// a stock ONNX Runtime runs it on data feeds alone, and Netron shows it.
    pub fn model_with_training_graph(&self) -> crate::onnx::proto::ModelProto {
        let mut g = self.graph.clone();
        g.name = "model_with_training_graph".into();
        self.params_as_defaults(&mut g);
        if let Some(seed) = self.metas.get(LOSS).map(|m| Tensor::zeros(m.dtype, vec![])) {
            let one = match seed.data {
                crate::tensor::TensorData::F64(_) => Tensor::f64(vec![], vec![1.0]),
                _ => Tensor::f32(vec![], vec![1.0]),
            };
            if let Ok(one) = one {
                g.initializers.push(one.to_proto(LOSS_GRAD));
            }
        }
        g.to_model()
    }

    /// Bytes of the parameters' initial values the graph holds.
    pub fn initial_value_bytes(&self) -> u64 {
        self.params
            .iter()
            .map(|p| (p.init.len() * p.meta.dtype.size()) as u64)
            .sum()
    }

    /// Frees the parameters' initial values (their types and shapes stay): what a run does
    /// once its stages hold them. Graphs built from here on carry no initial values.
    pub fn release_initial_values(&mut self) {
        for p in &mut self.params {
            p.init = InitValue::released(p.meta.dtype);
        }
    }

    /// Gives every parameter input of `g` its initial value as an initializer (an input
    /// with a default, in ONNX terms).
    fn params_as_defaults(&self, g: &mut Graph) {
        let values = self.params.iter().map(|p| p.init.to_proto(&p.name));
        let buffers = self.buffers.iter().map(|b| b.init.to_proto(&b.name));
        for init in values.chain(buffers) {
            if g.inputs.iter().any(|v| v.name == init.name) {
                g.initializers.push(init);
            }
        }
    }

    /// Every parameter's name and shape (what a checkpoint must hold).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.meta.shape.clone()))
            .collect()
    }

    /// Every parameter's name and whole shape (a tensor shard's parameters are parts of
    /// these; what a checkpoint holds).
    pub fn whole_param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let plan = self.shards.as_ref();
        self.params
            .iter()
            .map(|p| {
                let whole = plan.and_then(|s| s.specs.get(&p.name)).map(|(_, w)| w);
                (p.name.clone(), whole.unwrap_or(&p.meta.shape).clone())
            })
            .collect()
    }

    /// The parameter of that name.
    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    /// A forward-only graph computing `outputs` (evaluation, inference): the forward
    /// nodes they depend on, with parameters as inputs.
    ///
    /// # Errors
    /// `MissingValue` when an output is not a forward value.
    pub fn forward_graph(&self, outputs: &[&str]) -> Result<Graph> {
        let fwd = &self.graph.nodes[..self.forward_len];
        let mut needed: HashSet<&str> = outputs.iter().copied().collect();
        let mut keep = vec![false; fwd.len()];
        for (i, n) in fwd.iter().enumerate().rev() {
            if n.output.iter().any(|o| needed.contains(o.as_str())) {
                keep[i] = true;
                needed.extend(n.input.iter().map(String::as_str));
            }
        }
        let mut g = self.graph.clone();
        g.nodes = fwd
            .iter()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(n, _)| n.clone())
            .collect();
        g.inputs.retain(|v| needed.contains(v.name.as_str()));
        g.outputs = outputs
            .iter()
            .map(|o| {
                let meta = self
                    .metas
                    .get(*o)
                    .filter(|_| fwd.iter().any(|n| n.output.iter().any(|x| x == o)));
                meta.map(|m| value_info(o, m))
                    .ok_or_else(|| Error::MissingValue {
                        role: "forward output",
                        name: o.to_string(),
                        hint: "; it must be computed by the model".into(),
                    })
            })
            .collect::<Result<_>>()?;
        Ok(g)
    }
}

/// Builds the training graph of `model` for micro-batches shaped like `example` (the
/// model's inputs and the label, by name).
///
/// # Errors
/// `UnsupportedOpset`, `MissingValue` (prediction, label, trainable name), `NoGradient`,
/// `UnsupportedGradient`, or `Ort` when the model does not run on the example.
pub fn build_training_graph(
    rt: &dyn ShapeProbe,
    model: &ModelProto,
    opts: &TrainOptions,
    example: &[(&str, &Tensor)],
) -> Result<TrainingGraph> {
    build_sharded_training_graph(rt, model, opts, example, 1)
}

/// [`build_training_graph`] for one of `shards` tensor shards (Megatron-LM's split; see
/// [`crate::graph::tensor_parallel`]): the graph of shard 0, with the plan that gives
/// the other shards their parameters.
///
/// # Errors
/// As [`build_training_graph`]; `TensorParallel` when the model cannot be split.
pub fn build_sharded_training_graph(
    rt: &dyn ShapeProbe,
    model: &ModelProto,
    opts: &TrainOptions,
    example: &[(&str, &Tensor)],
    shards: usize,
) -> Result<TrainingGraph> {
    let mut laps = crate::telemetry::Laps::start();
    let mut g = Graph::from_model(model)?;
    add_outputs_backward_needs(&mut g);
    let fed: Vec<&str> = example.iter().map(|(n, _)| *n).collect();
    for (name, how) in bind_unfed_inputs(&mut g, &fed, &opts.inputs)? {
        match how {
            Bound::Configured => tracing::info!("model input `{name}`: the value [inputs] sets"),
            Bound::Default(why) => tracing::warn!(
                "model input `{name}` is not in the data: taken as {why}; [inputs] sets another value"
            ),
        }
    }
    let resized = fit_inputs_to_example(&mut g, example)?;
    let buffers = declared_buffers(model);
    let trainable = trainable_names(&g, opts.trainable.as_deref(), &opts.params, &buffers)?;
    let trained: HashSet<&str> = trainable.iter().map(String::as_str).collect();
    let mut forward_metas = phases::probe_forward(rt, &mut g, example, &trained, resized)?;
    laps.lap("forward shapes");
    // Rewrites after the probe leave values it did not measure: the graph with its loss
    // is then probed whole (see `loss_metas`).
    let rewritten = split_sequences(&mut g, &forward_metas) > 0;
    if rewritten {
        tracing::debug!("split sequences read at constant positions became Split nodes");
    }
    let measured = !rewritten && shards <= 1;
    if shards <= 1 {
        let n = super::gathers::gathers_as_split(&mut g, &mut forward_metas);
        if n > 0 {
            tracing::debug!("{n} tensors taken apart by constant-position Gathers as Splits");
        }
        let (chains, folded) = super::transposes::merged_transposes(&mut g, &mut forward_metas);
        if chains + folded > 0 {
            tracing::debug!(
                "{chains} transposes of merged axes as transposes of the axes, {folded} transposes of transposes as one"
            );
        }
        let n = super::selected_rows::select_rows_early(&mut g, &mut forward_metas);
        if n > 0 {
            tracing::debug!("{n} nodes compute only the position a constant-position Gather reads");
        }
    }
    let shard_plan = match shards {
        0 | 1 => None,
        n => Some(shard_graph(&mut g, &forward_metas, n, &trained)?),
    };
    let pred_meta = phases::prediction_meta(&g, &opts.loss, &forward_metas)?;
    let label_meta = opts
        .loss
        .label()
        .and_then(|l| example.iter().find(|(n, _)| *n == l))
        .map(|(_, t)| meta_of(t));
    let first_loss_node = g.nodes.len();
    attach_loss(&mut g, &opts.loss, pred_meta, label_meta.as_ref())?;
    g.outputs = vec![untyped_value_info(LOSS)];
    let data_inputs: Vec<String> = g.inputs.iter().map(|v| v.name.clone()).collect();

    let param_values = phases::take_params(&mut g, &trained)?;
    let probed = measured.then_some((first_loss_node, &forward_metas));
    let loss_metas = phases::loss_metas(rt, &g, example, &param_values, probed)?;
    let loss_meta = phases::scalar_loss(&loss_metas)?;
    laps.lap("loss shapes");

    let identities = super::cleanup::identity_dropouts(&mut g);
    if identities > 0 {
        tracing::debug!("{identities} Dropout nodes with ratio 0 taken as Identity");
    }
    if opts.fused_kernels {
        let fused = super::fusion::fuse_forward(&mut g, &loss_metas, &trained);
        tracing::debug!("fused forward kernels: {fused:?}");
    }
    if opts.cuda_kernels_untried && !opts.fused_kernels {
        let n = super::fusion::fuse_attention_for_cuda(&mut g, &loss_metas, &trained);
        tracing::info!("{n} attentions as one CUDA operator each way (cuda_kernels_untried)");
    }
    if opts.flash_attention {
        let gpu = opts.cuda_kernels;
        let n = super::fusion::keep_log_sum_exp(&mut g, &loss_metas, gpu);
        tracing::info!(
            "{n} attentions keep their rows' log-sum-exps, not their probabilities \
             (flash_attention{})",
            if gpu { ": the flash kernels" } else { "" }
        );
    }
    if opts.fused_kernels || opts.cuda_kernels {
        let n = super::fusion::fuse_tanh_gelu(&mut g, &loss_metas);
        tracing::debug!("{n} tanh GELUs as one kernel each");
    }
    if opts.contrib_ops {
        let n = super::fusion::fuse_transposed_weights(&mut g, &loss_metas);
        tracing::debug!("{n} products of a transposed matrix read the matrix in place");
    }
    let frozen = rows_to_freeze(&g, &param_values, &with_declared_rows(model, &opts.params));
    let backward: Backward = differentiate(
        &g,
        &loss_metas,
        LOSS,
        LOSS_GRAD,
        &trainable,
        OpChoice {
            contrib: opts.contrib_ops,
            fused: opts.fused_kernels,
            cuda: opts.cuda_kernels,
            cuda_untried: opts.cuda_kernels_untried,
        },
        &frozen,
    )?;
    let buffers = track_running_stats(&mut g, &loss_metas)?;
    laps.lap("gradients");
    let forward_len = g.nodes.len();
    let (full, params) = phases::with_backward(g, &backward, param_values, &loss_meta);
    // Measure the backward values too (stage graphs declare their types).
    let metas = phases::measure(rt, &full, example, &params, &buffers, loss_meta.dtype)?;
    laps.lap("backward shapes");
    tracing::info!("training graph built in {}", laps.summary());
    Ok(TrainingGraph {
        graph: full,
        forward_len,
        anchors: backward.anchors,
        params,
        data_inputs,
        metas,
        unused_params: backward.no_grad,
        buffers,
        shards: shard_plan,
    })
}

/// `params` with the padding rows the export declared (`graph::declared`) added, where
/// the configuration lists none for the table.
fn with_declared_rows(model: &ModelProto, params: &ParamOptions) -> ParamOptions {
    let declared = super::declared::Declared::of(model);
    let mut out = params.clone();
    for (table, rows) in declared.padding_rows {
        if let std::collections::btree_map::Entry::Vacant(slot) = out.frozen_rows.entry(table) {
            tracing::info!(
                "embedding `{}`: rows {rows:?} are padding rows, as the export declares",
                slot.key()
            );
            slot.insert(rows);
        }
    }
    out
}
