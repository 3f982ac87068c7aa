//! A started run: the thread it lives on, and the handle that owns it.
//!
//! Each run has a thread of its own (`pt-run`) with its own tokio runtime
//! (`pt-worker`s), so graph building, session creation and every ONNX Runtime call stay
//! off the embedder's runtime, and [`RunHandle`]'s methods work from any runtime (or,
//! through their blocking forms, none). When the run ends, however it ends, its
//! runtime shuts down: stage actors, data readers and checkpoint writers all end before
//! the end is reported.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::{RunControl, SavedCheckpoint};
use tokio::sync::watch;

use super::events::{EventSink, Events};
use super::RunEvent;
use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::BatchSource;
use crate::train::{run_with, RunOptions, TrainSummary};
use crate::{Error, Result};

/// How long a run that ends waits for its checkpoint writers and data readers.
const WRITER_GRACE: Duration = Duration::from_secs(120);

/// What the handle wants of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Intent {
    Run,
    Cancel,
    Detach,
}

/// Everything the run's thread needs.
pub(super) struct Launch {
    pub cfg: TrainConfig,
    pub config_path: PathBuf,
    pub data: Option<Arc<dyn BatchSource>>,
    pub eval_data: Option<Arc<dyn BatchSource>>,
    pub record_trace: bool,
    pub rt: Runtime,
    /// Set when the run ends: readers of a fed channel stop waiting.
    pub ended: Arc<AtomicBool>,
    /// Set by the handle to cancel: looked at between the phases of the run's start.
    pub cancel: Arc<AtomicBool>,
}

/// A running run. It owns the run: dropping the handle cancels it (as
/// [`RunHandle::cancel`], without waiting), unless [`RunHandle::detach`] let it go.
pub struct RunHandle {
    events: Events,
    cancel: Arc<AtomicBool>,
    control: flume::Sender<RunControl>,
    intent: watch::Sender<Intent>,
    done: flume::Receiver<Result<TrainSummary>>,
}

impl Launch {
    /// Starts the run's thread; its handle.
    pub(super) fn start(self, events: (EventSink, Events)) -> Result<RunHandle> {
        let (control, control_rx) = flume::unbounded();
        let (intent, intent_rx) = watch::channel(Intent::Run);
        let (done_tx, done) = flume::bounded(1);
        let (sink, events) = events;
        let cancel = self.cancel.clone();
        settle_allocator();
        std::thread::Builder::new()
            .name("pt-run".into())
            .spawn(move || {
                let run = || self.run(&sink, control_rx, intent_rx);
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                    .unwrap_or_else(|p| {
                        Err(Error::runtime(pipetrain_actors::ActorError::ActorGone {
                            actor: format!(
                                "the run (it panicked: {})",
                                pipetrain_actors::panic_text(&*p)
                            ),
                        }))
                    });
                sink.end(match &result {
                    Ok(s) => RunEvent::Finished(Box::new(s.clone())),
                    Err(Error::Cancelled) => RunEvent::Cancelled,
                    Err(e) => RunEvent::Failed(e.clone()),
                });
                let _ = done_tx.send(result);
            })
            .map_err(Error::io("<the run's thread>"))?;
        Ok(RunHandle {
            events,
            cancel,
            control,
            intent,
            done,
        })
    }

    /// The run, on this thread, until it ends or is cancelled; then its runtime shuts
    /// down and an unfinished checkpoint folder goes.
    fn run(
        self,
        sink: &EventSink,
        control: flume::Receiver<RunControl>,
        mut intent: watch::Receiver<Intent>,
    ) -> Result<TrainSummary> {
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("pt-worker")
            .enable_all()
            .build()
            .map_err(Error::io("<the run's tokio runtime>"))?;
        let checkpoints = self.cfg.checkpoints_dir.clone();
        let ended = self.ended.clone();
        let result = tokio_rt.block_on(async {
            let mut on_event = |e: RunEvent| sink.push(e);
            let opts = RunOptions {
                record_trace: self.record_trace,
                data: self.data,
                eval_data: self.eval_data,
                control: Some(control),
                on_event: &mut on_event,
                cancel: Some(self.cancel.clone()),
            };
            tokio::select! {
                biased;
                () = cancelled(&mut intent) => Err(Error::Cancelled),
                r = run_with(&self.rt, &self.cfg, &self.config_path, opts) => r,
            }
        });
        ended.store(true, Ordering::Relaxed);
        tokio_rt.shutdown_timeout(WRITER_GRACE);
        crate::train::release_freed_memory();
        if result.is_err() {
            if let Some(dir) = checkpoints {
                if let Err(e) = crate::checkpoint::remove_unfinished(&dir) {
                    tracing::warn!("{e}");
                }
            }
        }
        result
    }
}

