//! A cost-model run of a schedule on a machine whose cores the ranks share, with
//! hand-offs that cost their own time: what a planner needs to predict a step on
//! fewer cores than actors.
//!
//! [`simulate`](crate::simulate()) gives every rank a processor of its own. Here the
//! ranks' running actions share `slots` full-speed places (cores divided by each action's
//! threads) as an operating system shares cores: while `n` actions run, each progresses
//! at `min(1, slots / n)` of its speed (processor sharing). `copies` data-parallel
//! replicas run the same schedule in lock step on the same machine, so each running
//! action counts `copies` times. Actions on cores of their own still slow each other
//! (caches, memory bandwidth): `contention` per further action running.
//!
//! A hand-off between ranks ([`Hop`]) delays the value it carries by its own cost and
//! takes no rank time, as the runtime's asynchronous sends do.

use std::collections::HashMap;

use crate::ir::{Action, Event, Phase};
use crate::timeline::{Span, Timeline};
use crate::{validate, Schedule, ScheduleError};

/// A value crossing from one rank to another: `stage`'s forward output (activations,
/// `forward`), or `stage`'s input gradient going back to `stage - 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hop {
    /// The stage that produced the value.
    pub stage: usize,
    /// Activations (true) or a gradient (false).
    pub forward: bool,
    /// Whether the receiving rank sits idle when the value reaches it (had it cost
    /// nothing to wake): a runtime whose idle workers sleep pays their waking then.
    pub waiting: bool,
}

/// The machine the ranks share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    /// How many actions run at full speed at once (cores / threads per action).
    pub slots: f64,
    /// Replicas running the same schedule at once on the same cores.
    pub copies: usize,
    /// How much each further action running at once slows the others even on cores
    /// of their own (shared caches and memory bandwidth): 0.1 runs two at 1 / 1.1.
    pub contention: f64,
}

impl Machine {
    /// The speed of each of `at_once` actions running together (1: full speed): the
    /// slots shared among them, slowed by their interference.
    pub fn rate(&self, at_once: usize) -> f64 {
        let n = at_once.max(1) as f64;
        let interference = 1.0 + self.contention * (n.min(self.slots) - 1.0).max(0.0);
        (self.slots / n).min(1.0) / interference
    }
}

/// One rank's action in progress.
#[derive(Debug, Clone, Copy)]
struct Running {
    action: Action,
    start: f64,
    /// Work left, in seconds at full speed.
    left: f64,
}

/// Runs `schedule` on `machine`: each action takes `duration(action)` seconds at full
/// speed, and each hand-off between ranks `hop(...)` seconds.
///
/// # Errors
/// Any error of [`validate()`], which runs first; [`ScheduleError::InvalidCost`] for a
/// negative or non-finite duration or slot count.
pub fn simulate_on(
    schedule: &Schedule,
    duration: &dyn Fn(Action) -> f64,
    hop: &dyn Fn(Hop) -> f64,
    machine: Machine,
) -> Result<Timeline, ScheduleError> {
    validate(schedule)?;
    if !(machine.slots.is_finite() && machine.slots > 0.0) {
        return Err(ScheduleError::InvalidCost {
            stage: None,
            field: "slots",
            value: machine.slots,
        });
    }
    let lists = schedule.ranks();
    let stages = schedule.stages();
    let mut at = vec![0usize; lists.len()];
    let mut running: Vec<Option<Running>> = vec![None; lists.len()];
    let mut ready: HashMap<Event, (f64, usize)> = HashMap::new();
    let mut spans: Vec<Vec<Span>> = lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    // When each rank's last action ended.
    let mut free_since = vec![0.0f64; lists.len()];
    let mut now = 0.0f64;
    loop {
        // Start what can start now; note when the others could.
        let mut next_start = f64::INFINITY;
        for rank in 0..lists.len() {
            while running[rank].is_none() {
                let Some(&action) = lists[rank].get(at[rank]) else {
                    break;
                };
                if action.kind().is_transfer() {
                    at[rank] += 1;
                    continue;
                }
                match startable_at(action, (rank, free_since[rank]), stages, &ready, hop) {
                    Some(t) if t <= now => {
                        let left = duration(action);
                        if !(left.is_finite() && left >= 0.0) {
                            return Err(ScheduleError::InvalidCost {
                                stage: Some(action.stage()),
                                field: "duration",
                                value: left,
                            });
                        }
                        running[rank] = Some(Running {
                            action,
                            start: now,
                            left,
                        });
                        at[rank] += 1;
                    }
                    Some(t) => {
                        next_start = next_start.min(t);
                        break;
                    }
                    None => break,
                }
            }
        }
        let busy = running.iter().flatten().count();
        if busy == 0 {
            if next_start.is_finite() {
                now = next_start;
                continue;
            }
            if at.iter().zip(lists).all(|(&a, l)| a == l.len()) {
                break;
            }
            return Err(crate::validate::stalled(schedule, &at));
        }
        let rate = machine.rate(busy * machine.copies.max(1));
        let first_done = running
            .iter()
            .flatten()
            .map(|r| r.left / rate)
            .fold(f64::INFINITY, f64::min);
        let dt = first_done.min(next_start - now).max(0.0);
        now += dt;
        for (rank, slot) in running.iter_mut().enumerate() {
            let Some(r) = slot else { continue };
            r.left -= dt * rate;
            if r.left <= 1e-15 * now.max(1.0) {
                spans[rank].push(Span {
                    action: r.action,
                    start: r.start,
                    end: now,
                });
                free_since[rank] = now;
                for event in r.action.produced_events() {
                    ready.insert(event, (now, rank));
                }
                *slot = None;
            }
        }
    }
    Ok(Timeline {
        stages,
        ranks: spans,
    })
}

