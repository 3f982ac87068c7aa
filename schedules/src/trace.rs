//! What a real run did, and whether it followed its schedule.

use serde::{Deserialize, Serialize};

use crate::ir::Action;
use crate::timeline::{Span, Timeline};
use crate::{Schedule, ScheduleError};

/// One action as the runtime ran it. Times are nanoseconds on one clock shared by all
/// ranks (e.g. since the step began); the micro-batch is the action's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceEvent {
    /// What ran.
    pub action: Action,
    /// When it started, ns.
    pub start_ns: u64,
    /// When it ended, ns.
    pub end_ns: u64,
}

impl TraceEvent {
    /// `action`, run from `start_ns` to `end_ns`.
    pub fn new(action: Action, start_ns: u64, end_ns: u64) -> TraceEvent {
        TraceEvent {
            action,
            start_ns,
            end_ns,
        }
    }
}

/// A run's record: for each rank (the actor that ran that rank's list), its events in the
/// order it ran them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    /// Events of each rank.
    pub ranks: Vec<Vec<TraceEvent>>,
}

impl Trace {
    /// The run as a [`Timeline`] in seconds from its earliest start, so that a real run can
    /// be measured like a simulated one (makespan, idle, bubble, peak in-flight).
    ///
    /// # Errors
    /// [`ScheduleError::TraceTime`] for an event that ends before it starts.
    pub fn to_timeline(&self, stages: usize) -> Result<Timeline, ScheduleError> {
        let origin = self
            .ranks
            .iter()
            .flatten()
            .map(|e| e.start_ns)
            .min()
            .unwrap_or(0);
        let seconds = |ns: u64| (ns - origin) as f64 * 1e-9;
        let mut ranks = Vec::with_capacity(self.ranks.len());
        for (rank, events) in self.ranks.iter().enumerate() {
            let mut spans = Vec::with_capacity(events.len());
            for (index, e) in events.iter().enumerate() {
                if e.end_ns < e.start_ns {
                    return Err(ScheduleError::TraceTime {
                        rank,
                        index,
                        action: e.action,
                        start_ns: e.start_ns,
                        end_ns: e.end_ns,
                    });
                }
                spans.push(Span {
                    action: e.action,
                    start: seconds(e.start_ns),
                    end: seconds(e.end_ns),
                });
            }
            ranks.push(spans);
        }
        Ok(Timeline { stages, ranks })
    }
}

/// Which actions [`first_divergence`] compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplayScope {
    /// Every action, transfers, all-reduces and steps included.
    All,
    /// Only F, B, I and W, for runtimes that do not trace their transfers.
    Compute,
}

/// Where a trace first parts from its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Divergence {
    /// The rank.
    pub rank: usize,
    /// Index among the compared actions of that rank (equal to the list index under
    /// [`ReplayScope::All`]).
    pub step: usize,
    /// What the schedule has there (`None`: the trace ran more than the schedule).
    pub expected: Option<Action>,
    /// What the trace has there (`None`: the run stopped short).
    pub found: Option<Action>,
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |a: Option<Action>| a.map_or_else(|| "nothing".to_owned(), |a| a.to_string());
        write!(
            f,
            "rank {} step {}: the schedule has {}, the trace has {}",
            self.rank,
            self.step,
            show(self.expected),
            show(self.found)
        )
    }
}

/// Compares each rank's traced action order with the schedule's, rank by rank, and returns
/// the first place they differ (`None` when the run followed the schedule exactly).
pub fn first_divergence(
    trace: &Trace,
    schedule: &Schedule,
    scope: ReplayScope,
) -> Option<Divergence> {
    let keep = |a: &Action| scope == ReplayScope::All || a.kind().is_compute();
    let ranks = trace.ranks.len().max(schedule.num_ranks());
    (0..ranks).find_map(|rank| {
        let expected = schedule.ranks().get(rank).into_iter().flatten().copied();
        let found = trace
            .ranks
            .get(rank)
            .into_iter()
            .flatten()
            .map(|e| e.action);
        first_mismatch(expected.filter(keep), found.filter(keep)).map(|(step, expected, found)| {
            Divergence {
                rank,
                step,
                expected,
                found,
            }
        })
    })
}

/// Index and contents of the first place two sequences differ, a shorter one counting as
/// `None` past its end.
fn first_mismatch(
    mut expected: impl Iterator<Item = Action>,
    mut found: impl Iterator<Item = Action>,
) -> Option<(usize, Option<Action>, Option<Action>)> {
    let mut step = 0;
    loop {
        match (expected.next(), found.next()) {
            (None, None) => return None,
            (e, f) if e == f => step += 1,
            (e, f) => return Some((step, e, f)),
        }
    }
}
