//! Pipeline schedules as data: generated, lowered, validated and simulated by pure
//! functions, then handed to the runtime (`pipetrain-actors`) to execute. No tokio, no
//! tensors.
//!
//! # Layout
//! - [`ir`]: [`Action`] (`stage`, [`ActionKind`], micro-batch) and its text form
//!   (`1F3`, `2I0`, `1SEND_F3`, `0RECV_B3`, `0ALLREDUCE`, `0STEP`), serialised as that text.
//! - `schedule`: [`Schedule`], per-rank action lists plus the stage-to-rank placement
//!   ([`looped_placement`], [`v_placement`]), checked on construction and on
//!   deserialisation; `grid` formats it as ranks x steps with marked cells ([`Mark`]).
//! - [`gen`]: the generators, one file each: [`gpipe`], [`one_f_one_b`],
//!   [`interleaved_1f1b`], [`zb_h1`], [`zb_v`], [`dualpipe_v`], [`v_half`], [`v_min`], and [`ScheduleSpec`] to pick one from a
//!   config. They return compute-only schedules (F, B, I, W).
//! - `lower`: [`lower()`] inserts paired sends and receives (PyTorch's `_add_send_recv`),
//!   then optional `ALLREDUCE`/`STEP` ([`LowerOptions`]).
//! - `validate`: [`validate()`]: work done exactly once, transfers paired, dependencies in
//!   order, no deadlock with blocking transfers. Errors name rank, step, stage and
//!   micro-batch and carry the grid with `<-- ERROR HERE`.
//! - `simulate`: [`simulate()`] under a [`CostModel`] gives a [`Timeline`] (`timeline`):
//!   makespan, idle time per rank, bubble fraction, peak in-flight activations per stage.
//! - `shared`: [`simulate_on`], the same on a [`Machine`] whose cores the ranks share
//!   (processor sharing), with each hand-off ([`Hop`]) costing its own time: a planner's
//!   prediction on fewer cores than actors.
//! - `trace`: [`Trace`], what a real run did; [`Trace::to_timeline`] measures it like a
//!   simulation and [`first_divergence`] compares it with its schedule for replay.
//! - `error`: [`ScheduleError`], the crate's one error type.
//!
//! # Example
//! ```
//! use pipetrain_schedules::{lower, one_f_one_b, simulate, validate, CostModel, LowerOptions, StageCost};
//!
//! let schedule = one_f_one_b(4, 8)?;
//! let lowered = lower(&schedule, LowerOptions { all_reduce: true, optimizer_step: true })?;
//! validate(&lowered)?;
//! let timeline = simulate(&lowered, &CostModel::uniform(4, StageCost::split(1.0, 0.5, 0.5)))?;
//! // 1F1B with F = B: bubble (p - 1) / (m + p - 1).
//! assert!((timeline.bubble_fraction() - 3.0 / 11.0).abs() < 1e-12);
//! # Ok::<(), pipetrain_schedules::ScheduleError>(())
//! ```
#![deny(missing_docs)]

mod error;
pub mod gen;
mod grid;
pub mod ir;
mod lower;
mod schedule;
mod shared;
mod simulate;
mod timeline;
mod trace;
mod validate;

pub use error::ScheduleError;
pub use gen::{
    dualpipe_v, gpipe, interleaved_1f1b, one_f_one_b, v_half, v_min, zb_h1, zb_v, ScheduleSpec,
};
pub use grid::Mark;
pub use ir::{Action, ActionKind, Phase};
pub use lower::{lower, LowerOptions};
pub use schedule::{looped_placement, v_placement, Schedule};
pub use shared::{simulate_on, Hop, Machine};
pub use simulate::{simulate, simulate_with, CostModel, StageCost};
pub use timeline::{Span, Timeline};
pub use trace::{first_divergence, Divergence, ReplayScope, Trace, TraceEvent};
pub use validate::validate;
