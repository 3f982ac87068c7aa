//! pipetrain: trains ONNX models across pipeline stages and data-parallel replicas, on a
//! stock ONNX Runtime build.
//!
//! # Layout
//! - [`onnx`]: protobuf types (generated once, committed) and model files.
//! - [`tensor`]: host tensors, the buffers pipetrain owns.
//! - [`graph`]: the graph IR, loss attachment, reverse-mode autodiff emitting ONNX
//!   backward graphs, stage partitioning, per-stage forward / backward / input-grad /
//!   weight-grad graphs, gradient graphs cut into bucket chains, and export of the
//!   trained inference model.
//! - [`api`]: embedding pipetrain: [`api::Trainer`] and its run handle (events,
//!   checkpoint now, stop, cancel), the seeds' `TrainingRunner` and on-device
//!   `Module` / `Optimizer` loop.
//! - [`checkpoint`]: checkpoints (safetensors shards per stage keyed by parameter name, a
//!   manifest written last), exact and layout-free resume.
//! - `cluster` (feature `cluster`): the cluster manifest `pipetrain launch` reads (nodes,
//!   layout, shared secret), rank placement, node selection under Slurm and Kubernetes.
//! - [`compute`]: ONNX Runtime through `ort` (`load-dynamic`): finding the library,
//!   sessions fed without copies, the shape probe, training-step runners.
//! - [`data`]: NumPy and safetensors files, per-step batches, synthetic data sets.
//! - [`models`]: built-in forward models (GPT-2, SqueezeNet 1.1, MLP) written as ONNX.
//! - [`config`]: the training configuration (TOML), validated up front.
//! - [`train`]: a training run over the stage graphs, in one process or as one
//!   process's part of a distributed run.
//! - `launch` (feature `cli`): `pipetrain launch`, one supervised worker process per node
//!   of a cluster manifest.
//! - `comm` (feature `cluster`): the transport between those processes: authenticated
//!   TCP, a control bus, ring all-reduce, activation and gradient links.
//! - [`Error`]: the one error type.
#![deny(missing_docs)]

pub mod api;
pub mod checkpoint;
#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "cluster")]
pub mod comm;
pub mod compute;
pub mod config;
pub mod cost;
pub mod data;
mod error;
pub mod graph;
#[cfg(feature = "cli")]
pub mod launch;
pub mod models;
pub mod onnx;
pub mod optim;
pub mod pipeline;
pub mod plan;
pub mod telemetry;
pub mod tensor;
pub mod train;

pub use error::{Error, ErrorKind, Result};
