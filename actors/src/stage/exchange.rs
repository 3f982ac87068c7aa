//! How a stage actor gets what its actions need and hands on what they make: data
//! micro-batches, activations and gradients from its peers' mailboxes (kept when they
//! come early), and sends to the neighbouring stage.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use pipetrain_schedules::{Action, ActionKind};

use super::{Flow, StageActor, Status, Transfer};
use crate::data::DataItem;
use crate::error::ActorError;
use crate::traits::{Collective, StageCompute};

/// The next message of `rx`: polled for up to `spin` first, then awaited. Waking a parked
/// thread costs 30-50 us on these machines, as much as a small stage's forward takes;
/// a stage actor with a core of its own loses nothing by polling meanwhile.
pub(super) async fn recv_spinning<T>(
    rx: &flume::Receiver<T>,
    spin: std::time::Duration,
) -> Result<T, flume::RecvError> {
    if !spin.is_zero() {
        let until = std::time::Instant::now() + spin;
        loop {
            match rx.try_recv() {
                Ok(v) => return Ok(v),
                Err(flume::TryRecvError::Disconnected) => {
                    return Err(flume::RecvError::Disconnected)
                }
                // Yielding, not spinning hard: the runtime's worker (scheduler, coordinator,
                // data) shares these cores and must not wait for a time slice to end.
                Err(flume::TryRecvError::Empty) if std::time::Instant::now() < until => {
                    std::thread::yield_now()
                }
                Err(flume::TryRecvError::Empty) => break,
            }
        }
    }
    rx.recv_async().await
}

impl<C: StageCompute, K: Collective> StageActor<C, K> {
    /// The activations stage `s` reads for micro-batch `mb`: none on the first stage, the
    /// previous stage's output when it is on this rank, else what arrives from its rank.
    pub(super) async fn forward_input(
        &mut self,
        s: usize,
        mb: usize,
        outgoing: &mut HashMap<(Flow, usize, usize), C::Payload>,
        arrived: &mut HashMap<(Flow, usize, usize), C::Payload>,
    ) -> Result<Option<C::Payload>, ActorError> {
        if s == 0 {
            return Ok(None);
        }
        if let Some(local) = outgoing.remove(&(Flow::Act, s - 1, mb)) {
            return Ok(Some(local));
        }
        self.receive(Action::recv_act(s, mb), arrived)
            .await
            .map(Some)
    }

    /// Sends what `action` (a SendAct or SendGrad) names to the neighbouring stage.
    pub(super) async fn send(
        &mut self,
        action: Action,
        payload: C::Payload,
    ) -> Result<(), ActorError> {
        let s = action.stage();
        let (flow, to) = if action.kind() == ActionKind::SendAct {
            (Flow::Act, s + 1)
        } else {
            (Flow::Grad, s.wrapping_sub(1))
        };
        let peer = self
            .placement
            .get(to)
            .copied()
            .ok_or_else(|| self.protocol(format!("{action}: no stage {to}")))?;
        self.set(Status::Waiting {
            action,
            from: format!(
                "room in rank {peer}'s mailbox{}",
                self.places.member(self.replica, peer)
            ),
        });
        self.peers[peer]
            .send_async(Transfer {
                flow,
                stage: to,
                mb: action.micro_batch().unwrap_or(0),
                payload,
            })
            .await
            .map_err(|_| ActorError::ActorGone {
                actor: format!("{} rank {peer}", self.places.name(self.replica)),
            })
    }

    /// The next micro-batch of data for `stage`: from the step's batch already received,
    /// else from the data actor (one message a step).
    pub(super) async fn next_data(
        &mut self,
        stage: usize,
        step: u64,
        action: Action,
    ) -> Result<DataItem<C::Payload>, ActorError> {
        if let Some(item) = self.data_ahead.get_mut(&stage).and_then(|q| q.pop_front()) {
            return Ok(item);
        }
        self.set(Status::Waiting {
            action,
            from: "its data".into(),
        });
        let gone = || ActorError::ActorGone {
            actor: format!(
                "data actor of {} stage {stage}",
                self.places.name(self.replica)
            ),
        };
        let rx = self.data.get(&stage).ok_or_else(gone)?;
        let batch = recv_spinning(rx, self.spin).await.map_err(|_| gone())?;
        self.set(Status::Running(action));
        let mut items: std::collections::VecDeque<_> = batch.into();
        let first = items
            .pop_front()
            .ok_or_else(|| self.protocol(format!("empty data for step {step}")))?;
        self.data_ahead.insert(stage, items);
        Ok(first)
    }

    /// Waits until the transfer `recv` names has arrived and takes it; transfers for
    /// later actions that arrive meanwhile are kept.
    pub(super) async fn receive(
        &mut self,
        recv: Action,
        arrived: &mut HashMap<(Flow, usize, usize), C::Payload>,
    ) -> Result<C::Payload, ActorError> {
        let s = recv.stage();
        let mb = recv.micro_batch().unwrap_or(0);
        let (flow, from) = if recv.kind() == ActionKind::RecvAct {
            (Flow::Act, s.wrapping_sub(1))
        } else {
            (Flow::Grad, s + 1)
        };
        if let Some(p) = arrived.remove(&(flow, s, mb)) {
            return Ok(p);
        }
        let rank = self.placement.get(from).copied().unwrap_or(usize::MAX);
        self.set(Status::Waiting {
            action: recv,
            from: format!("stage {from}{}", self.places.member(self.replica, rank)),
        });
        loop {
            let t =
                recv_spinning(&self.inbox, self.spin)
                    .await
                    .map_err(|_| ActorError::ActorGone {
                        actor: format!(
                            "every peer of {} rank {}",
                            self.places.name(self.replica),
                            self.rank
                        ),
                    })?;
            if (t.flow, t.stage, t.mb) == (flow, s, mb) {
                self.progress.fetch_add(1, Ordering::Relaxed);
                return Ok(t.payload);
            }
            let key = (t.flow, t.stage, t.mb);
            if arrived.insert(key, t.payload).is_some() {
                return Err(self.protocol(format!(
                    "{:?} for stage {} mb {} arrived twice",
                    key.0, key.1, key.2
                )));
            }
        }
    }
}
