//! The cost model: what a layout's step takes, simulated from each node's measured
//! time. `pipetrain plan` measures the costs and searches the layouts with it; `train`
//! reads it to cut stages by time on the schedule's critical path ([`partition`]).
//!
//! - [`Profile`]: each forward node's time and each backward node's, per micro-batch,
//!   measured on one machine; [`SavedProfile`] is the same by node name, as a file.
//! - [`Family`]: the schedules whose stage actions pay alike, each calibrated on a run
//!   of its own.
//! - [`run_cuts`]: where the profile's own pipeline runs cut the model.
//! - [`split`]: which backward nodes a stage's input-gradient pass runs for given cuts.
//! - [`stages`]: a layout's per-stage costs, and cuts balanced by time, then moved to
//!   shorten the simulated step.
//! - [`simulate_candidate`]: a layout's step on this machine's shared cores, with the
//!   optimizer step and the data-parallel reduction on the timeline;
//!   [`simulate_on_nodes`] the same spread over a cluster's nodes, whose hand-offs and
//!   reductions between nodes cross a [`Link`] ([`topology`]).

mod crossing;
mod family;
mod machinery;
mod profile;
mod replicas;
mod run_cuts;
mod simulate;
pub mod split;
pub mod stages;
mod timed;
mod topology;

pub use family::{Family, PerFamily};
pub use machinery::Machinery;
pub use profile::{NamedCosts, Profile, RunCut, SavedProfile, StagePasses};
pub use run_cuts::run_cuts;
pub use simulate::{
    cut_names, node_values, simulate_candidate, simulate_on_nodes, Candidate, Cuts, Simulated,
};
pub use timed::partition;
pub use topology::{Link, Nodes, Rate};
