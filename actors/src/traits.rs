//! What the runtime needs from the world: stage compute, data, and collectives.
//!
//! The root crate implements these with ONNX Runtime sessions and host buffers; tests
//! and replays implement them with simulated stages that sleep on a virtual clock.

use std::future::Future;
use std::path::Path;

use crate::checkpoint::SaveJob;
use crate::decide::{GradPolicy, GradStats, StepDecision};
use crate::error::{ActorError, BoxError};

/// Which part of a stage's backward to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackwardPart {
    /// Input and weight gradients together (`B`).
    Full,
    /// Only the gradients for the previous stage (`I`, zero-bubble schedules).
    Input,
    /// Only the parameter gradients (`W`).
    Weight,
}

/// What a forward pass produced.
#[derive(Debug)]
pub struct ForwardOut<P> {
    /// Activations for the next stage (`None` on the last stage).
    pub output: Option<P>,
    /// The micro-batch's loss, on the stage that computes it.
    pub loss: Option<f64>,
    /// `(correct, counted)` predictions of a classification loss, in evaluation.
    pub accuracy: Option<(f64, f64)>,
}

/// One pipeline stage of one replica: its parameters, gradients, optimizer state and
/// the activations it keeps between a micro-batch's forward and backward.
pub trait StageCompute: Send + 'static {
    /// Activations and gradients crossing between stages, and data fed to a stage.
    type Payload: Send + 'static;

    /// Forward of micro-batch `mb`: `input` from the previous stage (`None` on the first),
    /// `data` when this stage reads the micro-batch's data.
    fn forward(
        &mut self,
        mb: usize,
        input: Option<Self::Payload>,
        data: Option<Self::Payload>,
    ) -> impl Future<Output = Result<ForwardOut<Self::Payload>, BoxError>> + Send;

    /// Backward (or part of it) of micro-batch `mb`, with the gradient from the next
    /// stage (`None` on the last, and for [`BackwardPart::Weight`]). Returns the gradient
    /// for the previous stage when this part computes one.
    fn backward(
        &mut self,
        mb: usize,
        part: BackwardPart,
        grad: Option<Self::Payload>,
    ) -> impl Future<Output = Result<Option<Self::Payload>, BoxError>> + Send;

    /// Forward of micro-batch `mb` for evaluation: no activations kept, no gradients.
    fn evaluate(
        &mut self,
        mb: usize,
        input: Option<Self::Payload>,
        data: Option<Self::Payload>,
    ) -> impl Future<Output = Result<ForwardOut<Self::Payload>, BoxError>> + Send;

    /// Hands out the parameter gradients accumulated this step (flat), for reduction.
    fn take_grads(&mut self) -> Vec<f32>;

    /// Takes back the (reduced) gradients.
    fn put_grads(&mut self, grads: Vec<f32>);

    /// Whether this compute sums its gradients with its data-parallel replicas' itself,
    /// where they live (in device memory), instead of handing them out: the stage
    /// actor's all-reduce then calls [`StageCompute::all_reduce_own`] and leaves its
    /// collective out. By default it hands them out ([`StageCompute::take_grads`]).
    fn reduces_own_grads(&self) -> bool {
        false
    }

    /// Sums the step's gradients with the other replicas' in place; each replica of the
    /// stage calls it once a step.
    fn all_reduce_own(&mut self) -> impl Future<Output = Result<(), BoxError>> + Send {
        std::future::ready(Err::<(), BoxError>(
            "this stage hands its gradients out for reduction".into(),
        ))
    }

    /// Where this replica updates only its part of the stage's parameters (its
    /// optimizer state sharded across the data-parallel replicas, ZeRO stage 1): every
    /// data-parallel rank's part of the flat parameters, in rank order. The stage actor
    /// then all-gathers the parameters after each update ([`Collective::all_gather`]).
    /// By default every replica updates all of them (`None`).
    fn update_parts(&self) -> Option<Vec<std::ops::Range<usize>>> {
        None
    }

    /// Hands out the flat parameters, for the all-gather after a sharded update.
    fn take_params(&mut self) -> Vec<f32> {
        Vec::new()
    }

    /// Takes back the gathered parameters.
    fn put_params(&mut self, params: Vec<f32>) {
        let _ = params;
    }

    /// Offers a channel for gradient buckets (`None` takes it back). A compute that
    /// takes it sends each bucket of the step's gradients down it as soon as the step's
    /// last backward completes it, so its all-reduce starts while the backward still
    /// runs; every replica sends the same buckets in the same order. (With its gradients
    /// sharded, ZeRO stage 2, it sends every micro-batch's buckets, each to be
    /// reduce-scattered and its sum sent straight back: [`GradBucket`].) Returns whether
    /// it takes it; by default a stage has no buckets, and hands out all its gradients at
    /// the all-reduce ([`StageCompute::take_grads`]).
    fn reduce_buckets_into(&mut self, sink: Option<flume::Sender<GradBucket>>) -> bool {
        let _ = sink;
        false
    }

    /// Takes back the reduced buckets kept for it ([`GradBucket::back`] `None`), in the
    /// order they were sent.
    ///
    /// # Errors
    /// When they are not the buckets sent this step.
    fn put_buckets(&mut self, sums: Vec<Vec<f32>>) -> Result<(), BoxError> {
        let _ = sums;
        Err("this stage sends no gradient buckets".into())
    }

    /// Statistics of the (reduced) gradients of `step`, for the update decision.
    fn grad_stats(&mut self, step: u64) -> GradStats;

    /// Carries out the coordinator's `decision` for `step`: scales the gradients by
    /// `decision.grad_scale` and applies the optimizer with learning rate `lr` (or, when
    /// `decision.apply` is false, leaves parameters and optimizer state untouched), then
    /// clears the gradients and scales the next step's loss by
    /// `decision.next_loss_scale`.
    fn update(
        &mut self,
        step: u64,
        lr: f64,
        decision: &StepDecision,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The update of a step whose decision needs no statistics
    /// ([`GradPolicy::update_is_fixed`]): applies the gradients as they are and returns
    /// their statistics. A compute may take them during the update's own pass over the
    /// gradients; by default they are taken first, and the one decision made.
    fn update_counting(
        &mut self,
        step: u64,
        lr: f64,
    ) -> impl Future<Output = Result<GradStats, BoxError>> + Send {
        async move {
            let stats = self.grad_stats(step);
            let policy = GradPolicy::default();
            let (decision, _) = policy.decide(policy.scaling.initial_state(), &[stats]);
            self.update(step, lr, &decision).await?;
            Ok(stats)
        }
    }

    /// Snapshots the state of `stage` (parameters, optimizer state) for a checkpoint
    /// whose files go into `dir`; the returned job writes and syncs them later, on
    /// another thread. By default a stage has nothing to save.
    ///
    /// # Errors
    /// When the snapshot cannot be taken.
    fn save(&mut self, stage: usize, dir: &Path) -> Result<SaveJob, BoxError> {
        let _ = (stage, dir);
        Ok(Box::new(|| Ok(Vec::new())))
    }
}

