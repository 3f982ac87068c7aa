//! Telemetry: metrics, progress, timeline drawings (being written).
