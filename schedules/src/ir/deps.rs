//! What each action needs and produces: the dependency rules shared by lowering,
//! validation and simulation.

use std::fmt;

use super::{Action, ActionKind};

/// The three parts of the work on one (stage, micro-batch): what a schedule must do
/// exactly once each. `B` does both gradient parts; `I` and `W` one each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The gradient of the stage's input (what the previous stage waits for).
    InputGrad,
    /// The gradient of the stage's weights (what the optimizer waits for).
    WeightGrad,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::InputGrad => "input gradient",
            Phase::WeightGrad => "weight gradient",
        })
    }
}

/// One part of the work: the unit that dependencies, transfers and lowering talk about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Event {
    pub(crate) phase: Phase,
    pub(crate) stage: usize,
    pub(crate) micro_batch: usize,
}

impl Action {
    /// The parts of the work this action completes.
    pub(crate) fn produces(&self) -> &'static [Phase] {
        match self.kind {
            ActionKind::Forward => &[Phase::Forward],
            ActionKind::Backward => &[Phase::InputGrad, Phase::WeightGrad],
            ActionKind::BackwardInput => &[Phase::InputGrad],
            ActionKind::BackwardWeight => &[Phase::WeightGrad],
            _ => &[],
        }
    }

    /// The events this compute action produces.
    pub(crate) fn produced_events(&self) -> impl Iterator<Item = Event> + '_ {
        let mb = self.micro_batch;
        self.produces().iter().map(move |&phase| Event {
            phase,
            stage: self.stage,
            micro_batch: mb,
        })
    }

    /// The events a compute action needs first, on a pipeline of `stages` stages: the
    /// forward of the previous stage for `F`; this stage's forward and the next stage's
    /// input gradient for `B` and `I`; this stage's input gradient for `W`.
    pub(crate) fn needs(&self, stages: usize) -> Vec<Event> {
        let mb = self.micro_batch;
        let ev = |phase, stage| Event {
            phase,
            stage,
            micro_batch: mb,
        };
        let s = self.stage;
        match self.kind {
            ActionKind::Forward if s > 0 => vec![ev(Phase::Forward, s - 1)],
            ActionKind::Backward | ActionKind::BackwardInput => {
                let mut v = vec![ev(Phase::Forward, s)];
                if s + 1 < stages {
                    v.push(ev(Phase::InputGrad, s + 1));
                }
                v
            }
            ActionKind::BackwardWeight => vec![ev(Phase::InputGrad, s)],
            _ => Vec::new(),
        }
    }

    /// For a transfer, the event whose result it carries.
    pub(crate) fn carries(&self) -> Option<Event> {
        let mb = self.micro_batch;
        let (phase, stage) = match self.kind {
            ActionKind::SendAct => (Phase::Forward, self.stage),
            ActionKind::RecvAct => (Phase::Forward, self.stage.checked_sub(1)?),
            ActionKind::SendGrad => (Phase::InputGrad, self.stage),
            ActionKind::RecvGrad => (Phase::InputGrad, self.stage.checked_add(1)?),
            _ => return None,
        };
        Some(Event {
            phase,
            stage,
            micro_batch: mb,
        })
    }
}

/// The receive, on the consuming stage, that brings `event` to a rank that needs it.
pub(crate) fn receive_for(event: Event) -> Option<Action> {
    match event.phase {
        Phase::Forward => Some(Action::recv_act(event.stage + 1, event.micro_batch)),
        Phase::InputGrad => Some(Action::recv_grad(
            event.stage.checked_sub(1)?,
            event.micro_batch,
        )),
        Phase::WeightGrad => None,
    }
}
