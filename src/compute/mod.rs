//! Running graphs on ONNX Runtime through `ort`.

mod arena;
mod blas;
mod chain;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_attention;
#[cfg(feature = "cuda")]
mod cuda_blas;
#[cfg(feature = "cuda")]
mod cuda_dropout;
#[cfg(feature = "cuda")]
mod cuda_fused;
#[cfg(feature = "cuda")]
mod cuda_launch;
#[cfg(feature = "cuda")]
mod cuda_layer_norm;
#[cfg(feature = "cuda")]
mod cuda_nccl;
#[cfg(feature = "cuda")]
pub mod cuda_ops;
#[cfg(feature = "cuda")]
pub mod cuda_state;
mod device;
mod direct;
mod fused;
mod host_pool;
mod host_state;
pub mod kernels;
mod lifted;
mod local_shards;
mod open;
mod ort_log;
mod pinned;
mod probe;
mod replicas;
mod resident;
mod runtime;
mod session;
mod shard_ops;
#[cfg(test)]
mod test_model;
mod value;

pub use chain::{StageChain, StepOutput, TensorMap, TrainSession};
pub use device::{check_device, cuda_devices, CudaDevices, Device};
pub use direct::Target;
pub use host_pool::HostPool;
pub use host_state::HostState;
pub use local_shards::LocalShards;
pub use open::{intra_threads_for, SessionOptions};
pub use pinned::PinnedBuffers;
pub use probe::probe_values;
pub use replicas::{ReplicaGroup, ReplicaLink};
pub use resident::{open as open_device_state, Buffer, DeviceSpan, DeviceState, GradBuffer};
pub use runtime::{find_library, Runtime, RuntimeInfo, ORT_VERSION};
pub use session::{BoundInputs, GraphSession};
#[cfg(feature = "cluster")]
pub(crate) use shard_ops::TrafficMeter;
pub use shard_ops::{ShardComm, ShardGroups, ShardLink, ShardTraffic};
pub use value::{DeviceValue, Value};
