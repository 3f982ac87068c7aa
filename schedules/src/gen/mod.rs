//! Schedule generators. Each returns a compute-only [`Schedule`] (F, B, I, W per rank);
//! [`crate::lower()`] adds the transfers.
//!
//! | generator               | placement        | backward | reference                                  |
//! |-------------------------|------------------|----------|--------------------------------------------|
//! | [`gpipe`]               | stage `s` on `s` | `B`      | PyTorch `ScheduleGPipe`                    |
//! | [`one_f_one_b`]         | stage `s` on `s` | `B`      | Megatron 1F1B, PyTorch `Schedule1F1B`      |
//! | [`interleaved_1f1b`]    | `s % ranks`      | `B`      | PyTorch `ScheduleInterleaved1F1B`          |
//! | [`zb_h1`]               | stage `s` on `s` | `I`+`W`  | Qi et al. 2023, ZB-H1                      |
//! | [`zb_v`]                | V-shaped         | `I`+`W`  | Qi et al. 2023, ZB-V; PyTorch `ScheduleZBVZeroBubble` |
//! | [`dualpipe_v`]          | V-shaped         | `I`+`W`  | DeepSeek DualPipeV (`dualpipev.py`)        |
//! | [`v_half`], [`v_min`]   | V-shaped         | `I`+`W`  | Qi et al. 2024, controllable memory        |

mod controllable;
mod dualpipe_v;
mod gpipe;
mod interleaved;
mod looped;
mod one_f_one_b;
mod zero_bubble;
mod zero_bubble_v;

use serde::{Deserialize, Serialize};

pub use controllable::{v_half, v_min};
pub use dualpipe_v::dualpipe_v;
pub use gpipe::gpipe;
pub use interleaved::interleaved_1f1b;
pub use one_f_one_b::one_f_one_b;
pub use zero_bubble::zb_h1;
pub use zero_bubble_v::zb_v;

use crate::{Schedule, ScheduleError};

/// Which schedule to generate, as a typed config value (e.g. a `[schedule]` table in the
/// training config: `kind = "1f1b"`, `stages = 4`, `micro_batches = 8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
#[non_exhaustive]
pub enum ScheduleSpec {
    /// [`gpipe`].
    #[serde(rename = "gpipe")]
    GPipe {
        /// Pipeline stages (= ranks).
        stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`one_f_one_b`].
    #[serde(rename = "1f1b")]
    OneFOneB {
        /// Pipeline stages (= ranks).
        stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`interleaved_1f1b`].
    #[serde(rename = "interleaved_1f1b")]
    Interleaved1F1B {
        /// Pipeline ranks.
        ranks: usize,
        /// Stages per rank.
        virtual_stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`zb_h1`].
    #[serde(rename = "zb_h1")]
    ZbH1 {
        /// Pipeline stages (= ranks).
        stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`zb_v`].
    #[serde(rename = "zb_v")]
    ZbV {
        /// Pipeline ranks (two stages each).
        ranks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`dualpipe_v`].
    #[serde(rename = "dualpipe_v")]
    DualPipeV {
        /// Pipeline ranks (two stages each).
        ranks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`v_half`].
    #[serde(rename = "v_half")]
    VHalf {
        /// Pipeline ranks (two stages each).
        ranks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// [`v_min`].
    #[serde(rename = "v_min")]
    VMin {
        /// Pipeline ranks (two stages each).
        ranks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
}

impl ScheduleSpec {
    /// Runs the generator this spec names.
    ///
    /// # Errors
    /// Whatever that generator refuses.
    pub fn generate(&self) -> Result<Schedule, ScheduleError> {
        match *self {
            ScheduleSpec::GPipe {
                stages,
                micro_batches,
            } => gpipe(stages, micro_batches),
            ScheduleSpec::OneFOneB {
                stages,
                micro_batches,
            } => one_f_one_b(stages, micro_batches),
            ScheduleSpec::Interleaved1F1B {
                ranks,
                virtual_stages,
                micro_batches,
            } => interleaved_1f1b(ranks, virtual_stages, micro_batches),
            ScheduleSpec::ZbH1 {
                stages,
                micro_batches,
            } => zb_h1(stages, micro_batches),
            ScheduleSpec::ZbV {
                ranks,
                micro_batches,
            } => zb_v(ranks, micro_batches),
            ScheduleSpec::DualPipeV {
                ranks,
                micro_batches,
            } => dualpipe_v(ranks, micro_batches),
            ScheduleSpec::VHalf {
                ranks,
                micro_batches,
            } => v_half(ranks, micro_batches),
            ScheduleSpec::VMin {
                ranks,
                micro_batches,
            } => v_min(ranks, micro_batches),
        }
    }
}

/// Refuses the first parameter that is zero.
fn require_positive(
    context: &'static str,
    parameters: &[(&'static str, usize)],
) -> Result<(), ScheduleError> {
    match parameters.iter().find(|(_, v)| *v == 0) {
        Some(&(parameter, _)) => Err(ScheduleError::ZeroParameter { context, parameter }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_from_json() {
        let spec: ScheduleSpec =
            serde_json::from_str(r#"{"kind":"1f1b","stages":2,"micro_batches":4}"#).unwrap();
        assert_eq!(
            spec,
            ScheduleSpec::OneFOneB {
                stages: 2,
                micro_batches: 4
            }
        );
        assert_eq!(spec.generate().unwrap(), one_f_one_b(2, 4).unwrap());
        let typo = r#"{"kind":"1f1b","stages":2,"microbatches":4}"#;
        assert!(serde_json::from_str::<ScheduleSpec>(typo).is_err());
    }

    #[test]
    fn zero_parameters_are_named() {
        assert_eq!(
            gpipe(0, 4),
            Err(ScheduleError::ZeroParameter {
                context: "gpipe",
                parameter: "stages"
            })
        );
        assert_eq!(
            interleaved_1f1b(2, 0, 4),
            Err(ScheduleError::ZeroParameter {
                context: "interleaved_1f1b",
                parameter: "virtual_stages"
            })
        );
    }
}
