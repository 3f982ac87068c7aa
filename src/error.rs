//! The crate's one error type, and its kinds ([`ErrorKind`]) for a service to act on.

use std::path::PathBuf;
use std::sync::Arc;

/// Everything that can go wrong in `pipetrain`: each variant names the file, node, value or
/// field involved and the rule that was broken.
///
/// Cheap to clone (the operating system's, ONNX Runtime's and the actor runtime's errors
/// are shared), so a run's error is both its [`crate::api::RunEvent::Failed`] and what
/// [`crate::api::RunHandle::wait`] returns.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: Arc<std::io::Error>,
    },
    /// The bytes of a file are not a valid ONNX protobuf (truncated, or another format).
    #[error("{path}: not a valid ONNX model: {reason}")]
    NotOnnx {
        /// The file.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// An initializer's external data could not be resolved.
    #[error("{path}: initializer `{tensor}`: external data: {reason}")]
    ExternalData {
        /// The model file.
        path: PathBuf,
        /// The initializer.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The model imports an operator set this version cannot handle.
    #[error("model imports opset {version} of domain `{domain}`; pipetrain handles {supported}")]
    UnsupportedOpset {
        /// The domain (`""` is the default ONNX domain).
        domain: String,
        /// The imported version.
        version: i64,
        /// What is supported, in words.
        supported: String,
    },
    /// A node on the path from a trainable parameter to the loss has no gradient rule.
    #[error(
        "node `{node}` ({op_type}) has no gradient rule, but parameter `{param}` needs a gradient through it{also}"
    )]
    NoGradient {
        /// The node's name (or its first output when unnamed).
        node: String,
        /// Its operator type.
        op_type: String,
        /// A parameter whose gradient flows through the node.
        param: String,
        /// The other nodes on the path without a rule (every one is named at once), as
        /// `"; also without a gradient rule: ..."`, or empty.
        also: String,
    },
    /// A node's gradient rule cannot handle this particular use of the op.
    #[error("node `{node}` ({op_type}): gradient not supported: {reason}")]
    UnsupportedGradient {
        /// The node.
        node: String,
        /// Its operator type.
        op_type: String,
        /// The case that is not handled.
        reason: String,
    },
    /// Model inputs that neither the data nor `[inputs]` gives a value (every one named).
    #[error(
        "the data feeds no value to model input(s) {inputs}; give each an array in the data, \
         or a value in the configuration's [inputs] table (`\"{first}\" = 0`)"
    )]
    UnfedInputs {
        /// Each input, described (type, rank, what reads it, what made it).
        inputs: String,
        /// The first one's name, for the example.
        first: String,
    },
    /// A name given by the user (prediction, label, cut edge, ...) is not in the graph.
    #[error("{role} `{name}` is not a value of the graph{hint}")]
    MissingValue {
        /// What the name was given as (e.g. "prediction", "label", "cut edge").
        role: &'static str,
        /// The name.
        name: String,
        /// A suggestion, starting with "; " when present.
        hint: String,
    },
    /// The graph is malformed or inconsistent.
    #[error("invalid graph: {reason}")]
    InvalidGraph {
        /// What is wrong.
        reason: String,
    },
    /// A tensor has a type or shape that the operation cannot use.
    #[error("value `{name}`: {reason}")]
    BadTensor {
        /// The tensor or value.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// ONNX Runtime reported an error.
    #[error("ONNX Runtime: {context}: {source}")]
    Ort {
        /// What pipetrain was doing.
        context: String,
        /// ONNX Runtime's message.
        source: Arc<ort::Error>,
    },
    /// A session could not be placed on the device asked for (no CUDA in this build, no
    /// stream to be had).
    #[error("{device}: {reason}")]
    Device {
        /// The device (`cuda:0`).
        device: String,
        /// What failed, in words.
        reason: String,
    },
    /// The ONNX Runtime shared library could not be found or loaded.
    #[error("ONNX Runtime library not usable: {reason}")]
    RuntimeLibrary {
        /// Where it was looked for and how to install it.
        reason: String,
    },
    /// A data file (npy, npz, safetensors) is malformed or does not match what is expected.
    #[error("{path}: {what}: {reason}")]
    Data {
        /// The file.
        path: PathBuf,
        /// The array or tensor inside it (or "file").
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// A training-data shard (`.pb`, ONNX Runtime's TrainingRunner layout) is malformed
    /// or disagrees with the data set's first sample.
    #[error("{path}: sample {sample}: feature `{feature}`: {reason}")]
    BadShard {
        /// The shard file.
        path: PathBuf,
        /// The sample's index within the file (0-based).
        sample: usize,
        /// The feature's name, or `#i` (its place in the sample) when it has none yet.
        feature: String,
        /// What is wrong.
        reason: String,
    },
    /// A configuration field breaks a rule.
    #[error("{path}: field `{field}`: {rule}")]
    Config {
        /// The configuration file (or "<config>" when built in code).
        path: PathBuf,
        /// The field, dotted for nested tables.
        field: String,
        /// The rule that the value breaks.
        rule: String,
    },
    /// A checkpoint is incomplete, damaged, or does not fit the run.
    #[error("{path}: {reason}")]
    Checkpoint {
        /// The checkpoint's file (or folder) at fault.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The actor runtime stopped the run (a stage failed, or the watchdog fired).
    #[error("{source}")]
    Runtime {
        /// What the runtime reported.
        source: Arc<pipetrain_actors::ActorError>,
    },
    /// A node of a `pipetrain launch` job failed: its worker died too often, was
    /// stopped, or could not agree with the other nodes.
    #[error("node `{node}`: {reason}")]
    Launch {
        /// The node's name in the manifest.
        node: String,
        /// What happened.
        reason: String,
    },
    /// The model cannot be split across `horizontal_parallel_size` tensor shards.
    #[error("horizontal_parallel_size: node `{node}`: {rule}")]
    TensorParallel {
        /// The node (or parameter) that breaks the rule.
        node: String,
        /// The rule.
        rule: String,
    },
    /// The run is predicted to need more memory than this process may use.
    #[error("this process is predicted to need {predicted} at its peak, over its memory cap of {cap} ({from}); {fits}")]
    MemoryCap {
        /// The prediction, by part.
        predicted: String,
        /// The cap.
        cap: String,
        /// Where the cap comes from.
        from: String,
        /// Layouts that would fit, or that none does.
        fits: String,
    },
    /// A pipeline partition request cannot be met.
    #[error("cannot partition into stages: {reason}")]
    Partition {
        /// Why.
        reason: String,
    },
    /// The run was cancelled (its handle's `cancel`, or the handle dropped).
    #[error("the run was cancelled")]
    Cancelled,
    /// `pipetrain plan` could not profile, simulate or write a plan.
    #[error("plan: {what}: {reason}")]
    Plan {
        /// What it was doing (a profile run, the search, the plan file).
        what: String,
        /// Why it failed.
        reason: String,
    },
}

/// What kind of failure an [`Error`] is, for a service to act on (retry, report the
/// input, give up) without reading messages. A run's error has the same kind every time
/// the same input fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration (a file's field, or a setting made in code) breaks a rule.
    Config,
    /// The training or evaluation data: a file, a shard, or a batch a service handed in.
    Data,
    /// The ONNX model: unreadable, unsupported, or not trainable as asked.
    Model,
    /// A checkpoint to resume from, or one being written.
    Checkpoint,
    /// Computing a step: ONNX Runtime, the device, a non-finite loss, a stalled actor.
    Compute,
    /// Another process of a distributed run, or the connection to it.
    Transport,
    /// The run would not fit this process's memory cap.
    Resources,
    /// A file the run reads or writes, at the operating system's level.
    Io,
    /// The run was cancelled.
    Cancelled,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an ONNX Runtime error with what pipetrain was doing at the time.
    pub(crate) fn ort(context: impl Into<String>) -> impl FnOnce(ort::Error) -> Error {
        let context = context.into();
        move |source| Error::Ort {
            context,
            source: Arc::new(source),
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            path,
            source: Arc::new(source),
        }
    }

    /// The actor runtime's error.
    pub fn runtime(source: pipetrain_actors::ActorError) -> Error {
        Error::Runtime {
            source: Arc::new(source),
        }
    }

    /// What kind of failure this is. An error from inside the actor runtime has the kind
    /// of the pipetrain error that caused it, where one did.
    pub fn kind(&self) -> ErrorKind {
        use ErrorKind as K;
        match self {
            Error::Io { .. } => K::Io,
            Error::NotOnnx { .. }
            | Error::ExternalData { .. }
            | Error::UnsupportedOpset { .. }
            | Error::NoGradient { .. }
            | Error::UnsupportedGradient { .. }
            | Error::UnfedInputs { .. }
            | Error::MissingValue { .. }
            | Error::InvalidGraph { .. }
            | Error::TensorParallel { .. } => K::Model,
            Error::BadTensor { .. } | Error::Data { .. } | Error::BadShard { .. } => K::Data,
            Error::Ort { .. } | Error::Device { .. } | Error::RuntimeLibrary { .. } => K::Compute,
            Error::Config { .. } | Error::Partition { .. } | Error::Plan { .. } => K::Config,
            Error::Checkpoint { .. } => K::Checkpoint,
            Error::Runtime { source } => actor_kind(source),
            Error::Launch { .. } => K::Transport,
            Error::MemoryCap { .. } => K::Resources,
            Error::Cancelled => K::Cancelled,
        }
    }

    /// An invalid-graph error.
    pub(crate) fn graph(reason: impl Into<String>) -> Error {
        Error::InvalidGraph {
            reason: reason.into(),
        }
    }
}

/// The kind of an actor runtime error: its cause's, where a pipetrain error caused it.
fn actor_kind(e: &pipetrain_actors::ActorError) -> ErrorKind {
    use pipetrain_actors::ActorError as A;
    let inner =
        |source: &pipetrain_actors::BoxError| source.downcast_ref::<Error>().map(Error::kind);
    match e {
        A::Data { source, .. } => inner(source)
            .filter(|k| *k != ErrorKind::Compute)
            .unwrap_or(ErrorKind::Data),
        A::Compute { source, .. } => inner(source).unwrap_or(ErrorKind::Compute),
        A::Checkpoint { source, .. } => inner(source)
            .filter(|k| *k == ErrorKind::Io)
            .unwrap_or(ErrorKind::Checkpoint),
        A::Schedule(_) | A::Settings { .. } => ErrorKind::Config,
        A::Peer { .. } => ErrorKind::Transport,
        _ => ErrorKind::Compute,
    }
}
