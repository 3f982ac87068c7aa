//! The action IR: one thing one rank does, and its compact text form.
//!
//! # Text form
//! `{stage}{KIND}{micro_batch}`, as PyTorch pipelining's `_Action` (so schedules can be
//! compared with its `_format_pipeline_order` output):
//!
//! | kind            | text        | meaning                                                     |
//! |-----------------|-------------|-------------------------------------------------------------|
//! | `Forward`       | `1F3`       | stage 1 runs forward on micro-batch 3                       |
//! | `Backward`      | `0B2`       | stage 0 runs the full backward (input and weight gradients) |
//! | `BackwardInput` | `2I0`       | stage 2 computes only the gradient of its input             |
//! | `BackwardWeight`| `2W0`       | stage 2 computes only its weight gradient                   |
//! | `SendAct`       | `1SEND_F3`  | stage 1 sends its output activation of mb 3 to stage 2      |
//! | `RecvAct`       | `2RECV_F3`  | stage 2 receives its input activation of mb 3 from stage 1  |
//! | `SendGrad`      | `1SEND_B3`  | stage 1 sends its input gradient of mb 3 to stage 0         |
//! | `RecvGrad`      | `0RECV_B3`  | stage 0 receives its output gradient of mb 3 from stage 1   |
//! | `AllReduce`     | `0ALLREDUCE`| stage 0 all-reduces its gradients across replicas           |
//! | `OptimizerStep` | `0STEP`     | stage 0 applies its optimizer step                          |
//!
//! The stage of a transfer is always the local stage (the sender's for sends, the
//! receiver's for receives), so the peer stage follows from the kind and every action
//! sits in the list of the rank that holds its stage.

mod deps;
mod text;

pub use deps::Phase;
pub(crate) use deps::{receive_for, Event};

use crate::ScheduleError;

/// What an action does.
///
/// Deliberately not `#[non_exhaustive]`: the runtime executes actions with an exhaustive
/// `match`, so that a new kind fails to compile there instead of being skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// `F`: forward pass of one micro-batch.
    Forward,
    /// `B`: full backward pass (input and weight gradients together).
    Backward,
    /// `I`: backward pass for the input gradient only (zero-bubble split backward).
    BackwardInput,
    /// `W`: backward pass for the weight gradient only (zero-bubble split backward).
    BackwardWeight,
    /// `SEND_F`: send this stage's output activation to the next stage.
    SendAct,
    /// `RECV_F`: receive this stage's input activation from the previous stage.
    RecvAct,
    /// `SEND_B`: send this stage's input gradient to the previous stage.
    SendGrad,
    /// `RECV_B`: receive this stage's output gradient from the next stage.
    RecvGrad,
    /// `ALLREDUCE`: all-reduce this stage's gradients across data-parallel replicas.
    AllReduce,
    /// `STEP`: apply the optimizer step to this stage's parameters.
    OptimizerStep,
}

impl ActionKind {
    /// Every kind, in declaration order.
    pub const ALL: [ActionKind; 10] = [
        ActionKind::Forward,
        ActionKind::Backward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::SendAct,
        ActionKind::RecvAct,
        ActionKind::SendGrad,
        ActionKind::RecvGrad,
        ActionKind::AllReduce,
        ActionKind::OptimizerStep,
    ];

    /// The kind's token in the text form (`F`, `SEND_F`, `STEP`, ...).
    pub fn token(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendAct => "SEND_F",
            ActionKind::RecvAct => "RECV_F",
            ActionKind::SendGrad => "SEND_B",
            ActionKind::RecvGrad => "RECV_B",
            ActionKind::AllReduce => "ALLREDUCE",
            ActionKind::OptimizerStep => "STEP",
        }
    }

    /// What the kind's token stands for, in words (for legends).
    pub fn meaning(self) -> &'static str {
        match self {
            ActionKind::Forward => "forward",
            ActionKind::Backward => "backward (input and weight gradients)",
            ActionKind::BackwardInput => "backward, input gradient only",
            ActionKind::BackwardWeight => "backward, weight gradient only",
            ActionKind::SendAct => "send activations to the next stage",
            ActionKind::RecvAct => "receive activations from the previous stage",
            ActionKind::SendGrad => "send gradients to the previous stage",
            ActionKind::RecvGrad => "receive gradients from the next stage",
            ActionKind::AllReduce => "reduce gradients across data-parallel replicas",
            ActionKind::OptimizerStep => "optimizer step",
        }
    }

    /// F, B, I or W: work on one micro-batch that takes compute time.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }

    /// A send or receive between stages.
    pub fn is_transfer(self) -> bool {
        matches!(
            self,
            ActionKind::SendAct | ActionKind::RecvAct | ActionKind::SendGrad | ActionKind::RecvGrad
        )
    }

    /// Whether actions of this kind name a micro-batch (all but `AllReduce` and `OptimizerStep`).
    pub fn has_micro_batch(self) -> bool {
        !matches!(self, ActionKind::AllReduce | ActionKind::OptimizerStep)
    }
}

