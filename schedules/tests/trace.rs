//! Traces: measured like simulations, compared with their schedule for replay.

use pipetrain_schedules::{
    first_divergence, lower, simulate, zb_h1, Action, CostModel, Divergence, LowerOptions,
    ReplayScope, StageCost, Trace, TraceEvent,
};

/// A trace that is exactly the simulated run (seconds -> ns).
fn trace_of(schedule: &pipetrain_schedules::Schedule, costs: &CostModel) -> Trace {
    let t = simulate(schedule, costs).unwrap();
    Trace {
        ranks: t
            .ranks
            .iter()
            .map(|spans| {
                spans
                    .iter()
                    .map(|s| TraceEvent {
                        action: s.action,
                        start_ns: (s.start * 1e9).round() as u64,
                        end_ns: (s.end * 1e9).round() as u64,
                    })
                    .collect()
            })
            .collect(),
    }
}

#[test]
fn a_faithful_trace_matches_and_measures_like_the_simulation() {
    let s = zb_h1(4, 8).unwrap();
    let costs = CostModel::uniform(4, StageCost::default());
    let trace = trace_of(&s, &costs);
    assert_eq!(first_divergence(&trace, &s, ReplayScope::All), None);
    let lowered = lower(&s, LowerOptions::default()).unwrap();
    // The simulated trace has no transfers: it matches the lowered schedule only on compute.
    assert_eq!(
        first_divergence(&trace, &lowered, ReplayScope::Compute),
        None
    );
    assert!(first_divergence(&trace, &lowered, ReplayScope::All).is_some());

    let measured = trace.to_timeline(4).unwrap();
    let simulated = simulate(&s, &costs).unwrap();
    assert!((measured.makespan() - simulated.makespan()).abs() < 1e-9);
    assert!((measured.bubble_fraction() - simulated.bubble_fraction()).abs() < 1e-9);
    assert_eq!(measured.peak_in_flight(), simulated.peak_in_flight());

    let json = serde_json::to_string(&trace).unwrap();
    assert_eq!(serde_json::from_str::<Trace>(&json).unwrap(), trace);
}

#[test]
fn reports_the_first_difference() {
    let s = zb_h1(3, 4).unwrap();
    let mut trace = trace_of(&s, &CostModel::uniform(3, StageCost::default()));
    // Rank 1 ran 1F2 before 1I0.
    let i = trace.ranks[1]
        .iter()
        .position(|e| e.action == Action::backward_input(1, 0))
        .unwrap();
    trace.ranks[1].swap(i, i + 1);
    let d = first_divergence(&trace, &s, ReplayScope::All).unwrap();
    assert_eq!(
        d,
        Divergence {
            rank: 1,
            step: i,
            expected: Some(Action::backward_input(1, 0)),
            found: Some(trace.ranks[1][i].action),
        }
    );
    assert!(d.to_string().starts_with("rank 1 step"));

    // A run that stopped short on rank 2.
    let mut short = trace_of(&s, &CostModel::uniform(3, StageCost::default()));
    let last = short.ranks[2].pop().unwrap();
    let d = first_divergence(&short, &s, ReplayScope::All).unwrap();
    assert_eq!((d.rank, d.expected, d.found), (2, Some(last.action), None));
}

#[test]
fn refuses_events_that_end_before_they_start() {
    let trace = Trace {
        ranks: vec![vec![TraceEvent {
            action: Action::forward(0, 0),
            start_ns: 10,
            end_ns: 5,
        }]],
    };
    assert!(trace.to_timeline(1).is_err());
}
