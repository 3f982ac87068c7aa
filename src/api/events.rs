//! A run's events on their way to the embedder: a bounded queue that never loses the end.
//!
//! A service that reads events late (or never) must neither stall training nor grow
//! without bound, and must still learn how the run ended. So the queue holds at most its
//! capacity: when full, the oldest step and evaluation event is dropped (and counted);
//! the run's end, [`RunEvent::Dropped`] with the count before it, always goes in. Written
//! here rather than with a channel crate: none drops oldest-first by kind.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tokio::sync::Notify;

use super::RunEvent;

/// The run's events, in order: [`RunEvent::Started`], steps and evaluations, checkpoints,
/// warnings, and last exactly one of [`RunEvent::Finished`], [`RunEvent::Failed`] or
/// [`RunEvent::Cancelled`] (after [`RunEvent::Dropped`] where events were dropped).
/// Clones read the same queue: each event goes to one reader.
#[derive(Clone)]
pub struct Events {
    shared: Arc<Shared>,
}

/// The run's side of the queue.
pub(super) struct EventSink {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes async readers.
    notify: Notify,
    /// Wakes blocking readers.
    ready: Condvar,
}

struct State {
    queue: VecDeque<RunEvent>,
    capacity: usize,
    dropped: u64,
    ended: bool,
}

/// A queue of `capacity` events (at least 1) beyond the end.
pub(super) fn queue(capacity: usize) -> (EventSink, Events) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
            ended: false,
        }),
        notify: Notify::new(),
        ready: Condvar::new(),
    });
    (
        EventSink {
            shared: shared.clone(),
        },
        Events { shared },
    )
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self) {
        self.notify.notify_waiters();
        self.ready.notify_all();
    }
}

/// Events a full queue may drop: per-step news, superseded by the next.
fn droppable(e: &RunEvent) -> bool {
    matches!(e, RunEvent::Step(_) | RunEvent::Evaluation { .. })
}

impl EventSink {
    /// Adds `event`; when the queue is full, the oldest droppable event goes (the oldest
    /// of any kind, where none is droppable).
    pub(super) fn push(&self, event: RunEvent) {
        let mut s = self.shared.lock();
        if s.ended {
            return;
        }
        if s.queue.len() >= s.capacity {
            let oldest = s.queue.iter().position(droppable).unwrap_or(0);
            s.queue.remove(oldest);
            s.dropped += 1;
        }
        s.queue.push_back(event);
        drop(s);
        self.shared.wake();
    }

    /// Adds the run's last event (beyond the capacity), after the count of dropped
    /// events where there were any; nothing is added after it.
    pub(super) fn end(&self, last: RunEvent) {
        let mut s = self.shared.lock();
        if s.ended {
            return;
        }
        if s.dropped > 0 {
            let events = s.dropped;
            s.queue.push_back(RunEvent::Dropped { events });
        }
        s.queue.push_back(last);
        s.ended = true;
        drop(s);
        self.shared.wake();
    }
}

impl Events {
    /// The next event, waiting for it; `None` once the last event has been read.
    pub async fn recv(&self) -> Option<RunEvent> {
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.next() {
                Ok(got) => return got,
                Err(()) => notified.await,
            }
        }
    }

    /// The next event if one is waiting (`None` when none is, or the run's events are
    /// all read: see [`Events::is_finished`]).
    pub fn try_recv(&self) -> Option<RunEvent> {
        self.next().ok().flatten()
    }

    /// [`Events::recv`] for a thread that may block (not a runtime's worker).
    pub fn recv_blocking(&self) -> Option<RunEvent> {
        let mut s = self.shared.lock();
        loop {
            if let Some(e) = s.queue.pop_front() {
                return Some(e);
            }
            if s.ended {
                return None;
            }
            s = self.shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The events waiting now, without waiting for more.
    pub fn drain(&self) -> impl Iterator<Item = RunEvent> + '_ {
        std::iter::from_fn(|| self.try_recv())
    }

    /// Events dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }

    /// The run has ended and its last event has been read.
    pub fn is_finished(&self) -> bool {
        let s = self.shared.lock();
        s.ended && s.queue.is_empty()
    }

    /// `Ok(Some)`: an event; `Ok(None)`: all read; `Err`: none yet.
    fn next(&self) -> Result<Option<RunEvent>, ()> {
        let mut s = self.shared.lock();
        match s.queue.pop_front() {
            Some(e) => Ok(Some(e)),
            None if s.ended => Ok(None),
            None => Err(()),
        }
    }
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.lock();
        f.debug_struct("Events")
            .field("waiting", &s.queue.len())
            .field("dropped", &s.dropped)
            .field("ended", &s.ended)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(i: u64) -> RunEvent {
        RunEvent::Warning(format!("w{i}"))
    }

    #[test]
    fn a_full_queue_drops_the_oldest_step_event_and_keeps_the_end() {
        let (sink, events) = queue(3);
        sink.push(RunEvent::Started {
            first_step: 0,
            total_steps: 9,
            stages: 1,
            replicas: 1,
        });
        for i in 0..5 {
            sink.push(RunEvent::Evaluation {
                step: i,
                loss: i as f64,
                accuracy: None,
            });
        }
        sink.push(step(7));
        sink.end(RunEvent::Cancelled);
        let got: Vec<RunEvent> = std::iter::from_fn(|| events.try_recv()).collect();
        assert_eq!(events.dropped(), 4);
        assert!(matches!(got[0], RunEvent::Started { .. }), "{got:?}");
        assert!(
            matches!(got[1], RunEvent::Evaluation { step: 4, .. }),
            "{got:?}"
        );
        assert!(
            matches!(&got[2], RunEvent::Warning(w) if w == "w7"),
            "{got:?}"
        );
        assert!(matches!(got[3], RunEvent::Dropped { events: 4 }), "{got:?}");
        assert!(matches!(got[4], RunEvent::Cancelled), "{got:?}");
        assert_eq!(got.len(), 5);
        assert!(events.is_finished());
        assert!(events.recv_blocking().is_none());
    }

    #[test]
    fn nothing_goes_in_after_the_end() {
        let (sink, events) = queue(8);
        sink.end(RunEvent::Cancelled);
        sink.push(step(1));
        sink.end(RunEvent::Cancelled);
        assert!(matches!(events.try_recv(), Some(RunEvent::Cancelled)));
        assert!(events.try_recv().is_none());
    }

    #[test]
    fn an_async_reader_wakes_for_an_event_pushed_later() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let (sink, events) = queue(8);
        let pusher = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            sink.push(step(1));
            sink.end(RunEvent::Cancelled);
        });
        let got = rt.block_on(async {
            let mut got = Vec::new();
            while let Some(e) = events.recv().await {
                got.push(e);
            }
            got
        });
        pusher.join().unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
    }
}
