//! The few TensorBoard messages an event file of scalars and histograms needs, written by
//! hand with `prost`'s derive rather than generated as `src/onnx/proto.rs` is: the
//! `tensorboard` wheel ships only compiled `_pb2.py` modules (no `.proto` files to feed a
//! generator), and these are five small messages. Field numbers and types are those of
//! `tensorboard/compat/proto/{event,summary,histogram}.proto` (proto3), read from the
//! descriptors of the `tensorboard` 2.21 package; fields pipetrain never writes (graphs,
//! images, audio, plugin metadata, ...) are left out, which protobuf readers accept.

/// `tensorboard.Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Event {
    /// Seconds since the Unix epoch when the event was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step the event belongs to.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event carries.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub(super) enum What {
    /// The first event of every file: `"brain.Event:2"`.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Tagged values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorboard.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Summary {
    /// One value per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorboard.Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Value {
    /// The series the value belongs to (`loss`, `grad_norm/stage0`, ...).
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value.
    #[prost(oneof = "Kind", tags = "2, 5")]
    pub kind: Option<Kind>,
}

/// `Summary.Value.value`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub(super) enum Kind {
    /// A scalar, as TensorBoard's scalar dashboard reads the legacy form.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// A histogram.
    #[prost(message, tag = "5")]
    Histo(HistogramProto),
}

/// `tensorboard.HistogramProto`: `bucket[i]` counts the values between `bucket_limit[i - 1]`
/// and `bucket_limit[i]` (TensorBoard starts the first bucket at `min`).
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct HistogramProto {
    /// Smallest value.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// Largest value.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// How many values.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// Their sum.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// The sum of their squares.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// Right edge of each bucket.
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// Count of each bucket.
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}
