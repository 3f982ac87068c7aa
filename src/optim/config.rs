//! The optimizer's configuration: which algorithm and its hyper-parameters.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Which optimizer a stage runs, with its hyper-parameters.
///
/// The learning rate is not here: it comes from the [`LrSchedule`](super::LrSchedule) at
/// every step. Field defaults are those of `torch.optim` (LAMB: ONNX Runtime's
/// `LambOptimizer`). In TOML:
///
/// ```toml
/// [optimizer]
/// kind = "adamw"        # sgd | adam | adamw | lamb
/// weight_decay = 0.01
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`: L2 weight decay added to the gradient, then (heavy-ball or
    /// Nesterov) momentum.
    Sgd {
        /// Momentum factor; 0 (the default) is plain SGD.
        #[serde(default)]
        momentum: f64,
        /// Dampening of the gradient in the momentum buffer; default 0.
        #[serde(default)]
        dampening: f64,
        /// Nesterov momentum; needs `momentum > 0` and `dampening == 0`.
        #[serde(default)]
        nesterov: bool,
        /// L2 penalty added to the gradient; default 0.
        #[serde(default)]
        weight_decay: f64,
    },
    /// `torch.optim.Adam` (`amsgrad=False`): L2 weight decay added to the gradient.
    Adam {
        /// Decay of the first moment; default 0.9.
        #[serde(default = "beta1")]
        beta1: f64,
        /// Decay of the second moment; default 0.999.
        #[serde(default = "beta2")]
        beta2: f64,
        /// Added to the denominator; default 1e-8.
        #[serde(default = "eps_adam")]
        eps: f64,
        /// L2 penalty added to the gradient; default 0.
        #[serde(default)]
        weight_decay: f64,
    },
    /// `torch.optim.AdamW`: decoupled weight decay `p *= 1 - lr * weight_decay`.
    #[serde(rename = "adamw")]
    AdamW {
        /// Decay of the first moment; default 0.9.
        #[serde(default = "beta1")]
        beta1: f64,
        /// Decay of the second moment; default 0.999.
        #[serde(default = "beta2")]
        beta2: f64,
        /// Added to the denominator; default 1e-8.
        #[serde(default = "eps_adam")]
        eps: f64,
        /// Decoupled weight decay; default 0.01.
        #[serde(default = "weight_decay_adamw")]
        weight_decay: f64,
    },
    /// LAMB (You et al. 2019) as ONNX Runtime's `LambOptimizer`: Adam direction plus
    /// decoupled weight decay, scaled per tensor by a trust ratio.
    Lamb {
        /// Decay of the first moment; default 0.9.
        #[serde(default = "beta1")]
        beta1: f64,
        /// Decay of the second moment; default 0.999.
        #[serde(default = "beta2")]
        beta2: f64,
        /// Added to the denominator; default 1e-6 (ONNX Runtime's).
        #[serde(default = "eps_lamb")]
        eps: f64,
        /// Decoupled weight decay, inside the trust-ratio-scaled update; default 0.
        #[serde(default)]
        weight_decay: f64,
    },
}

fn beta1() -> f64 {
    0.9
}

fn beta2() -> f64 {
    0.999
}

fn eps_adam() -> f64 {
    1e-8
}

fn eps_lamb() -> f64 {
    1e-6
}

fn weight_decay_adamw() -> f64 {
    0.01
}

impl Default for OptimizerConfig {
    /// AdamW with PyTorch's defaults, the optimizer of the peers' reference curves.
    fn default() -> Self {
        OptimizerConfig::AdamW {
            beta1: beta1(),
            beta2: beta2(),
            eps: eps_adam(),
            weight_decay: weight_decay_adamw(),
        }
    }
}

impl OptimizerConfig {
    /// Checks every hyper-parameter, as `torch.optim` does when the optimizer is built.
    ///
    /// Rules: betas in `[0, 1)`, `eps > 0`, `weight_decay >= 0`, SGD `momentum >= 0` and
    /// `dampening` in `[0, 1]`, and Nesterov only with `momentum > 0` and `dampening == 0`
    /// (PyTorch's rule). All values must be finite. PyTorch accepts `eps == 0` and any
    /// dampening; pipetrain refuses them, since they divide by zero or make no sense.
    ///
    /// # Errors
    /// `Config` at `path` (`"<config>"` for configs built in code), naming the field as
    /// `optimizer.<name>` and the rule it breaks.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| Error::Config {
            path: path.to_path_buf(),
            field: format!("optimizer.{field}"),
            rule,
        };
        let beta = |field: &str, b: f64| {
            if (0.0..1.0).contains(&b) {
                Ok(())
            } else {
                Err(bad(field, format!("must be in [0, 1), got {b}")))
            }
        };
        let non_negative = |field: &str, x: f64| {
            if x.is_finite() && x >= 0.0 {
                Ok(())
            } else {
                Err(bad(field, format!("must be a finite number >= 0, got {x}")))
            }
        };
        let positive = |field: &str, x: f64| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(bad(field, format!("must be a finite number > 0, got {x}")))
            }
        };
        match *self {
            OptimizerConfig::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                non_negative("momentum", momentum)?;
                if !(0.0..=1.0).contains(&dampening) {
                    return Err(bad(
                        "dampening",
                        format!("must be in [0, 1], got {dampening}"),
                    ));
                }
                non_negative("weight_decay", weight_decay)?;
                if nesterov && (momentum == 0.0 || dampening != 0.0) {
                    return Err(bad(
                        "nesterov",
                        format!(
                            "Nesterov momentum requires momentum > 0 and dampening = 0, \
                             got momentum {momentum} and dampening {dampening}"
                        ),
                    ));
                }
            }
            _ => {
                let (weight_decay, moments) = self.decay_and_moments();
                if let Some([beta1, beta2, eps]) = moments {
                    beta("beta1", beta1)?;
                    beta("beta2", beta2)?;
                    positive("eps", eps)?;
                }
                non_negative("weight_decay", weight_decay)?;
            }
        }
        Ok(())
    }

    /// Its weight decay, and its `[beta1, beta2, eps]` where it keeps moments (not SGD).
    pub(crate) fn decay_and_moments(&self) -> (f64, Option<[f64; 3]>) {
        let mut copy = self.clone();
        let (weight_decay, moments) = copy.decay_and_moments_mut();
        (*weight_decay, moments.map(|m| m.map(|v| *v)))
    }

    /// [`OptimizerConfig::decay_and_moments`], to change them.
    pub(crate) fn decay_and_moments_mut(&mut self) -> (&mut f64, Option<[&mut f64; 3]>) {
        match self {
            OptimizerConfig::Sgd { weight_decay, .. } => (weight_decay, None),
            OptimizerConfig::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerConfig::Lamb {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => (weight_decay, Some([beta1, beta2, eps])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_fills_pytorch_defaults() {
        let c: OptimizerConfig = toml::from_str("kind = \"adamw\"").unwrap();
        assert_eq!(c, OptimizerConfig::default());
        let c: OptimizerConfig = toml::from_str("kind = \"sgd\"\nmomentum = 0.9").unwrap();
        assert_eq!(
            c,
            OptimizerConfig::Sgd {
                momentum: 0.9,
                dampening: 0.0,
                nesterov: false,
                weight_decay: 0.0
            }
        );
        let c: OptimizerConfig = toml::from_str("kind = \"adam\"").unwrap();
        assert!(matches!(c, OptimizerConfig::Adam { eps, weight_decay, .. }
            if eps == 1e-8 && weight_decay == 0.0));
        let c: OptimizerConfig = toml::from_str("kind = \"lamb\"").unwrap();
        assert!(
            matches!(c, OptimizerConfig::Lamb { beta1, beta2, eps, weight_decay }
            if beta1 == 0.9 && beta2 == 0.999 && eps == 1e-6 && weight_decay == 0.0)
        );
    }

    #[test]
    fn toml_refuses_unknown_fields_and_kinds() {
        let e = toml::from_str::<OptimizerConfig>("kind = \"adam\"\nmomentum = 0.9").unwrap_err();
        assert!(e.message().contains("unknown field `momentum`"), "{e}");
        let e = toml::from_str::<OptimizerConfig>("kind = \"adagrad\"").unwrap_err();
        assert!(e.message().contains("adagrad"), "{e}");
    }

    #[test]
    fn round_trips_through_json() {
        for c in [
            OptimizerConfig::default(),
            OptimizerConfig::Lamb {
                beta1: 0.8,
                beta2: 0.99,
                eps: 1e-6,
                weight_decay: 0.1,
            },
        ] {
            let text = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<OptimizerConfig>(&text).unwrap(), c);
        }
        let text = serde_json::to_string(&OptimizerConfig::default()).unwrap();
        assert!(text.contains("\"kind\":\"adamw\""), "{text}");
    }

    /// The field and rule of a `Config` error at `run.toml`.
    fn config_error(r: Result<()>) -> (String, String) {
        match r {
            Err(Error::Config { field, rule, path }) => {
                assert_eq!(path, Path::new("run.toml"));
                (field, rule)
            }
            other => panic!("expected a Config error, got {other:?}"),
        }
    }

    #[test]
    fn validation_names_field_and_rule() {
        let cases = [
            ("optimizer.beta1", "[0, 1)", "kind = 'adamw'\nbeta1 = 1.0"),
            ("optimizer.beta1", "[0, 1)", "kind = 'adamw'\nbeta1 = nan"),
            ("optimizer.beta2", "[0, 1)", "kind = 'adam'\nbeta2 = -0.1"),
            ("optimizer.eps", "> 0", "kind = 'lamb'\neps = 0.0"),
            (
                "optimizer.weight_decay",
                ">= 0",
                "kind = 'adamw'\nweight_decay = -1e-2",
            ),
            (
                "optimizer.momentum",
                ">= 0",
                "kind = 'sgd'\nmomentum = -0.5",
            ),
            (
                "optimizer.dampening",
                "[0, 1]",
                "kind = 'sgd'\ndampening = 1.5",
            ),
            (
                "optimizer.nesterov",
                "momentum > 0",
                "kind = 'sgd'\nnesterov = true",
            ),
            (
                "optimizer.nesterov",
                "dampening = 0",
                "kind = 'sgd'\nmomentum = 0.9\n\
                dampening = 0.1\nnesterov = true",
            ),
        ];
        let layout = crate::optim::ParamLayout::new([("w", vec![2])]);
        for (field, rule, text) in cases {
            let cfg: OptimizerConfig = toml::from_str(text).unwrap();
            let (f, r) = config_error(cfg.validate(Path::new("run.toml")));
            assert_eq!(f, field, "{cfg:?}");
            assert!(r.contains(rule), "{cfg:?}: rule {r:?} should say {rule:?}");
            assert!(
                crate::optim::build(&cfg, &layout).is_err(),
                "build must refuse {cfg:?}"
            );
        }
        for text in [
            "kind = 'adamw'",
            "kind = 'sgd'\nmomentum = 0.9\nnesterov = true\nweight_decay = 1e-4",
            "kind = 'lamb'\nweight_decay = 0.01",
            "kind = 'adam'\nbeta1 = 0.0",
        ] {
            let cfg: OptimizerConfig = toml::from_str(text).unwrap();
            cfg.validate(Path::new("run.toml")).unwrap();
        }
    }
}
