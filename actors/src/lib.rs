//! pipetrain's actor runtime.
//!
//! # Layout
//! Not built yet: the stage, scheduler, coordinator and data actors arrive with the
//! runtime issue. The crate exists now so that the workspace has its final shape and
//! the dependency direction `pipetrain -> pipetrain-actors -> pipetrain-schedules` holds.
#![deny(missing_docs)]

pub use pipetrain_schedules as schedules;
