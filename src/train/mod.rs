//! A training run on the actor runtime: the configuration's model, cut into stages, one
//! [`crate::pipeline::OrtStage`] per (stage, replica), fed by
//! [`crate::pipeline::StepData`] and driven by `pipetrain_actors::run` under the
//! configured pipeline schedule (`run`, `engine`); resumed from a checkpoint and saving
//! checkpoints (`checkpointing`); its events ([`RunEvent`]) for the binary and embedders.
//! Before its sessions open, a run predicts its process's peak memory (`peak`, `memory`)
//! and checks it against the process's memory cap (`cap`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::{Collective, RunControl, RunTrace, SavedCheckpoint};

use crate::compute::Runtime;
use crate::config::TrainConfig;
use crate::data::BatchSource;
use crate::onnx::proto::ModelProto;
use crate::onnx::write_atomically;
use crate::tensor::Tensor;
use crate::{Error, Result};

mod board;
mod cap;
mod check;
mod checkpointing;
mod cluster;
#[cfg(feature = "cli")]
mod command;
mod data_rules;
mod engine;
mod memory;
pub(crate) mod peak;
mod phases;
mod replica_links;
#[cfg(feature = "cli")]
mod report;
mod run;
mod settings;
#[cfg(feature = "cli")]
mod signals;

#[cfg(feature = "cluster")]
pub(crate) use cap::memory_cap;
pub(crate) use cap::resident_now;
pub use check::{check_model, CheckReport};
pub use checkpointing::{claim_checkpoints_dir, latest_checkpoint};
pub use cluster::ClusterPart;
#[cfg(feature = "cli")]
pub use command::{train_command, EarlierRun};
pub(crate) use memory::{graph_of, rank_bytes};
pub use memory::{memory_report, memory_table, MemoryRow, StashPeak};
pub(crate) use phases::release_freed_memory;
#[cfg(feature = "cli")]
pub use report::Reporter;
#[cfg(feature = "cli")]
pub use signals::{signal_name, StopOnSignal, REPEAT_GRACE};

/// What one optimizer step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Step index (from 0).
    pub step: u64,
    /// Mean loss of the step's global batch, before the update.
    pub loss: f64,
    /// The learning rate of the step.
    pub lr: f64,
    /// Mean loss on the evaluation set after the step, when one was run.
    pub eval_loss: Option<f64>,
    /// Accuracy on the evaluation set (classification losses), when one was run.
    pub eval_accuracy: Option<f64>,
    /// Global L2 norm of the gradients (unscaled, before clipping).
    pub grad_norm: f64,
    /// The clip coefficient, when `max_grad_norm` is set.
    pub clip_coef: Option<f64>,
    /// The loss scale the step used.
    pub loss_scale: f64,
    /// The update was skipped (a gradient overflowed under dynamic loss scaling).
    pub skipped: bool,
    /// Checkpoints completed since the previous report.
    pub saved: Vec<SavedCheckpoint>,
    /// Training samples per second over the step (all replicas).
    pub samples_per_s: f64,
    /// Time since training started.
    pub elapsed: Duration,
    /// This process's peak resident bytes so far (Linux's `VmHWM`; `None` elsewhere).
    pub peak_memory: Option<u64>,
}

impl StepReport {
    /// What the step means as events: the step, then its evaluation and the checkpoints
    /// completed with it.
    fn events(self) -> Vec<RunEvent> {
        let mut out = Vec::with_capacity(2 + self.saved.len());
        if let Some(loss) = self.eval_loss {
            out.push(RunEvent::Evaluation {
                step: self.step,
                loss,
                accuracy: self.eval_accuracy,
            });
        }
        out.extend(self.saved.iter().cloned().map(RunEvent::CheckpointSaved));
        out.insert(0, RunEvent::Step(self));
        out
    }
}