/// One thing one rank does: a kind of work on a stage, for a micro-batch where the kind has one.
///
/// The fields are private so that an action always has a micro-batch exactly when its kind
/// needs one; build actions with the per-kind constructors or [`Action::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    stage: usize,
    kind: ActionKind,
    /// Meaningful only when `kind.has_micro_batch()`, and 0 otherwise so that derived
    /// equality and hashing stay exact. Not an `Option`: that would make an action 32
    /// bytes instead of 24, and it is copied into every error and timeline span.
    micro_batch: usize,
}

impl Action {
    /// An action of any kind.
    ///
    /// # Errors
    /// [`ScheduleError::MicroBatchMismatch`] when `micro_batch` is given for `AllReduce` or
    /// `OptimizerStep`, or missing for any other kind.
    pub fn new(
        stage: usize,
        kind: ActionKind,
        micro_batch: Option<usize>,
    ) -> Result<Self, ScheduleError> {
        if kind.has_micro_batch() != micro_batch.is_some() {
            return Err(ScheduleError::MicroBatchMismatch {
                kind,
                micro_batch_given: micro_batch.is_some(),
            });
        }
        Ok(Action {
            stage,
            kind,
            micro_batch: micro_batch.unwrap_or(0),
        })
    }

    fn with_mb(stage: usize, kind: ActionKind, micro_batch: usize) -> Self {
        Action {
            stage,
            kind,
            micro_batch,
        }
    }

    /// `{stage}F{mb}`.
    pub fn forward(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::Forward, micro_batch)
    }
    /// `{stage}B{mb}`.
    pub fn backward(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::Backward, micro_batch)
    }
    /// `{stage}I{mb}`.
    pub fn backward_input(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::BackwardInput, micro_batch)
    }
    /// `{stage}W{mb}`.
    pub fn backward_weight(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::BackwardWeight, micro_batch)
    }
    /// `{stage}SEND_F{mb}`: `stage` sends its output activation to `stage + 1`.
    pub fn send_act(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::SendAct, micro_batch)
    }
    /// `{stage}RECV_F{mb}`: `stage` receives its input activation from `stage - 1`.
    pub fn recv_act(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::RecvAct, micro_batch)
    }
    /// `{stage}SEND_B{mb}`: `stage` sends its input gradient to `stage - 1`.
    pub fn send_grad(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::SendGrad, micro_batch)
    }
    /// `{stage}RECV_B{mb}`: `stage` receives its output gradient from `stage + 1`.
    pub fn recv_grad(stage: usize, micro_batch: usize) -> Self {
        Self::with_mb(stage, ActionKind::RecvGrad, micro_batch)
    }
    /// `{stage}ALLREDUCE`.
    pub fn all_reduce(stage: usize) -> Self {
        Action {
            stage,
            kind: ActionKind::AllReduce,
            micro_batch: 0,
        }
    }
    /// `{stage}STEP`.
    pub fn optimizer_step(stage: usize) -> Self {
        Action {
            stage,
            kind: ActionKind::OptimizerStep,
            micro_batch: 0,
        }
    }

    /// The stage this action runs on (for transfers, the local end).
    pub fn stage(&self) -> usize {
        self.stage
    }
    /// What the action does.
    pub fn kind(&self) -> ActionKind {
        self.kind
    }
    /// The micro-batch, for every kind but `AllReduce` and `OptimizerStep`.
    pub fn micro_batch(&self) -> Option<usize> {
        self.kind.has_micro_batch().then_some(self.micro_batch)
    }

    /// For a transfer, the stage at the other end (`None` for other kinds, and for a
    /// receive on stage 0 or a gradient send from stage 0, which have no peer).
    pub fn peer_stage(&self) -> Option<usize> {
        match self.kind {
            ActionKind::SendAct | ActionKind::RecvGrad => self.stage.checked_add(1),
            ActionKind::RecvAct | ActionKind::SendGrad => self.stage.checked_sub(1),
            _ => None,
        }
    }

    /// For a transfer with a peer, the other half: `1SEND_F3` <-> `2RECV_F3`,
    /// `1SEND_B3` <-> `0RECV_B3`.
    pub fn matching(&self) -> Option<Action> {
        let peer = self.peer_stage()?;
        let kind = match self.kind {
            ActionKind::SendAct => ActionKind::RecvAct,
            ActionKind::RecvAct => ActionKind::SendAct,
            ActionKind::SendGrad => ActionKind::RecvGrad,
            ActionKind::RecvGrad => ActionKind::SendGrad,
            _ => return None,
        };
        Some(Action {
            stage: peer,
            kind,
            micro_batch: self.micro_batch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_match_their_peers() {
        assert_eq!(
            Action::send_act(1, 3).matching(),
            Some(Action::recv_act(2, 3))
        );
        assert_eq!(
            Action::recv_grad(0, 3).matching(),
            Some(Action::send_grad(1, 3))
        );
        assert_eq!(Action::recv_act(0, 3).matching(), None);
        assert_eq!(Action::forward(0, 3).matching(), None);
    }

    #[test]
    fn new_checks_micro_batch() {
        assert!(Action::new(0, ActionKind::Forward, None).is_err());
        assert!(Action::new(0, ActionKind::AllReduce, Some(1)).is_err());
        assert_eq!(
            Action::new(0, ActionKind::Forward, Some(1)).unwrap(),
            Action::forward(0, 1)
        );
    }
}
