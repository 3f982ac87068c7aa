//! Per-parameter optimizer settings: `[[optimizer_attributes]]`, parameter groups matched
//! by name, as PyTorch's `param_groups` (and ONNX Runtime's per-weight
//! `optimizer_attributes`) are used: no weight decay on biases and normalization weights,
//! a smaller learning rate for embeddings.
//!
//! ```toml
//! [[optimizer_attributes]]
//! params = ["*.bias", "*ln_*", "*LayerNorm*"]   # glob patterns over parameter names
//! weight_decay = 0.0
//! ```
//!
//! A parameter takes the first group with a matching pattern; the others take the
//! `[optimizer]` values. Patterns are shell globs (`glob` crate: `*`, `?`, `[...]`).

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{OptimizerConfig, ParamLayout};
use crate::{Error, Result};

/// One parameter group: the parameters it takes and what it changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamGroup {
    /// Glob patterns over parameter names; a parameter matching any is in the group.
    pub params: Vec<String>,
    /// Weight decay (the optimizer's kind: L2, decoupled or LAMB's).
    #[serde(default)]
    pub weight_decay: Option<f64>,
    /// Multiplies the scheduled learning rate; default 1.
    #[serde(default)]
    pub lr_scale: Option<f64>,
    /// Adam, AdamW and LAMB: decay of the first moment.
    #[serde(default)]
    pub beta1: Option<f64>,
    /// Adam, AdamW and LAMB: decay of the second moment.
    #[serde(default)]
    pub beta2: Option<f64>,
    /// Adam, AdamW and LAMB: added to the denominator.
    #[serde(default)]
    pub eps: Option<f64>,
}

/// What one stretch of the flat buffer is updated with (SGD reads only `weight_decay`
/// and `lr_scale`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Hyper {
    pub lr_scale: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

/// A stretch of the flat buffer (whole tensors) and its hyper-parameters.
pub(crate) type Segment = (Range<usize>, Hyper);

impl Hyper {
    fn of(cfg: &OptimizerConfig, lr_scale: f64) -> Hyper {
        let (weight_decay, moments) = cfg.decay_and_moments();
        let [beta1, beta2, eps] = moments.unwrap_or([0.0; 3]);
        Hyper {
            lr_scale,
            weight_decay,
            beta1,
            beta2,
            eps,
        }
    }
}

impl ParamGroup {
    /// Whether parameter `name` is in the group (patterns already validated).
    pub fn matches(&self, name: &str) -> bool {
        self.params.iter().any(|p| {
            glob::Pattern::new(p)
                .map(|p| p.matches(name))
                .unwrap_or(false)
        })
    }

    /// `cfg` with this group's values.
    fn apply(&self, cfg: &OptimizerConfig) -> OptimizerConfig {
        let mut out = cfg.clone();
        let (weight_decay, moments) = out.decay_and_moments_mut();
        *weight_decay = self.weight_decay.unwrap_or(*weight_decay);
        if let Some(fields) = moments {
            for (field, given) in fields.into_iter().zip([self.beta1, self.beta2, self.eps]) {
                *field = given.unwrap_or(*field);
            }
        }
        out
    }
}

/// Checks the groups against the optimizer they change: patterns that parse, values
/// within the optimizer's rules, moments only for optimizers that keep them.
///
/// # Errors
/// `Config` at `path` naming `optimizer_attributes[i].<field>` and the rule.
pub fn validate_groups(groups: &[ParamGroup], cfg: &OptimizerConfig, path: &Path) -> Result<()> {
    for (i, g) in groups.iter().enumerate() {
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: format!("optimizer_attributes[{i}].{field}"),
            rule,
        };
        if g.params.is_empty() {
            return Err(bad("params", "give at least one name pattern".into()));
        }
        for p in &g.params {
            glob::Pattern::new(p).map_err(|e| bad("params", format!("`{p}`: {e}")))?;
        }
        let moments = [("beta1", g.beta1), ("beta2", g.beta2), ("eps", g.eps)];
        if let (OptimizerConfig::Sgd { .. }, Some((field, _))) =
            (cfg, moments.iter().find(|(_, v)| v.is_some()))
        {
            return Err(bad(
                field,
                "applies to adam, adamw and lamb, not sgd".into(),
            ));
        }
        if let Some(s) = g.lr_scale.filter(|s| !(s.is_finite() && *s >= 0.0)) {
            return Err(bad(
                "lr_scale",
                format!("must be a finite number >= 0, got {s}"),
            ));
        }
        g.apply(cfg).validate(path).map_err(|e| match e {
            Error::Config { path, field, rule } => Error::Config {
                path,
                field: field.replace("optimizer.", &format!("optimizer_attributes[{i}].")),
                rule,
            },
            other => other,
        })?;
    }
    Ok(())
}

/// The patterns that match none of `names` (every parameter of the model), as
/// `(group, pattern)`.
pub fn unmatched_patterns<'a>(groups: &'a [ParamGroup], names: &[&str]) -> Vec<(usize, &'a str)> {
    let mut out = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        for p in &g.params {
            let Ok(pattern) = glob::Pattern::new(p) else {
                continue;
            };
            if !names.iter().any(|n| pattern.matches(n)) {
                out.push((i, p.as_str()));
            }
        }
    }
    out
}

/// Each tensor's hyper-parameters, in layout order.
pub(crate) fn tensor_hypers(
    cfg: &OptimizerConfig,
    groups: &[ParamGroup],
    layout: &ParamLayout,
) -> Vec<Hyper> {
    let base = Hyper::of(cfg, 1.0);
    layout
        .names()
        .iter()
        .map(|name| match groups.iter().find(|g| g.matches(name)) {
            Some(g) => Hyper::of(&g.apply(cfg), g.lr_scale.unwrap_or(1.0)),
            None => base,
        })
        .collect()
}

/// The flat buffer as stretches of equal hyper-parameters (neighbouring tensors of one
/// group merged, so a run without groups is one stretch and one loop).
pub(crate) fn segments(
    cfg: &OptimizerConfig,
    groups: &[ParamGroup],
    layout: &ParamLayout,
) -> Vec<Segment> {
    let hypers = tensor_hypers(cfg, groups, layout);
    let offsets = layout.offsets();
    let mut out: Vec<Segment> = Vec::new();
    for (i, h) in hypers.into_iter().enumerate() {
        let range = offsets[i]..offsets[i + 1];
        match out.last_mut() {
            Some((r, last)) if *last == h => r.end = range.end,
            _ => out.push((range, h)),
        }
    }
    if out.is_empty() {
        out.push((0..0, Hyper::of(cfg, 1.0)));
    }
    out
}
