//! Telemetry: what a run reports while it trains and after. Every part writes to a file
//! or a writer the caller passes, except the terminal progress bar, which `indicatif`
//! draws on stderr when the caller says stderr is a terminal.
//!
//! # Layout
//! - `metrics`: [`MetricsWriter`] writes one [`StepMetrics`] per line (JSON Lines),
//!   flushed as it goes, for other programs to follow.
//! - `progress`: [`Progress`], an `indicatif` bar on a terminal, plain lines elsewhere;
//!   [`render`] formats one line.
//! - `svg`: [`timeline_svg`] draws a pipeline [`pipetrain_schedules::Timeline`] (simulated
//!   or traced) as a standalone SVG, with its makespan, bubble fraction and idle time.
//! - `tensorboard`: [`TensorBoardWriter`] writes scalars and histograms as a TensorBoard
//!   event file (TFRecord-framed `Event` protobufs), for TensorBoard to follow.
//! - `laps`: [`Laps`] times the phases of long work for one log line.
//! - `anon_peak`: [`AnonPeak`] samples the peak of the memory the process allocated.
//! - `chrome_trace`: [`chrome_trace()`] turns a recorded run
//!   ([`pipetrain_actors::RunTrace`]) into the Chrome trace event format, which the
//!   Perfetto UI and `chrome://tracing` open: one process per replica, one track per
//!   pipeline rank, one event per action.

mod anon_peak;
mod chrome_trace;
mod laps;
mod metrics;
#[cfg(feature = "cli")]
mod progress;
mod svg;
mod tensorboard;

pub use anon_peak::{anon_resident_bytes, AnonPeak};
pub use chrome_trace::chrome_trace;
pub use laps::{peak_resident_bytes, Laps};
pub use metrics::{MetricsWriter, StepMetrics};
#[cfg(feature = "cli")]
pub use progress::{render, Progress};
pub use svg::timeline_svg;
pub use tensorboard::{TensorBoardWriter, HISTOGRAM_BUCKETS};
