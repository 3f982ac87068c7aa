//! Validation catches deliberately broken schedules, names the right rank, step, stage and
//! micro-batch, and prints the grid with the offending cell marked.

use pipetrain_schedules::{
    lower, one_f_one_b, validate, zb_h1, Action, LowerOptions, Phase, Schedule, ScheduleError,
};

const MARKER: &str = "<-- ERROR HERE";

fn rebuild(s: &Schedule, ranks: Vec<Vec<Action>>) -> Schedule {
    Schedule::new(s.placement().to_vec(), s.micro_batches(), ranks).unwrap()
}

fn position(list: &[Action], text: &str) -> usize {
    let a: Action = text.parse().unwrap();
    list.iter().position(|x| *x == a).unwrap()
}

fn lowered_1f1b(p: usize, m: usize) -> Schedule {
    lower(&one_f_one_b(p, m).unwrap(), LowerOptions::default()).unwrap()
}

#[test]
fn swapped_forward_and_backward() {
    // Rank 1 of 1F1B(4, 8): 1F0 1F1 1F2 1B0 ... -> swap steps 0 and 3.
    let s = one_f_one_b(4, 8).unwrap();
    let mut ranks = s.ranks().to_vec();
    ranks[1].swap(0, 3);
    let err = validate(&rebuild(&s, ranks)).unwrap_err();
    match &err {
        ScheduleError::Dependency {
            rank,
            step,
            stage,
            micro_batch,
            action,
            needs,
            found_at,
            grid,
        } => {
            assert_eq!((*rank, *step, *stage, *micro_batch), (1, 0, 1, Some(0)));
            assert_eq!(*action, Action::backward(1, 0));
            assert_eq!(*needs, Action::forward(1, 0));
            assert_eq!(*found_at, Some(3));
            assert!(grid.contains("[1B0]"), "{grid}");
        }
        other => panic!("expected a dependency error, got {other}"),
    }
    let message = err.to_string();
    assert!(message.contains(MARKER), "{message}");
    assert!(
        message.starts_with("rank 1 step 0: 1B0 needs 1F0 earlier on rank 1"),
        "{message}"
    );
}

#[test]
fn weight_gradient_before_input_gradient() {
    let s = zb_h1(3, 4).unwrap();
    let mut ranks = s.ranks().to_vec();
    let (i, w) = (position(&ranks[0], "0I0"), position(&ranks[0], "0W0"));
    ranks[0].swap(i, w);
    match validate(&rebuild(&s, ranks)).unwrap_err() {
        ScheduleError::Dependency {
            rank: 0,
            step,
            action,
            needs,
            ..
        } => {
            assert_eq!(step, i);
            assert_eq!(action, Action::backward_weight(0, 0));
            assert_eq!(needs, Action::backward_input(0, 0));
        }
        other => panic!("expected a dependency error, got {other}"),
    }
}

#[test]
fn compute_before_its_receive() {
    let s = lowered_1f1b(4, 8);
    let mut ranks = s.ranks().to_vec();
    let (recv, f) = (position(&ranks[2], "2RECV_F0"), position(&ranks[2], "2F0"));
    ranks[2].swap(recv, f);
    match validate(&rebuild(&s, ranks)).unwrap_err() {
        ScheduleError::Dependency {
            rank: 2,
            step,
            stage: 2,
            micro_batch: Some(0),
            needs,
            found_at,
            grid,
            ..
        } => {
            assert_eq!(step, recv);
            assert_eq!(needs, Action::recv_act(2, 0));
            assert_eq!(found_at, Some(f));
            assert!(grid.contains(MARKER));
        }
        other => panic!("expected a dependency error, got {other}"),
    }
}

#[test]
fn removed_receive_leaves_its_send_unpaired() {
    let s = lowered_1f1b(4, 8);
    let mut ranks = s.ranks().to_vec();
    let recv = position(&ranks[2], "2RECV_F3");
    ranks[2].remove(recv);
    let send_step = position(&ranks[1], "1SEND_F3");
    let err = validate(&rebuild(&s, ranks)).unwrap_err();
    match &err {
        ScheduleError::Unpaired {
            rank,
            step,
            stage,
            micro_batch,
            action,
            expected,
            peer_rank,
            ..
        } => {
            assert_eq!((*rank, *step, *stage, *micro_batch), (1, send_step, 1, 3));
            assert_eq!(*action, Action::send_act(1, 3));
            assert_eq!(*expected, Action::recv_act(2, 3));
            assert_eq!(*peer_rank, 2);
        }
        other => panic!("expected an unpaired error, got {other}"),
    }
    assert!(err.to_string().contains(MARKER));
    assert!(err.to_string().contains("[1SEND_F3]"));
}