/// What happens in a run, in order: for an embedder's event stream
/// ([`crate::api::RunHandle::events`]) and the binary's output.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum RunEvent {
    /// Training starts (graphs built, sessions made, any checkpoint loaded).
    Started {
        /// The first step this run trains (0, or a resumed checkpoint's).
        first_step: u64,
        /// The run's last step + 1.
        total_steps: u64,
        /// Pipeline stages.
        stages: usize,
        /// Data-parallel replicas.
        replicas: usize,
    },
    /// An optimizer step is done.
    Step(StepReport),
    /// The evaluation after a step.
    Evaluation {
        /// The step it followed.
        step: u64,
        /// Mean loss over the evaluation set.
        loss: f64,
        /// Accuracy over it (classification losses).
        accuracy: Option<f64>,
    },
    /// A checkpoint is complete on disk.
    CheckpointSaved(SavedCheckpoint),
    /// Something the user should know that does not stop the run.
    Warning(String),
    /// Events the embedder did not read in time were dropped (step and evaluation events,
    /// oldest first): how many. Comes just before the run's last event.
    Dropped {
        /// Events dropped over the run.
        events: u64,
    },
    /// The run ended; its summary.
    Finished(Box<TrainSummary>),
    /// The run failed: the error (its [`crate::Error::kind`] says what kind of failure),
    /// the same one [`crate::api::RunHandle::wait`] returns.
    Failed(crate::Error),
    /// The run was cancelled.
    Cancelled,
}

/// How a run is driven, beyond its configuration.
pub struct RunOptions<'a> {
    /// Record what every actor did (see [`TrainSummary::trace`]).
    pub record_trace: bool,
    /// Training data handed in by an embedder, instead of the configuration's file.
    pub data: Option<Arc<dyn BatchSource>>,
    /// Evaluation data handed in by an embedder (its step 0 batch is the evaluation set).
    pub eval_data: Option<Arc<dyn BatchSource>>,
    /// Requests from an embedder (checkpoint now, stop).
    pub control: Option<flume::Receiver<RunControl>>,
    /// Sees every event of the run, as it happens.
    pub on_event: &'a mut (dyn FnMut(RunEvent) + Send),
    /// Set to end a run that is still starting: looked at between the phases before
    /// training (loading, graphs, sessions), which cannot be interrupted themselves.
    pub cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Optimizer steps run (by this process: a resumed run counts from its checkpoint).
    pub steps: usize,
    /// The first step this process ran (0, or a resumed checkpoint's step).
    pub first_step: u64,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Samples per optimizer step (all replicas).
    pub global_batch: usize,
    /// Training time (graph building and session creation excluded).
    pub elapsed: Duration,
    /// Pipeline stages.
    pub stages: usize,
    /// The trained parameters (replica 0's; every replica holds the same). A launched
    /// rank gathers them only where the configuration writes the trained model
    /// (`output_path`): empty otherwise.
    pub parameters: Vec<(String, Tensor)>,
    /// What every actor did, when asked for.
    pub trace: Option<RunTrace>,
    /// Per stage this process ran for replica 0: its peak stash, measured and predicted.
    pub stash: Vec<StashPeak>,
    /// What the tensor-shard all-reduces of data-parallel replica 0's shard 0 carried
    /// over the run (this process's stages; `None`: not split).
    pub shard_traffic: Option<crate::compute::ShardTraffic>,
    /// Per stage this process ran for replica 0 that keeps its state on its device: the
    /// bytes it handed between host and device over the run's steps.
    pub host_traffic: Vec<(usize, crate::pipeline::HostTraffic)>,
    /// This process's peak resident bytes: predicted before its sessions opened, and
    /// measured at the end (Linux's `VmHWM`; `None` elsewhere).
    pub peak_memory: (u64, Option<u64>),
}

/// Trains as `cfg` says (a tokio runtime of its own; see [`train_async`] to embed).
///
/// # Errors
/// As [`train_async`].
pub fn train(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    record_trace: bool,
    on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    train_controlled(rt, cfg, config_path, record_trace, None, on_step)
}

/// [`train`], taking requests from `control` as it goes (stop, checkpoint now): what
/// the command line's signal handling sends.
///
/// # Errors
/// As [`train_async`].
pub fn train_controlled(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    record_trace: bool,
    control: Option<flume::Receiver<RunControl>>,
    on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    // Stage actors compute on threads of their own; the scheduler, coordinator and data
    // actors share one worker, so their messages wake no further threads on cores the
    // stages need (engine overhead on mlp fell from +5..15% to within +-1.5%).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .map_err(Error::io(config_path))?;
    let run = steps_of(rt, cfg, config_path, (record_trace, control), on_step);
    runtime.block_on(run)
}

