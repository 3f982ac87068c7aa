//! The crate's one error type.
//!
//! Every variant has named fields so that callers (the scheduler actor, the CLI) can act on
//! the parts, and the validation variants carry the schedule grid with the offending cell
//! marked, so that the message alone is enough to see what is wrong.

use crate::ir::{Action, ActionKind, Phase};

/// Everything that can go wrong while parsing, generating, lowering, validating or
/// simulating a schedule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// Text that is not an action in the `1F3` / `1SEND_F3` / `0STEP` form.
    #[error("cannot parse {input:?} as an action: {reason}")]
    Parse {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// An action built with a micro-batch it must not have, or without one it needs.
    #[error("{kind:?} {}", if *.micro_batch_given { "takes no micro-batch" } else { "needs a micro-batch" })]
    MicroBatchMismatch {
        /// The kind of action.
        kind: ActionKind,
        /// Whether a micro-batch was given.
        micro_batch_given: bool,
    },

    /// A count that must be at least one is zero.
    #[error("{context}: `{parameter}` must be at least 1")]
    ZeroParameter {
        /// The generator or constructor that refused it.
        context: &'static str,
        /// The parameter's name.
        parameter: &'static str,
    },

    /// Interleaved schedules split the micro-batches into equal rounds (as PyTorch's
    /// `ScheduleInterleaved1F1B`): `micro_batches` must be a multiple of
    /// `rounds = max(1, micro_batches / ranks)`.
    #[error(
        "{context}: {micro_batches} micro-batches is not a multiple of the {rounds} rounds \
         (rounds = max(1, micro_batches / ranks) with {ranks} ranks)"
    )]
    MicroBatchesNotMultipleOfRounds {
        /// The generator that refused it.
        context: &'static str,
        /// Micro-batches asked for.
        micro_batches: usize,
        /// Pipeline ranks.
        ranks: usize,
        /// Rounds the micro-batches would be split into.
        rounds: usize,
    },

    /// A generator that needs more micro-batches than it was given.
    #[error("{context}: needs at least {required} micro-batches ({rule}), got {micro_batches}")]
    TooFewMicroBatches {
        /// The generator that refused it.
        context: &'static str,
        /// Micro-batches asked for.
        micro_batches: usize,
        /// The least it accepts.
        required: usize,
        /// The rule, in words.
        rule: &'static str,
    },

    /// The stage-to-rank placement names a rank that has no action list.
    #[error("stage {stage} is placed on rank {rank}, but the schedule has {ranks} ranks")]
    PlacementOutOfRange {
        /// The stage.
        stage: usize,
        /// The rank it is placed on.
        rank: usize,
        /// Ranks in the schedule.
        ranks: usize,
    },

    /// An action on a stage the schedule does not have.
    #[error("rank {rank} step {step}: {action} names stage {}, but there are {stages} stages", .action.stage())]
    StageOutOfRange {
        /// Rank whose list holds the action.
        rank: usize,
        /// Index in that list.
        step: usize,
        /// The action.
        action: Action,
        /// Stages in the schedule.
        stages: usize,
    },

    /// An action on a micro-batch the schedule does not have.
    #[error("rank {rank} step {step}: {action} names a micro-batch beyond the {micro_batches} of the schedule")]
    MicroBatchOutOfRange {
        /// Rank whose list holds the action.
        rank: usize,
        /// Index in that list.
        step: usize,
        /// The action.
        action: Action,
        /// Micro-batches in the schedule.
        micro_batches: usize,
    },

    /// An action in the list of a rank that does not hold its stage.
    #[error("rank {rank} step {step}: {action} belongs to rank {expected_rank}, which holds stage {}", .action.stage())]
    WrongRank {
        /// Rank whose list holds the action.
        rank: usize,
        /// Index in that list.
        step: usize,
        /// The action.
        action: Action,
        /// The rank the placement puts the action's stage on.
        expected_rank: usize,
    },

    /// Lowering was given a schedule that already has transfers, all-reduces or steps.
    #[error("rank {rank} step {step}: {action} is not a compute action; lower takes a compute-only schedule")]
    AlreadyLowered {
        /// Rank whose list holds the action.
        rank: usize,
        /// Index in that list.
        step: usize,
        /// The action.
        action: Action,
    },

    /// The same work is scheduled twice (this includes a `B` and an `I` or `W` for the same
    /// stage and micro-batch, which both compute the same gradient).
    #[error("rank {rank} step {step}: {action} repeats work already done by {first} at rank {first_rank} step {first_step}\n{grid}")]
    Duplicate {
        /// Rank of the repeat.
        rank: usize,
        /// Step of the repeat.
        step: usize,
        /// Stage of the repeat.
        stage: usize,
        /// Micro-batch of the repeat, if it has one.
        micro_batch: Option<usize>,
        /// The repeating action.
        action: Action,
        /// The action that did the work first.
        first: Action,
        /// Its rank.
        first_rank: usize,
        /// Its step.
        first_step: usize,
        /// The schedule grid with the repeat marked.
        grid: Box<str>,
    },

    /// Work that the schedule never does.
    #[error(
        "rank {rank} never runs the {phase} of micro-batch {micro_batch} on stage {stage}\n{grid}"
    )]
    Missing {
        /// The rank that holds the stage.
        rank: usize,
        /// The stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
        /// The missing part of the work.
        phase: Phase,
        /// The schedule grid with the rank's row marked.
        grid: Box<str>,
    },

    /// A send without its receive, or a receive without its send.
    #[error(
        "rank {rank} step {step}: {action} has no matching {expected} on rank {peer_rank}\n{grid}"
    )]
    Unpaired {
        /// Rank of the unpaired action.
        rank: usize,
        /// Its step.
        step: usize,
        /// Its stage.
        stage: usize,
        /// Its micro-batch.
        micro_batch: usize,
        /// The unpaired action.
        action: Action,
        /// The action that should pair with it.
        expected: Action,
        /// The rank that should hold `expected`.
        peer_rank: usize,
        /// The schedule grid with the action marked.
        grid: Box<str>,
    },

    /// A transfer that cannot happen: to a stage that does not exist, or between two stages
    /// on the same rank (that hand-off is local and needs no send/recv).
    #[error("rank {rank} step {step}: {action} is not a valid transfer: {reason}\n{grid}")]
    BadTransfer {
        /// Rank of the transfer.
        rank: usize,
        /// Its step.
        step: usize,
        /// Its stage.
        stage: usize,
        /// Its micro-batch.
        micro_batch: usize,
        /// The transfer.
        action: Action,
        /// Why it cannot happen.
        reason: &'static str,
        /// The schedule grid with the action marked.
        grid: Box<str>,
    },

    /// An action placed before something it needs on its own rank.
    #[error("rank {rank} step {step}: {action} needs {needs} earlier on rank {rank}, but {}\n{grid}",
        match .found_at { Some(s) => format!("it comes later, at step {s}"), None => "it is not there".to_owned() })]
    Dependency {
        /// Rank of the action.
        rank: usize,
        /// Its step.
        step: usize,
        /// Its stage.
        stage: usize,
        /// Its micro-batch, if it has one.
        micro_batch: Option<usize>,
        /// The action.
        action: Action,
        /// What it needs first (the producing action, or the receive that brings its input).
        needs: Action,
        /// Where `needs` is in this rank's list, if it is there at all.
        found_at: Option<usize>,
        /// The schedule grid with the action marked.
        grid: Box<str>,
    },

    /// Executing every rank's list in order, with every send and receive blocking until its
    /// peer arrives, reaches a point where no rank can move.
    #[error("deadlock: no rank can move; {waits}\n{grid}")]
    Deadlock {
        /// The lowest blocked rank.
        rank: usize,
        /// Its step.
        step: usize,
        /// Its stage.
        stage: usize,
        /// Its micro-batch, if the blocked action has one.
        micro_batch: Option<usize>,
        /// Its blocked action.
        action: Action,
        /// The wait cycle, then one line per blocked rank saying who it waits on.
        waits: String,
        /// The schedule grid with every blocked action marked.
        grid: Box<str>,
    },

    /// The cost model does not describe the schedule's stages.
    #[error("the cost model has costs for {costs} stages, the schedule has {stages}")]
    CostModelStages {
        /// Stages in the schedule.
        stages: usize,
        /// Stages in the cost model.
        costs: usize,
    },

    /// A cost that is negative or not finite.
    #[error("cost `{field}`{} is {value}; costs must be finite and >= 0",
        match .stage { Some(s) => format!(" of stage {s}"), None => String::new() })]
    InvalidCost {
        /// The stage, for per-stage costs.
        stage: Option<usize>,
        /// The cost's name.
        field: &'static str,
        /// Its value.
        value: f64,
    },

    /// A trace event that ends before it starts.
    #[error("trace rank {rank} event {index}: {action} ends at {end_ns} ns, before its start at {start_ns} ns")]
    TraceTime {
        /// Rank of the event.
        rank: usize,
        /// Index of the event in the rank's list.
        index: usize,
        /// The traced action.
        action: Action,
        /// Start, ns.
        start_ns: u64,
        /// End, ns.
        end_ns: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Callers wrap this error in their own and return it through `Result`s; past 128 bytes
    /// clippy's `result_large_err` fires in every one of them.
    #[test]
    fn stays_small() {
        assert!(std::mem::size_of::<ScheduleError>() <= 128);
        assert_eq!(std::mem::size_of::<Action>(), 24);
    }
}