#[test]
fn crossed_send_and_receive_deadlock() {
    // Move the last rank's receive of micro-batch 1 to just before the forward that uses
    // it. Rank 2 then sends activation 1 while rank 3 sends gradient 0: each blocks on the
    // other (what Megatron avoids by fusing send_forward_recv_backward).
    let s = lowered_1f1b(4, 8);
    let mut ranks = s.ranks().to_vec();
    let at = position(&ranks[3], "3RECV_F1");
    let recv = ranks[3].remove(at);
    let f = position(&ranks[3], "3F1");
    ranks[3].insert(f, recv);
    let send_step = position(&ranks[2], "2SEND_F1");
    let err = validate(&rebuild(&s, ranks.clone())).unwrap_err();
    match &err {
        ScheduleError::Deadlock {
            rank,
            step,
            stage,
            micro_batch,
            action,
            waits,
            ..
        } => {
            assert_eq!(
                (*rank, *step, *stage, *micro_batch),
                (2, send_step, 2, Some(1))
            );
            assert_eq!(*action, Action::send_act(2, 1));
            assert!(
                waits.contains("cycle rank 2 -> rank 3 -> rank 2"),
                "{waits}"
            );
            assert!(waits.contains("rank 3 to reach 3RECV_F1"), "{waits}");
        }
        other => panic!("expected a deadlock, got {other}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("[2SEND_F1]") && message.contains("[3SEND_B0]"),
        "{message}"
    );
    assert!(message.contains(MARKER));
}

#[test]
fn missing_and_duplicated_work() {
    let s = one_f_one_b(3, 4).unwrap();
    let mut ranks = s.ranks().to_vec();
    ranks[2].retain(|a| *a != Action::backward(2, 3));
    match validate(&rebuild(&s, ranks)).unwrap_err() {
        ScheduleError::Missing {
            rank: 2,
            stage: 2,
            micro_batch: 3,
            phase: Phase::InputGrad,
            grid,
        } => assert!(grid.contains(MARKER)),
        other => panic!("expected missing work, got {other}"),
    }

    let mut ranks = s.ranks().to_vec();
    ranks[1].push(Action::backward_weight(1, 2));
    match validate(&rebuild(&s, ranks.clone())).unwrap_err() {
        ScheduleError::Duplicate {
            rank: 1,
            step,
            first,
            ..
        } => {
            assert_eq!(step, ranks[1].len() - 1);
            assert_eq!(first, Action::backward(1, 2));
        }
        other => panic!("expected duplicate work, got {other}"),
    }
}

#[test]
fn transfer_within_a_rank_is_refused() {
    // ZB-V keeps stages p - 1 and p on the last rank: a send between them is a mistake.
    let s = pipetrain_schedules::zb_v(2, 3).unwrap();
    let lowered = lower(&s, LowerOptions::default()).unwrap();
    let mut ranks = lowered.ranks().to_vec();
    let f = position(&ranks[1], "1F0");
    ranks[1].insert(f + 1, Action::send_act(1, 0));
    match validate(&rebuild(&lowered, ranks)).unwrap_err() {
        ScheduleError::BadTransfer { rank: 1, step, .. } => assert_eq!(step, f + 1),
        other => panic!("expected a bad transfer, got {other}"),
    }
}

#[test]
fn compute_only_cycle_is_a_deadlock() {
    // Rank 0 holds stages 0 and 2 and runs 2F0 before 0F0: 2F0 waits for 1F0 on rank 1,
    // which waits for 0F0 behind it. Each rank's own order is fine; together they cycle.
    let s = Schedule::new(
        vec![0, 1, 0],
        1,
        vec![
            ["2F0", "0F0", "2B0", "0B0"]
                .map(|t| t.parse().unwrap())
                .to_vec(),
            ["1F0", "1B0"].map(|t| t.parse().unwrap()).to_vec(),
        ],
    )
    .unwrap();
    let err = validate(&s).unwrap_err();
    match &err {
        ScheduleError::Deadlock {
            rank: 0,
            step: 0,
            stage: 2,
            micro_batch: Some(0),
            waits,
            ..
        } => {
            assert!(
                waits.contains("cycle rank 0 -> rank 1 -> rank 0"),
                "{waits}"
            );
            assert!(
                waits.contains("rank 0 step 0 (2F0) waits for 1F0 (rank 1 step 0)"),
                "{waits}"
            );
        }
        other => panic!("expected a deadlock, got {other}"),
    }
    assert!(err.to_string().contains("[2F0]"));
    assert!(lower(&s, LowerOptions::default()).is_err());
}
