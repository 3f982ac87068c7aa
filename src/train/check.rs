//! `pipetrain check MODEL.onnx [CONFIG]`: what would keep a model from training as the
//! user's model, said before any training (the same warnings start `train`). Errors make
//! the command fail, so that a user's CI can gate on it; warnings do not.

use std::fmt::Write;
use std::path::Path;

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::open_step_batches;
use std::collections::BTreeSet;

use crate::graph::declared::{suspected_buffers, Declared};
use crate::graph::{check, declared_type, describe_input, implied_default, Graph};
use crate::tensor::DType;
use crate::Result;

/// What `check` found: its report, and how many of its lines are errors.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// The report, one finding a line (`warning: `, `error: `, `ok: `, `note: `).
    pub text: String,
    /// The errors among them.
    pub errors: usize,
    /// The warnings among them.
    pub warnings: usize,
}

impl CheckReport {
    fn line(&mut self, line: impl std::fmt::Display) {
        let _ = writeln!(self.text, "{line}");
    }

    fn error(&mut self, line: impl std::fmt::Display) {
        self.errors += 1;
        self.line(format_args!("error: {line}"));
    }

    fn warning(&mut self, line: impl std::fmt::Display) {
        self.warnings += 1;
        self.line(format_args!("warning: {line}"));
    }
}

/// The report for `model_path`; with `config`, also whether its training graph builds
/// on the configuration's first micro-batch (folding, gradients, padding rows, the
/// inputs the data feeds).
///
/// # Errors
/// The model or the configuration cannot be read (a training graph that does not build
/// is an error line of the report, not an error).
pub fn check_model(rt: &Runtime, model_path: &Path, config: Option<&Path>) -> Result<CheckReport> {
    let model = crate::onnx::load_model(model_path)?;
    let g = Graph::from_model(&model)?;
    let findings = check::inspect(&g);
    let mut r = CheckReport {
        text: String::new(),
        errors: 0,
        warnings: 0,
    };
    r.line(format_args!(
        "{}: {} nodes, {} initializers, inputs {}",
        model_path.display(),
        g.nodes.len(),
        g.initializers.len(),
        g.inputs
            .iter()
            .map(|v| format!("`{}`", v.name))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for w in findings.warnings() {
        r.warning(w);
    }
    if !findings.no_gradient.is_empty() {
        let nodes: Vec<String> = findings
            .no_gradient
            .iter()
            .map(|(n, op)| format!("`{n}` ({op})"))
            .collect();
        r.error(format_args!(
            "{} nodes on the way from a parameter to an output have no gradient rule: {}",
            nodes.len(),
            nodes.join(", ")
        ));
    }
    let cfg = match config {
        Some(path) => {
            let mut cfg = TrainConfig::load(path)?;
            cfg.model = None;
            cfg.model_path = model_path.to_path_buf();
            Some((cfg, path))
        }
        None => None,
    };
    trained_initializers(&model, &g, cfg.as_ref().map(|(c, _)| c), &mut r);
    scalar_inputs(&g, cfg.as_ref().map(|(c, _)| c), &mut r);
    if let Some((cfg, path)) = &cfg {
        training_graph_line(rt, cfg, path, &mut r);
    }
    if r.errors == 0 && r.warnings == 0 && findings == check::Findings::default() && cfg.is_none() {
        r.line("ok: nothing found that keeps this model from training");
    }
    Ok(r)
}

/// The float initializers that would train, what the export declared not to, and, where
/// it declared nothing, those that look like buffers or frozen tables (a warning: a
/// TorchScript export does not mark them, and pipetrain would train them).
fn trained_initializers(
    model: &crate::onnx::proto::ModelProto,
    g: &Graph,
    cfg: Option<&TrainConfig>,
    r: &mut CheckReport,
) {
    let declared = Declared::of(model);
    let mut not_trained: BTreeSet<String> = declared.not_trained().cloned().collect();
    not_trained.extend(cfg.iter().flat_map(|c| c.params.frozen.iter().cloned()));
    // BatchNorm's running statistics are state, not parameters.
    not_trained.extend(
        g.nodes
            .iter()
            .filter(|n| n.op_type == "BatchNormalization")
            .flat_map(|n| n.input.iter().skip(3).take(2).cloned()),
    );
    let trained = g
        .initializers
        .iter()
        .filter(|t| DType::from_onnx(t.data_type).is_some_and(DType::is_float))
        .filter(|t| !not_trained.contains(&t.name))
        .count();
    r.line(format_args!(
        "note: {trained} float initializers would train"
    ));
    if declared.any() {
        let list = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
        r.line(format_args!(
            "note: the export declares buffers [{}], frozen parameters [{}], padding rows {:?}: \
             none of them trains",
            list(&declared.buffers),
            list(&declared.frozen),
            declared.padding_rows
        ));
    }
    let suspected = suspected_buffers(g, &not_trained);
    if !suspected.is_empty() {
        let named: Vec<String> = suspected
            .iter()
            .map(|(n, why)| format!("`{n}` ({why})"))
            .collect();
        r.warning(format_args!(
            "{} may be buffers or frozen parameters, which a TorchScript export does not \
             mark, so they would train: list them in [params] frozen, or export with \
             tools/export_for_training.py, which records them",
            named.join(", ")
        ));
    }
}

/// Rank-0 model inputs: no batch of data can feed them (each array has a batch axis).
/// Each is taken as the default the graph implies, set by `[inputs]`, or an error.
fn scalar_inputs(g: &Graph, cfg: Option<&TrainConfig>, r: &mut CheckReport) {
    for v in &g.inputs {
        if declared_type(v).is_none_or(|(_, dims)| !dims.is_empty()) {
            continue;
        }
        if let Some(value) = cfg.and_then(|c| c.inputs.get(&v.name)) {
            r.line(format_args!(
                "note: model input `{}` is set by [inputs] to {value}",
                v.name
            ));
            continue;
        }
        match implied_default(g, v) {
            Some((_, why)) => r.line(format_args!(
                "note: model input {} is taken as {why}; [inputs] sets another value",
                describe_input(g, v)
            )),
            None => r.error(format_args!(
                "model input {} is a scalar that no batch of data can feed; set its value in \
                 the configuration's [inputs] table (`\"{}\" = ...`)",
                describe_input(g, v),
                v.name
            )),
        }
    }
}

/// Whether the training graph builds for `cfg`'s first micro-batch, as a line of `r`.
fn training_graph_line(rt: &Runtime, cfg: &TrainConfig, path: &Path, r: &mut CheckReport) {
    let built = open_step_batches(&cfg.data, cfg.global_batch(), cfg.data_parallel_size, path)
        .and_then(|(batches, _, _)| {
            super::settings::training_graph(rt, cfg, &cfg.load_model()?, batches.as_ref(), 0, 0)
        });
    match built {
        Ok(tg) => r.line(format_args!(
            "ok: the training graph builds for {} ({} parameters, {} nodes forward, {} backward)",
            path.display(),
            tg.params.len(),
            tg.forward_len,
            tg.graph.nodes.len() - tg.forward_len
        )),
        Err(e) => r.error(format_args!(
            "the training graph for {} does not build: {e}",
            path.display()
        )),
    }
}
