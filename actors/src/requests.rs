//! What an embedder asks of a running run ([`RunControl`]), and how the scheduler fits
//! each request into its rounds: a checkpoint right after the step in progress, or a
//! stop after it (with a checkpoint). In a run shared by processes a stop is only noted
//! here, and every process stops after the step whose end carries it.

use std::collections::HashMap;

use tokio::sync::oneshot;

use crate::checkpoint::SavedCheckpoint;
use crate::error::ActorError;
use crate::scheduler::{Round, SchedulerActor};

/// What an embedder can ask of a running run (see `EngineSettings::control`).
#[derive(Debug)]
pub enum RunControl {
    /// Save a checkpoint after the step in progress, or after the next one when it is
    /// already handed out (the scheduler keeps one round ahead); the reply comes once it
    /// is complete (or with the error that stopped it).
    CheckpointNow(oneshot::Sender<Result<SavedCheckpoint, ActorError>>),
    /// Finish the steps handed out (the one in progress, perhaps the next), save a
    /// checkpoint (when the run saves any), and end the run normally.
    Stop,
}

/// A checkpoint round and who waits for it to complete.
pub(crate) type SaveWaiter = Option<oneshot::Sender<Result<SavedCheckpoint, ActorError>>>;

impl<P: Send + 'static> SchedulerActor<P> {
    /// Takes the embedder's requests that arrived while round `current` ran: a
    /// checkpoint goes right after it (after its step, for an evaluation or a save); a
    /// stop drops every later round but a checkpoint. Rounds up to `current + 1` may
    /// already be handed out, so changes start after them. In a shared run a stop is
    /// only noted (`true`): the step's end tells every process.
    pub(crate) fn take_requests(
        &self,
        rounds: &mut Vec<Round>,
        current: usize,
        waiters: &mut HashMap<usize, SaveWaiter>,
    ) -> bool {
        let Some(control) = &self.control else {
            return false;
        };
        let mut stop_asked = false;
        // The round after `current` is handed out next, in this same iteration: requests
        // change what follows it.
        let at = current + 2;
        while let Ok(request) = control.try_recv() {
            let done_step = rounds[..at.min(rounds.len())]
                .iter()
                .rev()
                .find_map(|r| match r {
                    Round::Train(s) => Some(*s),
                    _ => None,
                });
            match request {
                RunControl::CheckpointNow(reply) => {
                    let (Some(step), true) = (done_step, self.checkpoint.is_some()) else {
                        let _ = reply.send(Err(ActorError::Settings {
                            reason: "the run saves no checkpoints (no checkpoints folder)".into(),
                        }));
                        continue;
                    };
                    let pos = at.min(rounds.len());
                    rounds.insert(pos, Round::Save(step));
                    // Positions of later waiters move by one.
                    let moved: HashMap<usize, SaveWaiter> = waiters
                        .drain()
                        .map(|(k, v)| (if k >= pos { k + 1 } else { k }, v))
                        .collect();
                    *waiters = moved;
                    waiters.insert(pos, Some(reply));
                }
                RunControl::Stop if self.shared_stop => stop_asked = true,
                RunControl::Stop => self.stop_after(rounds, at, waiters),
            }
        }
        stop_asked
    }

    /// Keeps the first `keep` rounds (those handed out) and a checkpoint of the last step
    /// among them (when the run saves any and it is not saved already).
    pub(crate) fn stop_after(
        &self,
        rounds: &mut Vec<Round>,
        keep: usize,
        waiters: &mut HashMap<usize, SaveWaiter>,
    ) {
        rounds.truncate(keep.min(rounds.len()));
        let done_step = rounds.iter().rev().find_map(|r| match r {
            Round::Train(s) => Some(*s),
            _ => None,
        });
        let saved_last = matches!(rounds.last(), Some(Round::Save(s)) if Some(*s) == done_step);
        if let (Some(step), true, false) = (done_step, self.checkpoint.is_some(), saved_last) {
            rounds.push(Round::Save(step));
        }
        waiters.retain(|&k, _| k < rounds.len());
    }
}
