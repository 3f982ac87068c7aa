//! Every generated schedule, over the whole grid: valid as generated, valid after
//! lowering, and its actions and the schedule itself round-trip through text and serde.

mod common;

use std::collections::HashMap;

use common::all_cases;
use pipetrain_schedules::{lower, validate, Action, ActionKind, LowerOptions, Schedule};

const FULL: LowerOptions = LowerOptions {
    all_reduce: true,
    optimizer_step: true,
};

#[test]
fn every_generated_schedule_validates_before_and_after_lowering() {
    let cases = all_cases();
    assert!(cases.len() > 1500, "only {} cases", cases.len());
    for case in &cases {
        let s = &case.schedule;
        validate(s).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert!(!s.is_lowered());
        assert_eq!(s.stages(), case.ranks * case.virtual_stages);
        assert_eq!(s.micro_batches(), case.micro_batches);
        let lowered = lower(s, FULL).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        validate(&lowered).unwrap_or_else(|e| panic!("{} lowered: {e}", case.name));
        // Lowering keeps each rank's compute order.
        assert_eq!(lowered.compute_only().ranks(), s.ranks(), "{}", case.name);
        check_transfers(&case.name, &lowered);
    }
}

/// Independent of validate(): every send has exactly one receive on the peer's rank and
/// vice versa, a transfer crosses ranks, each stage gets one ALLREDUCE and one STEP.
fn check_transfers(name: &str, s: &Schedule) {
    let mut count: HashMap<Action, usize> = HashMap::new();
    for (rank, list) in s.ranks().iter().enumerate() {
        for a in list {
            *count.entry(*a).or_default() += 1;
            if a.kind().is_transfer() {
                let peer = s.rank_of(a.peer_stage().unwrap()).unwrap();
                assert_ne!(peer, rank, "{name}: local transfer {a}");
                let other = a.matching().unwrap();
                assert!(s.ranks()[peer].contains(&other), "{name}: {a} unpaired");
            }
        }
    }
    assert!(count.values().all(|&n| n == 1), "{name}: repeated action");
    for stage in 0..s.stages() {
        assert!(count.contains_key(&Action::all_reduce(stage)), "{name}");
        assert!(count.contains_key(&Action::optimizer_step(stage)), "{name}");
    }
    let sends = count
        .keys()
        .filter(|a| matches!(a.kind(), ActionKind::SendAct | ActionKind::SendGrad))
        .count();
    let recvs = count
        .keys()
        .filter(|a| matches!(a.kind(), ActionKind::RecvAct | ActionKind::RecvGrad))
        .count();
    assert_eq!(sends, recvs, "{name}");
}

#[test]
fn every_action_round_trips_through_text() {
    let mut kinds = std::collections::HashSet::new();
    for case in all_cases() {
        let lowered = lower(&case.schedule, FULL).unwrap();
        for a in lowered.ranks().iter().flatten() {
            let text = a.to_string();
            assert_eq!(text.parse::<Action>().unwrap(), *a, "{}: {text}", case.name);
            kinds.insert(a.kind());
        }
    }
    // The grid exercises every kind, so every text form above was covered.
    assert_eq!(kinds.len(), ActionKind::ALL.len());
}

#[test]
fn schedules_round_trip_through_serde() {
    for case in all_cases().into_iter().step_by(7) {
        let lowered = lower(&case.schedule, FULL).unwrap();
        for s in [&case.schedule, &lowered] {
            let json = serde_json::to_string(s).unwrap();
            let back: Schedule = serde_json::from_str(&json).unwrap();
            assert_eq!(&back, s, "{}", case.name);
        }
    }
    let s = pipetrain_schedules::one_f_one_b(2, 1).unwrap();
    assert_eq!(
        serde_json::to_string(&s).unwrap(),
        r#"{"placement":[0,1],"micro_batches":1,"ranks":[["0F0","0B0"],["1F0","1B0"]]}"#
    );
}
