//! Embedding pipetrain in a service.
//!
//! # Layout
//! - [`Trainer`]: a run's configuration (a file, edited in code with [`Trainer::with`],
//!   or a [`TrainConfig`] built in code), and optionally data the service hands in
//!   ([`Trainer::with_data`], [`Trainer::with_data_channel`]) instead of reading a file.
//! - [`RunHandle`] (`handle`): what [`Trainer::start`] returns. It owns the run: the
//!   run's [`Events`], [`RunHandle::checkpoint_now`], [`RunHandle::stop`] (finish, save,
//!   summary), [`RunHandle::cancel`] (at once), [`RunHandle::wait`],
//!   [`RunHandle::detach`]; dropping it cancels the run.
//! - `events`: the bounded event queue that drops step events, never the end.
//! - [`BatchSender`]: the service's end of a data channel.
//! - `seeds`: the APIs of ONNX Runtime's training documents in Rust: `TrainingRunner`
//!   (seed 000) and the on-device `CheckpointState` / `Module` / `Optimizer` loop (seed
//!   002).
//!
//! A run started here lives on threads of its own (a `pt-run` thread with a tokio
//! runtime of its own, and a `pt-stage-*` thread per stage actor): nothing of it runs on
//! the caller's runtime, which may be of any flavour, and every thread, session and file
//! writer of a run ends when the run ends, however it ends. pipetrain's threads are all
//! named `pt-*`. Nothing is global: two runs in one process each have their own actors,
//! data and events.
//!
//! Errors are [`crate::Error`]s; [`crate::Error::kind`] sorts them for a service
//! ([`crate::ErrorKind`]: configuration, data, model, checkpoint, compute, transport,
//! resources, I/O, cancelled).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::checkpoint::Manifest;
use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::{BatchSource, ChannelBatches};
use crate::tensor::TensorMap;
use crate::Result;

pub use crate::train::{RunEvent, StepReport, TrainSummary};
pub use crate::{Error, ErrorKind};
pub use events::Events;
pub use handle::RunHandle;
pub use pipetrain_actors::{ActorError, BoxError, RunTrace, SavedCheckpoint};

mod events;
mod handle;
mod seeds;

pub use seeds::{
    CheckpointState, LinearLrScheduler, Module, Optimizer, TrainingParameters, TrainingRunner,
};

/// Events waiting for the embedder before the oldest step events are dropped: a service
/// that never reads them must not stall training or grow without bound. The run's end
/// always arrives, and is also returned by [`RunHandle::wait`] and [`RunHandle::stop`].
const EVENT_BACKLOG: usize = 4096;

/// A run to start.
pub struct Trainer {
    cfg: TrainConfig,
    config_path: PathBuf,
    data: Option<Data>,
    eval_data: Option<Arc<dyn BatchSource>>,
    record_trace: bool,
    event_backlog: usize,
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
            event_backlog: EVENT_BACKLOG,
        }
    }

    /// A run of the configuration file at `path` (its relative paths are relative to the
    /// file's folder, as `pipetrain train` reads it).
    ///
    /// # Errors
    /// As [`TrainConfig::load`].
    pub fn from_file(path: &Path) -> Result<Trainer> {
        Ok(Trainer {
            config_path: path.to_path_buf(),
            ..Trainer::new(TrainConfig::load(path)?)
        })
    }

    /// Edits the configuration in code (`Trainer::from_file(p)?.with(|c| c.num_train_steps
    /// = 10)`). Errors still name the file; paths set here are taken as given (a relative
    /// one is relative to the working directory). The edited configuration is checked
    /// again by [`Trainer::start`].
    pub fn with(mut self, edit: impl FnOnce(&mut TrainConfig)) -> Trainer {
        edit(&mut self.cfg);
        self
    }

    /// Trains on batches from `source` instead of the configuration's data file (its
    /// `data.layout` still names nothing: the source's tensors are named by model input
    /// and label). Each step's batch is asked for once; a source that panics fails the
    /// run with its message.
    pub fn with_data(mut self, source: impl BatchSource) -> Trainer {
        self.data = Some(Data::Source(Arc::new(source)));
        self
    }

    /// Trains on batches the service sends, one global batch per optimizer step, in
    /// order from the run's first step (a resumed run's checkpoint step). At most
    /// `capacity` batches wait in the channel. Dropping every sender before the run's last
    /// step fails the run (a data error naming the step).
    pub fn with_data_channel(mut self, capacity: usize) -> (Trainer, BatchSender) {
        let (tx, rx) = flume::bounded(capacity.max(1));
        self.data = Some(Data::Channel(rx));
        (self, BatchSender(tx))
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

    /// Events kept for a reader that falls behind (default 4096): beyond it, the oldest
    /// step and evaluation events are dropped and counted ([`RunEvent::Dropped`]); the
    /// run's end always arrives.
    pub fn event_backlog(mut self, events: usize) -> Trainer {
        self.event_backlog = events;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The file the configuration came from (`<config>` when built in code).
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Starts the run on threads of its own (see the module's documentation); callable
    /// from async code of any runtime, or from none.
    ///
    /// # Errors
    /// `Config` when an edit broke a rule of the configuration; `Checkpoint` when the
    /// checkpoint to resume cannot be read (to place a data channel's first batch);
    /// everything else arrives as [`RunEvent::Failed`] and from [`RunHandle::wait`].
    pub fn start(self, rt: &Runtime) -> Result<RunHandle> {
        self.cfg.check(&self.config_path)?;
        let first_step = match &self.cfg.checkpoint_to_load_path {
            Some(path) => Manifest::read(path)?.steps_done,
            None => 0,
        };
        let ended = Arc::new(AtomicBool::new(false));
        let data: Option<Arc<dyn BatchSource>> = match self.data {
            Some(Data::Source(s)) => Some(s),
            Some(Data::Channel(rx)) => {
                Some(Arc::new(ChannelBatches::new(rx, first_step, ended.clone())))
            }
            None => None,
        };
        let backlog = self.event_backlog;
        let launch = handle::Launch {
            cfg: self.cfg,
            config_path: self.config_path,
            data,
            eval_data: self.eval_data,
            record_trace: self.record_trace,
            rt: rt.clone(),
            ended,
            cancel: Arc::default(),
        };
        launch.start(events::queue(backlog))
    }
}

/// The service's end of a run's data channel ([`Trainer::with_data_channel`]): one
/// global batch per optimizer step, in order. Clones send into the same channel.
#[derive(Clone, Debug)]
pub struct BatchSender(flume::Sender<TensorMap>);

/// The run a batch was sent to has ended; the batch comes back.
#[derive(Debug)]
pub struct RunEnded(pub TensorMap);

impl std::fmt::Display for RunEnded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the run has ended: nobody takes batches any more")
    }
}

impl std::error::Error for RunEnded {}

impl BatchSender {
    /// Sends `batch`, waiting while the channel is full.
    ///
    /// # Errors
    /// [`RunEnded`] (with the batch) when the run has ended.
    pub async fn send(&self, batch: TensorMap) -> std::result::Result<(), RunEnded> {
        self.0
            .send_async(batch)
            .await
            .map_err(|e| RunEnded(e.into_inner()))
    }

    /// [`BatchSender::send`] for a thread that may block.
    ///
    /// # Errors
    /// As [`BatchSender::send`].
    pub fn send_blocking(&self, batch: TensorMap) -> std::result::Result<(), RunEnded> {
        self.0.send(batch).map_err(|e| RunEnded(e.into_inner()))
    }

    /// Batches waiting in the channel.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No batch is waiting.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
