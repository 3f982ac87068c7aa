//! Graphs: the IR, loss attachment, reverse-mode autodiff, stage partitioning and export.

pub mod autocast;
pub mod autodiff;
mod buckets;
pub mod check;
mod cleanup;
pub mod custom_ops;
pub mod declared;
mod deterministic;
mod export;
mod fusion;
mod gathers;
mod ir;
mod keyed_dropout;
mod loss;
mod loss_metas;
mod model_inputs;
mod params;
pub(crate) mod partition;
mod row_sums;
mod running_stats;
mod selected_rows;
mod sequences;
mod shape_probe;
mod stages;
mod static_fold;
mod subgraph;
pub mod tensor_parallel;
mod tied;
mod training;
mod transposes;
mod unfed_inputs;

pub use buckets::{grad_chain, GradChain};
pub use deterministic::{rows_add_reference, scatter_adds_as_products, scatter_adds_as_rows_add};
pub use export::{export_inference_model, mark_trained_steps, COMPLETE_KEY, STEPS_KEY, TOTAL_KEY};
pub use fusion::{blas_products, tanh_gelu, tanh_gelu_slope};
pub use ir::*;
pub use keyed_dropout::{dropouts_for_inference, key_dropouts, DROPOUT_KEY};
pub use loss::{attach_loss, LossNormalize, LossSpec, ACC_CORRECT, ACC_COUNTED, LOSS};
pub use params::ParamOptions;
pub use partition::{
    assign_stages, flops_per_node, BalanceBy, NodeTimes, Partition, StageAssignment,
};
pub use row_sums::row_sums_as_products;
pub use running_stats::{buffers_as_constants, Buffer};
pub use sequences::{makes_sequence, split_sequences};
pub use shape_probe::ShapeProbe;
pub use stages::{
    accumulating, build_stage_graphs, build_stage_graphs_with, Recompute, StageGraphs, StageIo,
    ACC_SUFFIX,
};
pub use static_fold::{probe_and_fold, static_nodes, FoldReport};
pub use tied::{tied_params, with_tied_shared, TiedParam};
pub use training::{
    build_sharded_training_graph, build_training_graph, InitValue, Param, TrainOptions,
    TrainingGraph, LOSS_GRAD,
};
pub use unfed_inputs::{bind_unfed_inputs, describe_input, implied_default, Bound, InputValue};