/// A bucket of gradients on its way to the reduction across the data-parallel replicas
/// ([`StageCompute::reduce_buckets_into`]).
#[derive(Debug)]
pub struct GradBucket {
    /// The values, the same bucket on every replica.
    pub values: Vec<f32>,
    /// Each replica's part of `values` (in replica order), when each replica needs only
    /// its own part summed ([`Collective::reduce_scatter`]); `None`: every replica gets
    /// the whole sum ([`Collective::all_reduce_sum`]).
    pub parts: Option<Vec<std::ops::Range<usize>>>,
    /// Where the sum goes as soon as it is made; `None`: it is kept, and the step's
    /// sums handed back together by [`StageCompute::put_buckets`].
    pub back: Option<flume::Sender<Vec<f32>>>,
}

impl GradBucket {
    /// A bucket to all-reduce, its sum handed back with the step's others.
    pub fn all_reduced(values: Vec<f32>) -> GradBucket {
        GradBucket {
            values,
            parts: None,
            back: None,
        }
    }
}

/// Where micro-batches come from: each replica's shard of each step's global batch.
pub trait DataSource: Send + Sync + 'static {
    /// The payload a stage is fed.
    type Payload: Send + 'static;

    /// Whether `stage` reads data (the first stage's inputs, the last stage's labels).
    fn feeds(&self, stage: usize) -> bool;

    /// The data `stage` of `replica` reads for micro-batch `mb` of `step`.
    fn micro_batch(
        &self,
        step: u64,
        replica: usize,
        mb: usize,
        stage: usize,
    ) -> Result<Self::Payload, BoxError>;

    /// The data `stage` of `replica` reads for evaluation micro-batch `mb` (the same
    /// evaluation set every time). By default there is none.
    fn eval_micro_batch(
        &self,
        replica: usize,
        mb: usize,
        stage: usize,
    ) -> Result<Self::Payload, BoxError> {
        let _ = (replica, mb, stage);
        Err("no evaluation data".into())
    }
}

