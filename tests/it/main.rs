//! pipetrain's integration tests, one binary (the crate is linked once, not once per
//! area): a module per area, the helpers they share in `common`. Run one area with
//! `cargo test --release --test it -- AREA::` (`grad_ops::`, `launch::`, ...).

mod common;

mod bad_data;
mod checkpoint;
mod chrome_trace;
mod cli;
mod cluster_manifest;
mod comm;
mod config;
mod crash;
mod deterministic;
mod device;
mod direct_outputs;
mod embed;
mod equivalence;
mod evaluation;
mod examples;
mod exported_models;
mod files;
mod fused_attention;
mod fused_kernels;
mod grad_buckets;
mod grad_exported_ops;
mod grad_ops;
mod grad_ort_cases;
mod grad_policy;
mod grad_pool;
mod grad_reach;
mod grad_upsampling;
mod intermediate_models;
mod launch;
mod launch_elastic;
mod launch_faults;
mod launch_tensor_parallel;
mod memory_cap;
mod mixed_precision;
mod models;
mod optim;
mod param_groups;
mod peer_curves;
mod probe;
mod readme_ops;
mod recompute;
mod running_stats;
mod shard_split;
mod shards;
mod signals;
mod stages;
mod telemetry;
mod tensor_parallel;
mod tensorboard;
mod tensorboard_run;
mod train_curves;
mod unfed_inputs;
