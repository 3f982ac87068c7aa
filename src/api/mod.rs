//! Embedding pipetrain in a service.
//!
//! # Layout
//! - [`Trainer`]: a run's configuration (a file, or a [`TrainConfig`] built in code),
//!   and optionally data the service hands in ([`Trainer::with_data`],
//!   [`Trainer::with_data_channel`]) instead of reading a file.
//! - [`RunHandle`]: what [`Trainer::start`] returns: the run's [`RunEvent`]s,
//!   [`RunHandle::checkpoint_now`], [`RunHandle::stop`] (finish, save, summary),
//!   [`RunHandle::cancel`] (at once), [`RunHandle::wait`].
//! - `seeds`: the APIs of ONNX Runtime's training documents in Rust: `TrainingRunner`
//!   (seed 000) and the on-device `CheckpointState` / `Module` / `Optimizer` loop (seed
//!   002).
//!
//! A run started here lives on the caller's tokio runtime (multi-thread: stage actors
//! compute on threads of their own and drive their futures with the runtime's handle).
//! Nothing is global: two runs in one process each have their own actors, data and
//! events.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pipetrain_actors::{RunControl, SavedCheckpoint};

use crate::checkpoint::Manifest;
use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::{BatchSource, ChannelBatches};
use crate::tensor::TensorMap;
use crate::train::{run_with, RunOptions};
use crate::{Error, Result};

pub use crate::train::{RunEvent, StepReport, TrainSummary};

mod seeds;

pub use seeds::{
    CheckpointState, LinearLrScheduler, Module, Optimizer, TrainingParameters, TrainingRunner,
};

/// Events waiting for the embedder before newer ones are dropped: a service that never
/// reads them must not stall training or grow without bound. The run's end is also
/// returned by [`RunHandle::wait`] and [`RunHandle::stop`].
const EVENT_BACKLOG: usize = 4096;

/// A run to start.
pub struct Trainer {
    cfg: TrainConfig,
    config_path: PathBuf,
    data: Option<Data>,
    eval_data: Option<Arc<dyn BatchSource>>,
    record_trace: bool,
}

/// Data handed in by the embedder.
enum Data {
    Source(Arc<dyn BatchSource>),
    /// Made into a [`ChannelBatches`] when the run's first step is known.
    Channel(flume::Receiver<TensorMap>),
}

impl Trainer {
    /// A run of `cfg` (built in code: errors name `<config>`; relative paths are relative
    /// to the working directory).
    pub fn new(cfg: TrainConfig) -> Trainer {
        Trainer {
            cfg,
            config_path: PathBuf::from("<config>"),
            data: None,
            eval_data: None,
            record_trace: false,
        }
    }

    /// A run of the configuration file at `path`.
    ///
    /// # Errors
    /// As [`TrainConfig::load`].
    pub fn from_file(path: &Path) -> Result<Trainer> {
        Ok(Trainer {
            config_path: path.to_path_buf(),
            ..Trainer::new(TrainConfig::load(path)?)
        })
    }

    /// Trains on batches from `source` instead of the configuration's data file (its
    /// `data.layout` still names nothing: the source's tensors are named by model input
    /// and label).
    pub fn with_data(mut self, source: impl BatchSource) -> Trainer {
        self.data = Some(Data::Source(Arc::new(source)));
        self
    }

    /// Trains on batches the service sends, one global batch per optimizer step, in
    /// order from the run's first step (a resumed run's checkpoint step). At most
    /// `capacity` batches wait in the channel.
    pub fn with_data_channel(mut self, capacity: usize) -> (Trainer, flume::Sender<TensorMap>) {
        let (tx, rx) = flume::bounded(capacity.max(1));
        self.data = Some(Data::Channel(rx));
        (self, tx)
    }

    /// Evaluates on `source`'s step-0 batch instead of the configuration's evaluation
    /// data.
    pub fn with_eval_data(mut self, source: impl BatchSource) -> Trainer {
        self.eval_data = Some(Arc::new(source));
        self
    }

