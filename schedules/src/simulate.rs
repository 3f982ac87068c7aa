//! A cost-model run of a schedule: every rank runs its list in order, each action starting
//! as soon as its rank is free and its inputs have arrived.
//!
//! Transfers take no rank time: sends and receives are asynchronous (PyTorch's
//! `isend`/`irecv`), and each hand-off between ranks costs `comm_latency` on the
//! dependency edge instead. A lowered schedule therefore simulates exactly like its
//! compute-only form; its transfers are not in the timeline.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::ir::{Action, ActionKind, Event};
use crate::timeline::{Span, Timeline};
use crate::{validate, Schedule, ScheduleError};

/// What each kind of compute costs on one stage, in seconds (or any one unit).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageCost {
    /// `F`.
    pub forward: f64,
    /// `B`: the full backward.
    pub backward: f64,
    /// `I`: the input-gradient half of the backward.
    pub backward_input: f64,
    /// `W`: the weight-gradient half of the backward.
    pub backward_weight: f64,
}

impl StageCost {
    /// Costs where the full backward is its two halves run back to back: `B = I + W`.
    pub fn split(forward: f64, backward_input: f64, backward_weight: f64) -> Self {
        StageCost {
            forward,
            backward: backward_input + backward_weight,
            backward_input,
            backward_weight,
        }
    }

    pub(crate) fn of(&self, kind: ActionKind) -> f64 {
        match kind {
            ActionKind::Forward => self.forward,
            ActionKind::Backward => self.backward,
            ActionKind::BackwardInput => self.backward_input,
            ActionKind::BackwardWeight => self.backward_weight,
            _ => 0.0,
        }
    }
}

/// The zero-bubble paper's unit model: `F = I = W = 1`, `B = 2`.
impl Default for StageCost {
    fn default() -> Self {
        StageCost::split(1.0, 1.0, 1.0)
    }
}

/// Costs for a whole schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// One entry per stage.
    pub stages: Vec<StageCost>,
    /// Added to every dependency between stages on different ranks.
    pub comm_latency: f64,
    /// `ALLREDUCE`, per stage.
    pub all_reduce: f64,
    /// `STEP`, per stage.
    pub optimizer_step: f64,
}

impl CostModel {
    /// The same costs on every stage, free transfers, free all-reduce and step.
    pub fn uniform(stages: usize, cost: StageCost) -> Self {
        CostModel {
            stages: vec![cost; stages],
            comm_latency: 0.0,
            all_reduce: 0.0,
            optimizer_step: 0.0,
        }
    }

    fn check(&self, stages: usize) -> Result<(), ScheduleError> {
        if self.stages.len() != stages {
            return Err(ScheduleError::CostModelStages {
                stages,
                costs: self.stages.len(),
            });
        }
        let bad = |v: f64| !v.is_finite() || v < 0.0;
        let global = [
            ("comm_latency", self.comm_latency),
            ("all_reduce", self.all_reduce),
            ("optimizer_step", self.optimizer_step),
        ];
        if let Some(&(field, value)) = global.iter().find(|(_, v)| bad(*v)) {
            return Err(ScheduleError::InvalidCost {
                stage: None,
                field,
                value,
            });
        }
        for (stage, c) in self.stages.iter().enumerate() {
            let fields = [
                ("forward", c.forward),
                ("backward", c.backward),
                ("backward_input", c.backward_input),
                ("backward_weight", c.backward_weight),
            ];
            if let Some(&(field, value)) = fields.iter().find(|(_, v)| bad(*v)) {
                return Err(ScheduleError::InvalidCost {
                    stage: Some(stage),
                    field,
                    value,
                });
            }
        }
        Ok(())
    }
}

/// Runs `schedule` under `costs` and returns when each action ran.
///
/// # Errors
/// [`ScheduleError::CostModelStages`] or [`ScheduleError::InvalidCost`] for a cost model
/// that does not fit; any error of [`validate()`], which runs first.
pub fn simulate(schedule: &Schedule, costs: &CostModel) -> Result<Timeline, ScheduleError> {
    costs.check(schedule.stages())?;
    let duration = |action: Action| match action.kind() {
        ActionKind::AllReduce => costs.all_reduce,
        ActionKind::OptimizerStep => costs.optimizer_step,
        kind => costs.stages[action.stage()].of(kind),
    };
    simulate_with(schedule, &duration, costs.comm_latency)
}

/// [`simulate`] with each action's own duration (a recorded run's, say, so that its
/// measured timeline can be compared with the ideal one of exactly its compute times)
/// and `comm_latency` added to every dependency between ranks.
///
/// # Errors
/// Any error of [`validate()`], which runs first.
pub fn simulate_with(
    schedule: &Schedule,
    duration: &dyn Fn(Action) -> f64,
    comm_latency: f64,
) -> Result<Timeline, ScheduleError> {
    validate(schedule)?;
    let lists = schedule.ranks();
    let mut at = vec![0usize; lists.len()];
    let mut free = vec![0.0f64; lists.len()];
    // When each event's result was ready, and on which rank.
    let mut ready: HashMap<Event, (f64, usize)> = HashMap::new();
    let mut spans: Vec<Vec<Span>> = lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    loop {
        let mut moved = false;
        for rank in 0..lists.len() {
            'list: while let Some(&action) = lists[rank].get(at[rank]) {
                let kind = action.kind();
                if !kind.is_transfer() {
                    let mut start = free[rank];
                    for event in action.needs(schedule.stages()) {
                        let Some(&(t, from)) = ready.get(&event) else {
                            break 'list;
                        };
                        let latency = if from == rank { 0.0 } else { comm_latency };
                        start = start.max(t + latency);
                    }
                    let end = start + duration(action);
                    free[rank] = end;
                    spans[rank].push(Span { action, start, end });
                    for event in action.produced_events() {
                        ready.insert(event, (end, rank));
                    }
                }
                at[rank] += 1;
                moved = true;
            }
        }
        if at.iter().zip(lists).all(|(&a, l)| a == l.len()) {
            break;
        }
        if !moved {
            // Unreachable after validate(), which ran the same dependencies to the end.
            return Err(crate::validate::stalled(schedule, &at));
        }
    }
    Ok(Timeline {
        stages: schedule.stages(),
        ranks: spans,
    })
}
