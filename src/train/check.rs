//! `pipetrain check MODEL.onnx [CONFIG]`: what would keep a model from training as the
//! user's model, said before any training (the same warnings start `train`).

use std::fmt::Write;
use std::path::Path;

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::open_step_batches;
use crate::graph::{check, Graph};
use crate::Result;

/// The report for `model_path`; with `config`, also whether its training graph builds
/// on the configuration's first micro-batch (folding, gradients, padding rows).
///
/// # Errors
/// The model or the configuration cannot be read (a training graph that does not build
/// is part of the report, not an error).
pub fn check_model(rt: &Runtime, model_path: &Path, config: Option<&Path>) -> Result<String> {
    let model = crate::onnx::load_model(model_path)?;
    let g = Graph::from_model(&model)?;
    let findings = check::inspect(&g);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} nodes, {} initializers, inputs {}",
        model_path.display(),
        g.nodes.len(),
        g.initializers.len(),
        g.inputs
            .iter()
            .filter(|v| g.initializer(&v.name).is_none())
            .map(|v| format!("`{}`", v.name))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for w in findings.warnings() {
        let _ = writeln!(out, "warning: {w}");
    }
    if !findings.no_gradient.is_empty() {
        let nodes: Vec<String> = findings
            .no_gradient
            .iter()
            .map(|(n, op)| format!("`{n}` ({op})"))
            .collect();
        let _ = writeln!(
            out,
            "error: {} nodes on the way from a parameter to an output have no gradient rule: {}",
            nodes.len(),
            nodes.join(", ")
        );
    }
    if let Some(path) = config {
        let mut cfg = TrainConfig::load(path)?;
        cfg.model = None;
        cfg.model_path = model_path.to_path_buf();
        let _ = writeln!(out, "{}", training_graph_line(rt, &cfg, path));
    }
    if findings == check::Findings::default() && config.is_none() {
        let _ = writeln!(out, "ok: nothing found that keeps this model from training");
    }
    Ok(out)
}

/// One line on whether the training graph builds for `cfg`'s first micro-batch.
fn training_graph_line(rt: &Runtime, cfg: &TrainConfig, path: &Path) -> String {
    let built = open_step_batches(&cfg.data, cfg.global_batch(), cfg.data_parallel_size, path)
        .and_then(|(batches, _, _)| {
            super::settings::training_graph(rt, cfg, &cfg.load_model()?, batches.as_ref(), 0, 0)
        });
    match built {
        Ok(tg) => format!(
            "ok: the training graph builds for {} ({} parameters, {} nodes forward, {} backward)",
            path.display(),
            tg.params.len(),
            tg.forward_len,
            tg.graph.nodes.len() - tg.forward_len
        ),
        Err(e) => format!(
            "error: the training graph for {} does not build: {e}",
            path.display()
        ),
    }
}
