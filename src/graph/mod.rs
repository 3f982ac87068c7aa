//! Graphs: the IR, loss attachment, reverse-mode autodiff, stage partitioning and export.

pub mod autodiff;
mod buckets;
mod export;
mod ir;
mod loss;
mod partition;
mod stages;
mod subgraph;
mod training;

pub use buckets::{grad_chain, GradChain};
pub use export::export_inference_model;
pub use ir::*;
pub use loss::{attach_loss, LossNormalize, LossSpec, ACC_CORRECT, ACC_COUNTED, LOSS};
pub use partition::{assign_stages, BalanceBy, Partition, StageAssignment};
pub use stages::{build_stage_graphs, build_stage_graphs_with, Recompute, StageGraphs, StageIo};
pub use training::{
    build_training_graph, Param, ShapeProbe, TrainOptions, TrainingGraph, LOSS_GRAD,
};
