//! Stopping on SIGINT or SIGTERM without losing work, as Slurm's preemption, a
//! Kubernetes pod eviction and Ctrl-C ask a job to stop.
//!
//! The first signal asks the run to stop: it finishes the steps in flight, saves a
//! checkpoint when it saves any, and ends with its summary; the process then exits with
//! `128 + signal` (130 for SIGINT, 143 for SIGTERM), the status a shell, Slurm or
//! Kubernetes reads as "stopped by that signal". A second signal exits at once: a
//! checkpoint being written stays in its temporary folder, which `--resume` never takes
//! and the next run removes. A repeat within [`REPEAT_GRACE`] of the first is the same
//! request, not a second one: a scheduler may signal every process of a job, and
//! `pipetrain launch` also hands the signal on to its worker.
//!
//! Built on `signal-hook`'s iterator: a thread of its own reads the signals, so the
//! run's tokio runtime needs no signal support, and no code runs inside a handler.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};

use crate::{Error, Result};

/// How soon after the first signal a repeat counts as the same request.
pub const REPEAT_GRACE: Duration = Duration::from_secs(1);

/// SIGINT and SIGTERM handled for as long as it lives.
pub struct StopOnSignal {
    first: Arc<AtomicI32>,
    handle: Handle,
    thread: Option<JoinHandle<()>>,
}

/// The signal's name, for messages.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

impl StopOnSignal {
    /// Handles SIGINT and SIGTERM from now on: the first calls `on_first` with its number
    /// (and says so on stderr, under `who`); a later one, past [`REPEAT_GRACE`], exits the
    /// process at once with `128 + signal`.
    ///
    /// # Errors
    /// `Io` when the handlers cannot be registered.
    pub fn install(who: &str, on_first: impl FnOnce(i32) + Send + 'static) -> Result<StopOnSignal> {
        let mut signals =
            Signals::new([SIGINT, SIGTERM]).map_err(Error::io(std::path::Path::new("signals")))?;
        let handle = signals.handle();
        let first = Arc::new(AtomicI32::new(0));
        let seen = first.clone();
        let who = who.to_string();
        let thread = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut on_first = Some(on_first);
                let mut since: Option<Instant> = None;
                for sig in signals.forever() {
                    let name = signal_name(sig);
                    match since {
                        None => {
                            since = Some(Instant::now());
                            seen.store(sig, Ordering::SeqCst);
                            eprintln!(
                                "{who}: {name}: finishing the steps in flight, then saving a checkpoint (when checkpoints_dir is set); send it again to stop at once"
                            );
                            if let Some(f) = on_first.take() {
                                f(sig);
                            }
                        }
                        Some(t) if t.elapsed() < REPEAT_GRACE => {}
                        Some(_) => {
                            eprintln!(
                                "{who}: {name} again: stopping at once (a checkpoint being written is left incomplete; --resume skips it)"
                            );
                            std::process::exit(128 + sig);
                        }
                    }
                }
            })
            .map_err(Error::io(std::path::Path::new("signals")))?;
        Ok(StopOnSignal {
            first,
            handle,
            thread: Some(thread),
        })
    }

    /// The first signal received, if any.
    pub fn received(&self) -> Option<i32> {
        match self.first.load(Ordering::SeqCst) {
            0 => None,
            sig => Some(sig),
        }
    }
}

impl Drop for StopOnSignal {
    fn drop(&mut self) {
        self.handle.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