/// Gradient reduction across the data-parallel replicas of one stage.
pub trait Collective: Send + Sync + 'static {
    /// The element-wise sum over replicas of `buf`, returned to every replica. Summed in
    /// replica order, so every replica gets identical bits. The sum is written into
    /// `buf` and `buf` itself (the same allocation) comes back: a stage on a GPU keeps
    /// its gradient buffer page-locked while it is lent here.
    fn all_reduce_sum(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
    ) -> impl Future<Output = Result<Vec<f32>, ActorError>> + Send;

    /// The element-wise sum over replicas of part `parts[r]` of `buf`, into replica
    /// `r`'s `buf` (the rest of it is left partly summed): the reduce-scatter half of
    /// [`Collective::all_reduce_sum`], with the same rules for order and bits.
    ///
    /// # Errors
    /// By default, `Settings`: the collective has no reduce-scatter.
    fn reduce_scatter(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> impl Future<Output = Result<Vec<f32>, ActorError>> + Send {
        let _ = (stage, replica, buf, parts);
        unsupported("reduce-scatter")
    }

    /// Every data-parallel replica's part of `buf`, gathered into every replica's `buf`:
    /// `parts[r]` (disjoint, the same on every replica) is the part replica `r` of the
    /// data-parallel group holds; the rest is overwritten. The parts are copied, not
    /// summed, so every replica gets the owners' bits; `buf` itself comes back.
    ///
    /// # Errors
    /// By default, `Settings`: the collective gathers nothing.
    fn all_gather(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> impl Future<Output = Result<Vec<f32>, ActorError>> + Send {
        let _ = (stage, replica, buf, parts);
        unsupported("all-gather")
    }
}

/// The answer of a collective without `what`.
fn unsupported(what: &str) -> std::future::Ready<Result<Vec<f32>, ActorError>> {
    std::future::ready(Err(ActorError::Settings {
        reason: format!("this collective has no {what} (a sharded optimizer needs one)"),
    }))
}

/// What [`Bus::all_gather`] resolves to: every process's bytes, in process order.
pub type Gathered<'a> =
    std::pin::Pin<Box<dyn Future<Output = Result<Vec<Vec<u8>>, ActorError>> + Send + 'a>>;

/// The control plane of a run spread over several processes (one per node): keyed
/// all-gathers of small messages, through which every process reaches the same
/// decisions (a step's loss, the update decision, evaluation, checkpoint commits).
pub trait Bus: Send + Sync + 'static {
    /// This process's index (0: the one that reports and commits checkpoints).
    fn node(&self) -> usize;

    /// The number of processes.
    fn nodes(&self) -> usize;

    /// Every process's `data` for `key`, in process order, once every process gave its
    /// own. Several keys may be gathering at once.
    ///
    /// # Errors
    /// When a process is gone or the bus breaks.
    fn all_gather(&self, key: String, data: Vec<u8>) -> Gathered<'_>;
}
