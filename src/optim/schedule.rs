//! Learning-rate schedules: linear warmup, then constant, linear, polynomial or cosine decay.

use std::f64::consts::PI;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The learning rate of every step: linear warmup from 0 to the peak `lr`, then a decay.
///
/// Follows HuggingFace's `get_{constant,linear,polynomial_decay,cosine}_schedule_with_warmup`
/// (and ONNX Runtime's `TrainingRunner` warmup schedulers, which take the warmup as a ratio
/// too), with `w = warmup_ratio * total_steps` warmup steps, not rounded: at step
/// `s < w` the rate is `lr * s / w` (so step 0 runs at 0, as in both references); after it,
/// with `progress = (s - w) / (total_steps - w)` clamped to `[0, 1]`:
///
/// | kind | rate |
/// |---|---|
/// | constant | `lr` |
/// | linear | `lr * (1 - progress)` |
/// | polynomial | `(lr - end_lr) * (1 - progress)^power + end_lr` |
/// | cosine | `min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * progress))` |
///
/// HuggingFace's cosine has no floor; `min_lr = 0` (the default) is exactly it, and a
/// positive `min_lr` is its `cosine_with_min_lr` variant. In TOML, flat:
///
/// ```toml
/// [lr_schedule]
/// kind = "cosine"
/// lr = 1e-3
/// warmup_ratio = 0.1
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Raw", into = "Raw")]
pub struct LrSchedule {
    /// What happens after the warmup.
    pub kind: LrDecay,
    /// The peak learning rate, reached at the end of the warmup.
    pub lr: f64,
    /// The share of the steps spent warming up, in `[0, 1)`.
    pub warmup_ratio: f64,
}

/// The decay after the warmup; see [`LrSchedule`] for the formulas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrDecay {
    /// Stay at the peak.
    Constant,
    /// Straight down to 0 at the last step.
    Linear,
    /// `(lr - end_lr) * (1 - progress)^power + end_lr`.
    Polynomial {
        /// The exponent; default 1 (HuggingFace's).
        power: f64,
        /// The rate at the end; default 1e-7 (HuggingFace's `lr_end`).
        end_lr: f64,
    },
    /// Half a cosine period from the peak down to `min_lr`.
    Cosine {
        /// The floor; default 0.
        min_lr: f64,
    },
}

impl Default for LrSchedule {
    /// A constant 1e-3 without warmup (PyTorch Adam's default rate).
    fn default() -> Self {
        LrSchedule {
            kind: LrDecay::Constant,
            lr: 1e-3,
            warmup_ratio: 0.0,
        }
    }
}

impl LrSchedule {
    /// The learning rate of step `step` (from 0) of a run of `total_steps` steps.
    ///
    /// Steps past the end keep the final rate, as HuggingFace's schedules do.
    pub fn lr_at(&self, step: u64, total_steps: u64) -> f64 {
        let s = step as f64;
        let total = total_steps as f64;
        let w = self.warmup_ratio * total;
        if s < w {
            return self.lr * s / w;
        }
        let progress = if total > w {
            ((s - w) / (total - w)).clamp(0.0, 1.0)
        } else {
            // No step left after the warmup (only when `total_steps` is 0).
            1.0
        };
        match self.kind {
            LrDecay::Constant => self.lr,
            LrDecay::Linear => self.lr * (1.0 - progress),
            LrDecay::Polynomial { power, end_lr } => {
                (self.lr - end_lr) * (1.0 - progress).powf(power) + end_lr
            }
            LrDecay::Cosine { min_lr } => {
                min_lr + (self.lr - min_lr) * 0.5 * (1.0 + (PI * progress).cos())
            }
        }
    }