/// A run from the configuration's own data, reporting its steps to `on_step`.
async fn steps_of(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    (record_trace, control): (bool, Option<flume::Receiver<RunControl>>),
    mut on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    let mut forward = |e: RunEvent| {
        if let RunEvent::Step(r) = e {
            on_step(&r);
        }
    };
    let opts = RunOptions {
        cancel: None,
        record_trace,
        data: None,
        eval_data: None,
        control,
        on_event: &mut forward,
    };
    run_with(rt, cfg, config_path, opts).await
}

/// Trains as `cfg` says, calling `on_step` after every optimizer step; resumes from
/// `checkpoint_to_load_path` when set, and saves checkpoints into `checkpoints_dir`.
/// Needs tokio's multi-thread runtime: stages compute on their own worker threads.
///
/// # Errors
/// Any error of loading, graph building or running, naming its file or field; a
/// checkpoint that does not fit the run; a stalled pipeline's who-waits-on-whom report;
/// a non-finite loss or gradient without dynamic loss scaling.
pub async fn train_async(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    record_trace: bool,
    on_step: impl FnMut(&StepReport) + Send,
) -> Result<TrainSummary> {
    steps_of(rt, cfg, config_path, (record_trace, None), on_step).await
}

/// Trains as `cfg` says, driven by `opts`: an embedder's data, control requests, and
/// every event of the run. Needs tokio's multi-thread runtime.
///
/// # Errors
/// As [`train_async`].
pub async fn run_with(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    opts: RunOptions<'_>,
) -> Result<TrainSummary> {
    let local: Option<ClusterPart<pipetrain_actors::LocalCollective>> = None;
    run::run_training(rt, cfg, config_path, opts, local).await
}

/// This process's part of a run spread over several (`pipetrain launch`): as
/// [`run_with`] for the members `part` names, exchanging activations, gradients and the
/// run's decisions with the other processes through `part.dist`. Only process 0 writes
/// TensorBoard's log and the trained model; every process returns the whole model's
/// parameters.
///
/// # Errors
/// As [`run_with`]; `Runtime` when another process fails or the transport breaks.
pub async fn run_cluster<K: Collective>(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
    opts: RunOptions<'_>,
    part: ClusterPart<K>,
) -> Result<TrainSummary> {
    run::run_training(rt, cfg, config_path, opts, Some(part)).await
}

/// Writes a run's trace as JSON (atomically).
///
/// # Errors
/// `Io` when the file cannot be written.
pub fn save_trace(trace: &RunTrace, path: &Path) -> Result<()> {
    let text = serde_json::to_vec_pretty(trace).map_err(|e| Error::Data {
        path: path.to_path_buf(),
        what: "trace".into(),
        reason: e.to_string(),
    })?;
    write_atomically(path, &text)
}

/// Replaces initializers by the safetensors file's tensors of the same name.
pub(crate) fn apply_init(
    model: &mut ModelProto,
    init: &std::collections::HashMap<String, Tensor>,
    path: &Path,
) -> Result<()> {
    let graph = model
        .graph
        .as_mut()
        .ok_or_else(|| Error::graph("the model has no graph"))?;
    for (name, t) in init {
        let slot = graph
            .initializer
            .iter_mut()
            .find(|i| &i.name == name)
            .ok_or_else(|| Error::Data {
                path: path.to_path_buf(),
                what: name.clone(),
                reason: "not an initializer of the model".into(),
            })?;
        let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        if slot.dims != dims || slot.data_type != t.dtype().onnx() {
            return Err(Error::Data {
                path: path.to_path_buf(),
                what: name.clone(),
                reason: format!(
                    "shape {dims:?} type {:?} differs from the model's initializer (shape {:?})",
                    t.dtype(),
                    slot.dims
                ),
            });
        }
        *slot = t.to_proto(name);
    }
    Ok(())
}
