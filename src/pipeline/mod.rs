//! Training on the actor runtime (`pipetrain-actors`) with ONNX Runtime stages.
//!
//! # Layout
//! - `stage`: [`OrtStage`], one stage of one replica: its sessions, flat parameter and
//!   gradient buffers, optimizer, loss scale and stash; restoring from a checkpoint.
//! - `settings`: [`StageSettings`], how a stage trains besides its graphs (optimizer,
//!   loss scale and normalization, test aids), and the histogram tap.
//! - `stage_run`: running one of a stage's graphs: its feeds, and parameter gradients
//!   into the step's accumulators.
//! - `stage_compute`: [`OrtStage`] as the runtime's [`pipetrain_actors::StageCompute`]:
//!   forward, backward, evaluation, gradient statistics, the decided update, snapshots
//!   for checkpoints.
//! - `stage_values`: the trained parameters a stage hands out, and histogram copies.
//! - `stage_device`: a stage on a GPU keeping its parameters, gradients and optimizer
//!   state in device memory (`compute::DeviceState`): feeds, accumulation, update, and
//!   the host copy for checkpoints.
//! - `buckets`: the gradient graph as a chain of pieces on a step's last micro-batch,
//!   each piece's gradients sent for reduction while the next pieces run.
//! - `shard`: [`StageShard`], a stage that is one tensor shard: its split parameters in
//!   gradient statistics, checkpoints and exported parameters.
//! - `tied`: a tied weight's value handed on with a step's first forward only.
//! - `zero`: [`ZeroPart`], a stage's optimizer state (and gradients) sharded across its
//!   data-parallel replicas (ZeRO stages 1 and 2): which part each replica updates.
//! - `zero_grads`: ZeRO stage 2's buckets, every micro-batch's, reduce-scattered as
//!   the backward makes them, each replica adding its own part.
//! - `data`: [`StepData`], the [`pipetrain_actors::DataSource`] splitting each step's
//!   global batch into per-replica micro-batches.

mod adasum;
mod buckets;
mod data;
mod settings;
mod shard;
mod stage;
mod stage_compute;
mod stage_device;
mod stage_open;
mod stage_run;
mod stage_values;
mod tied;
mod zero;
mod zero_grads;

pub use adasum::{adasum_pair, AdasumSlot};
pub use data::{StepData, LOSS_COUNT};
pub use settings::{HistogramTap, StageSettings, Tapped};
pub use shard::{whole_parameters, StageShard};
pub use stage::{OrtStage, Payload};
pub use stage_device::{state_fits_device, HostTraffic};
pub use zero::{ZeroPart, ZeroSlot};
