//! Training on the actor runtime (`pipetrain-actors`) with ONNX Runtime stages.
//!
//! # Layout
//! - `stage`: [`OrtStage`], the [`pipetrain_actors::StageCompute`] of one stage of one
//!   replica: its sessions, flat parameter and gradient buffers, optimizer and stash.
//! - `data`: [`StepData`], the [`pipetrain_actors::DataSource`] splitting each step's
//!   global batch into per-replica micro-batches.

mod data;
mod stage;

pub use data::StepData;
pub use stage::{OrtStage, Payload};