/// When `action` on `rank` (free since `free`) could start, once every value it needs
/// is known: the latest of their ready times plus the hand-off from another rank, which
/// knows whether the rank waits for it. `None` while one is unknown.
fn startable_at(
    action: Action,
    (rank, free): (usize, f64),
    stages: usize,
    ready: &HashMap<Event, (f64, usize)>,
    hop: &dyn Fn(Hop) -> f64,
) -> Option<f64> {
    let mut start = 0.0f64;
    for event in action.needs(stages) {
        let &(t, from) = ready.get(&event)?;
        let cost = match from == rank {
            true => 0.0,
            false => {
                let h = Hop {
                    stage: event.stage,
                    forward: event.phase == Phase::Forward,
                    waiting: false,
                };
                let busy = hop(h);
                match t + busy > free {
                    true => hop(Hop { waiting: true, ..h }),
                    false => busy,
                }
            }
        };
        start = start.max(t + cost);
    }
    Some(start)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gpipe, one_f_one_b, simulate, CostModel, StageCost};

    fn unit(a: Action) -> f64 {
        StageCost::split(1.0, 1.0, 1.0).of(a.kind())
    }

    #[test]
    fn with_a_core_per_rank_and_free_hops_it_is_the_plain_simulation() {
        let s = one_f_one_b(4, 8).unwrap();
        let plain = simulate(&s, &CostModel::uniform(4, StageCost::split(1.0, 1.0, 1.0))).unwrap();
        let machine = Machine {
            slots: 4.0,
            copies: 1,
            contention: 0.0,
        };
        let shared = simulate_on(&s, &unit, &|_| 0.0, machine).unwrap();
        assert!((plain.makespan() - shared.makespan()).abs() < 1e-9);
        assert_eq!(plain.ranks.len(), shared.ranks.len());
    }

    #[test]
    fn ranks_sharing_one_core_take_the_sum_of_their_work() {
        // Two ranks, one core: whatever the order, the core does all 2 x 4 x 3 units.
        let s = one_f_one_b(2, 4).unwrap();
        let machine = Machine {
            slots: 1.0,
            copies: 1,
            contention: 0.0,
        };
        let t = simulate_on(&s, &unit, &|_| 0.0, machine).unwrap();
        assert!((t.makespan() - 24.0).abs() < 1e-9, "{}", t.makespan());
        // Two replicas in lock step on two cores: the same.
        let machine = Machine {
            slots: 2.0,
            copies: 2,
            contention: 0.0,
        };
        let t = simulate_on(&s, &unit, &|_| 0.0, machine).unwrap();
        assert!((t.makespan() - 24.0).abs() < 1e-9, "{}", t.makespan());
        // The same with each slowing the other by a quarter: 24 units at 1 / 1.25.
        let machine = Machine {
            contention: 0.25,
            ..machine
        };
        let t = simulate_on(&s, &unit, &|_| 0.0, machine).unwrap();
        assert!((t.makespan() - 30.0).abs() < 1e-9, "{}", t.makespan());
    }

    #[test]
    fn a_hop_delays_each_crossing_by_its_cost() {
        // GPipe, two stages, one micro-batch: F0, hop, F1, B1, hop, B0.
        let s = gpipe(2, 1).unwrap();
        let machine = Machine {
            slots: 2.0,
            copies: 1,
            contention: 0.0,
        };
        let hop = |h: Hop| if h.forward { 0.25 } else { 0.5 };
        let t = simulate_on(&s, &unit, &hop, machine).unwrap();
        assert!((t.makespan() - (1.0 + 0.25 + 1.0 + 2.0 + 0.5 + 2.0)).abs() < 1e-9);
    }

    #[test]
    fn a_value_reaching_an_idle_rank_pays_its_waking() {
        // GPipe, two stages, one micro-batch: each crossing finds its rank idle.
        let s = gpipe(2, 1).unwrap();
        let machine = Machine {
            slots: 2.0,
            copies: 1,
            contention: 0.0,
        };
        let hop = |h: Hop| if h.waiting { 0.25 + 0.125 } else { 0.25 };
        let t = simulate_on(&s, &unit, &hop, machine).unwrap();
        assert!((t.makespan() - (1.0 + 0.375 + 1.0 + 2.0 + 0.375 + 2.0)).abs() < 1e-9);
        // 1F1B, two stages, eight micro-batches: stage 0's forwards run ahead, so stage 1
        // is busy when most of them reach it; a second of waking on each crossing that
        // finds its rank idle costs the step more than nothing and less than on all 16.
        let s = one_f_one_b(2, 8).unwrap();
        let waking = |extra: f64| {
            let hop = move |h: Hop| 0.25 + if h.waiting { extra } else { 0.0 };
            simulate_on(&s, &unit, &hop, machine).unwrap().makespan()
        };
        let added = waking(1.0) - waking(0.0);
        assert!(added > 0.5 && added < 15.5, "{added}");
    }
}
