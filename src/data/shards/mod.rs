//! Training data in ONNX Runtime's TrainingRunner shard format: folders of `.pb` files
//! (ORT's `train_data_dir` / `test_data_dir`).
//!
//! # Layout
//! - [`read`]: one shard file into samples, refusing damaged or inconsistent records.
//! - [`write`]: shards from samples, and `pipetrain data pack` (an `.npz` or safetensors
//!   file cut into shards).
//! - [`dataset`]: [`ShardDataset`], a folder of shards as the batches of a run's steps,
//!   split among data-parallel replicas by samples or by files.
//! - `cache`: decoded files kept in memory, and the thread that reads them ahead.
//! - [`spec`]: [`ShardSpec`], the `[data.shards]` configuration table.
//!
//! # The record layout, as ONNX Runtime reads it
//! Checked against `orttraining/orttraining/models/runner/data_loader.cc` (functions
//! `GetAllDataFiles`, `DataLoader::LoadFile`, `DataLoader::LoadOneSample`) and
//! `orttraining/orttraining/models/runner/training_util.cc` (`DataSet::AddData`,
//! `DataSet::GetKthBatch`):
//! - A data folder's files are the regular files whose name ends in `.pb` and does not
//!   start with `.`, sorted by path (so every worker sees the same order).
//! - A file is a sequence of samples and nothing else. A sample is a little-endian
//!   `uint32` giving the byte count of the rest of the sample, followed by its features.
//! - A feature is a little-endian `uint32` byte count followed by that many bytes of one
//!   serialized `onnx.TensorProto`; the sample's count is the sum of `4 + count` over its
//!   features. There is no `SequenceProto` and no per-file header.
//! - A feature is matched to a model input by the `TensorProto`'s `name`, through the
//!   `input_name_map` (feature name -> input name); features the map does not name are
//!   not fed.
//! - Tensors carry one sample, without a batch axis; a batch of `B` samples is their
//!   concatenation with `B` put in front of the sample's shape.
//!
//! # Where pipetrain differs
//! - ORT stops quietly at a file's last whole 4-byte length and does not check that a
//!   sample's features end where its length says; pipetrain refuses stray bytes, lengths
//!   past the end of the file or sample, an undecodable or unnamed feature, a duplicated
//!   feature, and a sample whose features, element types or shapes differ from the data
//!   set's first sample, naming the file, the sample and the feature.
//! - An empty `input_name_map` feeds every feature to the input of its own name.
//! - ORT makes a batch of samples holding one element `[B]` whatever their own shape;
//!   pipetrain always makes `[B, ..sample shape]`, so a packed `[N, 1]` array comes back as
//!   `[B, 1]`, as from the `.npz`.
//! - ORT splits files among data-parallel ranks (file `i` to rank `i % world_size`) and
//!   shuffles within a file. pipetrain does so with `split = "files"`; by default
//!   (`split = "samples"`) it cuts each global batch of one order over all files by rows
//!   (see [`crate::data::StepBatches::part`]) and shuffles the whole data set's sample
//!   order, so that a checkpoint resumes at any layout.

mod cache;
pub mod dataset;
pub mod read;
pub mod spec;
pub mod write;

pub use dataset::ShardDataset;
pub use read::{parse_shard, read_shard, shard_files, Sample};
pub use spec::{ShardSpec, ShardSplit};
pub use write::{encode_sample, pack, pack_command, write_shard, PackArgs};