    /// Checks the schedule: `lr > 0`, `warmup_ratio` in `[0, 1)`, polynomial `power > 0` and
    /// `0 <= end_lr < lr` (HuggingFace refuses `end_lr >= lr` too), cosine
    /// `0 <= min_lr <= lr`; all finite.
    ///
    /// # Errors
    /// `Config` at `path` (`"<config>"` for configs built in code), naming the field as
    /// `lr_schedule.<name>` and the rule it breaks.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, rule: String| {
            Err(Error::Config {
                path: path.to_path_buf(),
                field: format!("lr_schedule.{field}"),
                rule,
            })
        };
        let lr = self.lr;
        if !(lr.is_finite() && lr > 0.0) {
            return bad("lr", format!("must be a finite number > 0, got {lr}"));
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            let r = self.warmup_ratio;
            return bad("warmup_ratio", format!("must be in [0, 1), got {r}"));
        }
        match self.kind {
            LrDecay::Constant | LrDecay::Linear => {}
            LrDecay::Polynomial { power, end_lr } => {
                if !(power.is_finite() && power > 0.0) {
                    return bad("power", format!("must be a finite number > 0, got {power}"));
                }
                if !(0.0..lr).contains(&end_lr) {
                    return bad(
                        "end_lr",
                        format!("must be >= 0 and below lr ({lr}), got {end_lr}"),
                    );
                }
            }
            LrDecay::Cosine { min_lr } => {
                if !(0.0..=lr).contains(&min_lr) {
                    return bad(
                        "min_lr",
                        format!("must be >= 0 and at most lr ({lr}), got {min_lr}"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// The serde form: one flat table tagged by `kind`, so that `deny_unknown_fields` works
/// (it does not through `#[serde(flatten)]`).
#[derive(Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum Raw {
    Constant {
        lr: f64,
        #[serde(default)]
        warmup_ratio: f64,
    },
    Linear {
        lr: f64,
        #[serde(default)]
        warmup_ratio: f64,
    },
    Polynomial {
        lr: f64,
        #[serde(default)]
        warmup_ratio: f64,
        #[serde(default = "power")]
        power: f64,
        #[serde(default = "end_lr")]
        end_lr: f64,
    },
    Cosine {
        lr: f64,
        #[serde(default)]
        warmup_ratio: f64,
        #[serde(default)]
        min_lr: f64,
    },
}

fn power() -> f64 {
    1.0
}

fn end_lr() -> f64 {
    1e-7
}

impl From<Raw> for LrSchedule {
    fn from(raw: Raw) -> Self {
        let (kind, lr, warmup_ratio) = match raw {
            Raw::Constant { lr, warmup_ratio } => (LrDecay::Constant, lr, warmup_ratio),
            Raw::Linear { lr, warmup_ratio } => (LrDecay::Linear, lr, warmup_ratio),
            Raw::Polynomial {
                lr,
                warmup_ratio,
                power,
                end_lr,
            } => (LrDecay::Polynomial { power, end_lr }, lr, warmup_ratio),
            Raw::Cosine {
                lr,
                warmup_ratio,
                min_lr,
            } => (LrDecay::Cosine { min_lr }, lr, warmup_ratio),
        };
        LrSchedule {
            kind,
            lr,
            warmup_ratio,
        }
    }
}

impl From<LrSchedule> for Raw {
    fn from(s: LrSchedule) -> Self {
        let (lr, warmup_ratio) = (s.lr, s.warmup_ratio);
        match s.kind {
            LrDecay::Constant => Raw::Constant { lr, warmup_ratio },
            LrDecay::Linear => Raw::Linear { lr, warmup_ratio },
            LrDecay::Polynomial { power, end_lr } => Raw::Polynomial {
                lr,
                warmup_ratio,
                power,
                end_lr,
            },
            LrDecay::Cosine { min_lr } => Raw::Cosine {
                lr,
                warmup_ratio,
                min_lr,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_is_one_flat_table_with_defaults() {
        let s: LrSchedule = toml::from_str("kind = \"polynomial\"\nlr = 0.01").unwrap();
        assert_eq!(
            s,
            LrSchedule {
                kind: LrDecay::Polynomial {
                    power: 1.0,
                    end_lr: 1e-7
                },
                lr: 0.01,
                warmup_ratio: 0.0
            }
        );
        let s: LrSchedule =
            toml::from_str("kind = \"cosine\"\nlr = 0.5\nwarmup_ratio = 0.25").unwrap();
        assert_eq!(s.kind, LrDecay::Cosine { min_lr: 0.0 });
        assert_eq!(s.warmup_ratio, 0.25);
    }

    #[test]
    fn toml_refuses_fields_of_another_kind() {
        let e =
            toml::from_str::<LrSchedule>("kind = \"linear\"\nlr = 1.0\nmin_lr = 0.1").unwrap_err();
        assert!(e.message().contains("unknown field `min_lr`"), "{e}");
        assert!(
            toml::from_str::<LrSchedule>("kind = \"linear\"").is_err(),
            "lr is required"
        );
    }

    #[test]
    fn round_trips_through_json() {
        let s = LrSchedule {
            kind: LrDecay::Cosine { min_lr: 1e-5 },
            lr: 3e-4,
            warmup_ratio: 0.1,
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"kind\":\"cosine\""), "{text}");
        assert_eq!(serde_json::from_str::<LrSchedule>(&text).unwrap(), s);
    }

    #[test]
    fn validation_names_field_and_rule() {
        let cases = [
            ("lr_schedule.lr", "> 0", "kind = 'linear'\nlr = 0.0"),
            ("lr_schedule.lr", "> 0", "kind = 'linear'\nlr = inf"),
            (
                "lr_schedule.warmup_ratio",
                "[0, 1)",
                "kind = 'constant'\nlr = 0.1\nwarmup_ratio = 1.0",
            ),
            (
                "lr_schedule.warmup_ratio",
                "[0, 1)",
                "kind = 'constant'\nlr = 0.1\nwarmup_ratio = -0.1",
            ),
            (
                "lr_schedule.power",
                "> 0",
                "kind = 'polynomial'\nlr = 0.1\npower = 0.0",
            ),
            (
                "lr_schedule.end_lr",
                "below lr",
                "kind = 'polynomial'\nlr = 0.1\nend_lr = 0.1",
            ),
            (
                "lr_schedule.min_lr",
                "at most lr",
                "kind = 'cosine'\nlr = 0.1\nmin_lr = 0.2",
            ),
        ];
        for (field, rule, text) in cases {
            let s: LrSchedule = toml::from_str(text).unwrap();
            match s.validate(Path::new("run.toml")) {
                Err(Error::Config {
                    field: f,
                    rule: r,
                    path,
                }) => {
                    assert_eq!((f.as_str(), path.as_path()), (field, Path::new("run.toml")));
                    assert!(r.contains(rule), "{s:?}: rule {r:?} should say {rule:?}");
                }
                other => panic!("{s:?}: expected a Config error, got {other:?}"),
            }
        }
        LrSchedule::default()
            .validate(Path::new("<config>"))
            .unwrap();
        let s: LrSchedule = toml::from_str("kind = 'cosine'\nlr = 0.1\nmin_lr = 0.1").unwrap();
        s.validate(Path::new("<config>")).unwrap();
    }
}
