//! The APIs of ONNX Runtime's training documents, in Rust.
//!
//! - [`TrainingRunner`] (seed 000, `TrainingRunner::Run`): a whole run from
//!   [`TrainingParameters`] with the runner's field names, on a training loader and an
//!   optional evaluation loader (none: no evaluation).
//! - The on-device loop of seed 002 (`CheckpointState` / `Module` / `Optimizer`):
//!   `module.train_step(batch)`, `optimizer.step(&mut module)`, `module.lazy_reset_grad()`,
//!   `module.eval_step(batch)`, a [`LinearLrScheduler`], and
//!   [`Module::export_model_for_inferencing`]. It runs the same stage compute as
//!   `pipetrain train` (one fused forward + backward session), so the same model, data and
//!   optimizer give bitwise the same weights.
//!
//! Where Rust's ownership differs from ORT's Python objects: ORT's `Optimizer` holds its
//! module; here [`Optimizer::step`] takes the module, and the optimizer's state lives with
//! the module's parameters.

mod module;
mod runner;
mod state;

pub use module::{LinearLrScheduler, Module, Optimizer};
pub use runner::{TrainingParameters, TrainingRunner};
pub use state::CheckpointState;