    /// Records what every actor did (in the summary's `trace`).
    pub fn record_trace(mut self, yes: bool) -> Trainer {
        self.record_trace = yes;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// Starts the run on the current tokio runtime (which must be multi-threaded).
    ///
    /// # Errors
    /// `Checkpoint` when the checkpoint to resume cannot be read (to place a data
    /// channel's first batch); everything else arrives as [`RunEvent::Failed`] and from
    /// [`RunHandle::wait`].
    pub fn start(self, rt: &Runtime) -> Result<RunHandle> {
        let first_step = match &self.cfg.checkpoint_to_load_path {
            Some(path) => Manifest::read(path)?.steps_done,
            None => 0,
        };
        let data: Option<Arc<dyn BatchSource>> = match self.data {
            Some(Data::Source(s)) => Some(s),
            Some(Data::Channel(rx)) => Some(Arc::new(ChannelBatches::new(rx, first_step))),
            None => None,
        };
        let (event_tx, events) = flume::bounded(EVENT_BACKLOG);
        let (control, control_rx) = flume::unbounded();
        let tx = event_tx.clone();
        let rt = rt.clone();
        let (cfg, path, eval_data, record_trace) = (
            self.cfg,
            self.config_path,
            self.eval_data,
            self.record_trace,
        );
        let task = tokio::spawn(async move {
            let mut dropped = 0u64;
            let mut on_event = |e: RunEvent| {
                if tx.try_send(e).is_err() {
                    dropped += 1;
                }
            };
            let opts = RunOptions {
                record_trace,
                data,
                eval_data,
                control: Some(control_rx),
                on_event: &mut on_event,
            };
            let result = run_with(&rt, &cfg, &path, opts).await;
            if dropped > 0 {
                let _ = tx.try_send(RunEvent::Warning(format!(
                    "{dropped} events were dropped: nobody read them"
                )));
            }
            let _ = tx.try_send(match &result {
                Ok(s) => RunEvent::Finished(Box::new(s.clone())),
                Err(e) => RunEvent::Failed(e.to_string()),
            });
            result
        });
        Ok(RunHandle {
            events,
            event_tx,
            control,
            task,
        })
    }
}

/// A running run.
pub struct RunHandle {
    events: flume::Receiver<RunEvent>,
    event_tx: flume::Sender<RunEvent>,
    control: flume::Sender<RunControl>,
    task: tokio::task::JoinHandle<Result<TrainSummary>>,
}

fn run_gone() -> Error {
    Error::Runtime {
        source: Box::new(pipetrain_actors::ActorError::ActorGone {
            actor: "the run (it has ended)".into(),
        }),
    }
}

impl RunHandle {
    /// The run's events, in order (one consumer: events are not copied to several).
    pub fn events(&self) -> &flume::Receiver<RunEvent> {
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
        rx.await
            .map_err(|_| run_gone())?
            .map_err(|e| Error::Runtime {
                source: Box::new(e),
            })
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

    /// Stops at once: every actor ends, nothing more is saved. A checkpoint being written
    /// is never completed (its folder has no manifest, so no resume takes it). Returns
    /// once the run has ended; [`RunEvent::Cancelled`] is then the last event.
    ///
    /// # Cancel safety
    /// Dropping the future still ends the run; only the last event may be missing.
    pub async fn cancel(self) {
        self.task.abort();
        let _ = self.task.await;
        let _ = self.event_tx.try_send(RunEvent::Cancelled);
    }

    /// Waits for the run to end; its summary.
    ///
    /// # Errors
    /// The run's error.
    pub async fn wait(self) -> Result<TrainSummary> {
        match self.task.await {
            Ok(result) => result,
            Err(e) => Err(Error::Runtime {
                source: Box::new(pipetrain_actors::ActorError::ActorGone {
                    actor: format!("the run ({e})"),
                }),
            }),
        }
    }
}