/// Keeps glibc's threshold for serving large blocks by `mmap` at its 128 KiB default,
/// once per process, unless the environment sets malloc's thresholds itself.
///
/// glibc raises the threshold each time a large `mmap`ed block is freed (up to 32 MiB),
/// and with it how much free memory a thread's arena keeps at its top (twice that),
/// which `malloc_trim` does not return. A run's threads each take an arena, so a service
/// starting run after run kept growing: 100 small cancelled runs took it from 46 to
/// 135 MB resident, against 46 to 48 MB with the threshold kept. The cost is a page fault
/// per fresh page of large blocks: 3-4% of the steps of a tiny GPT-2 (`gpt2_tiny.toml`),
/// nothing measurable where products dominate.
fn settle_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let set = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"];
            if set.iter().all(|v| std::env::var_os(v).is_none()) {
                // SAFETY: mallopt changes a setting of the allocator, which is thread-safe.
                unsafe {
                    libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
                }
            }
        });
    }
}

/// Returns when the handle cancels the run or is dropped without detaching it.
async fn cancelled(intent: &mut watch::Receiver<Intent>) {
    loop {
        let now = *intent.borrow_and_update();
        match now {
            Intent::Cancel => return,
            Intent::Detach => std::future::pending::<()>().await,
            Intent::Run => {}
        }
        if intent.changed().await.is_err() {
            // The handle is gone: what it said last stands.
            if *intent.borrow() != Intent::Detach {
                return;
            }
            std::future::pending::<()>().await;
        }
    }
}

fn run_gone() -> Error {
    Error::runtime(pipetrain_actors::ActorError::ActorGone {
        actor: "the run (it has ended)".into(),
    })
}

impl RunHandle {
    /// The run's events, in order (clones share one queue: each event is read once).
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// Saves a checkpoint after the step in progress (or the next one, which may already
    /// be under way) and returns it once it is complete on disk.
    ///
    /// # Errors
    /// `Runtime` when the run saves no checkpoints (no `checkpoints_dir`), has ended, or
    /// the checkpoint could not be written.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the request in place: the checkpoint is still saved.
    pub async fn checkpoint_now(&self) -> Result<SavedCheckpoint> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.control
            .send_async(RunControl::CheckpointNow(reply))
            .await
            .map_err(|_| run_gone())?;
        rx.await.map_err(|_| run_gone())?.map_err(Error::runtime)
    }

    /// Finishes the steps under way, saves a checkpoint (when the run saves any) and
    /// returns the run's summary.
    ///
    /// # Errors
    /// The run's error, if it failed before it could stop.
    pub async fn stop(self) -> Result<TrainSummary> {
        let _ = self.control.send_async(RunControl::Stop).await;
        self.wait().await
    }

    /// Stops at once: every actor ends and nothing more is saved. Returns once the run's
    /// threads, sessions and checkpoint writers have ended and a checkpoint folder left
    /// unfinished is removed; [`RunEvent::Cancelled`] is then the last event (unless the
    /// run had already ended otherwise).
    pub async fn cancel(self) {
        self.cancel_now();
        let _ = self.done.recv_async().await;
    }

    /// [`RunHandle::cancel`] for a thread that may block.
    pub fn cancel_blocking(self) {
        self.cancel_now();
        let _ = self.done.recv();
    }

    /// Waits for the run to end; its summary.
    ///
    /// # Errors
    /// The run's error ([`Error::Cancelled`] when it was cancelled).
    pub async fn wait(self) -> Result<TrainSummary> {
        self.done
            .recv_async()
            .await
            .unwrap_or(Err(Error::Cancelled))
    }

    /// [`RunHandle::wait`] for a thread that may block (not a runtime's worker).
    ///
    /// # Errors
    /// As [`RunHandle::wait`].
    pub fn wait_blocking(self) -> Result<TrainSummary> {
        self.done.recv().unwrap_or(Err(Error::Cancelled))
    }

    /// Lets the run go on without this handle: it then trains to its end (or its own
    /// failure), and nobody can stop it but the process's exit. Its events still queue
    /// (the last ones kept).
    pub fn detach(self) {
        self.intent.send_replace(Intent::Detach);
    }

    /// The run has ended (its result is waiting for [`RunHandle::wait`]).
    pub fn is_finished(&self) -> bool {
        !self.done.is_empty() || self.done.is_disconnected()
    }
}

impl RunHandle {
    fn cancel_now(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        self.intent.send_replace(Intent::Cancel);
    }
}

impl Drop for RunHandle {
    fn drop(&mut self) {
        if *self.intent.borrow() == Intent::Run {
            self.cancel_now();
        }
    }
}

impl std::fmt::Debug for RunHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHandle")
            .field("events", &self.events)
            .field("finished", &self.is_finished())
            .finish()
    }
}
