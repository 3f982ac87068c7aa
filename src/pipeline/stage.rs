//! One pipeline stage of one replica on ONNX Runtime: the stage graphs' sessions, the
//! stage's parameters and gradients in flat buffers, its optimizer, and the activations
//! it keeps from a micro-batch's forward for its backward (what it starts from:
//! `stage_open.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::checkpoint::LoadedCheckpoint;
use crate::compute::{Runtime, SessionOptions, Value};
use crate::graph::{LossNormalize, StageGraphs, StageIo, TrainingGraph};
use crate::optim::{Optimizer, ParamLayout};
use crate::pipeline::buckets::Chain;
use crate::pipeline::data::LOSS_COUNT;
use crate::pipeline::settings::StageSettings;
use crate::pipeline::stage_open::{initial_buffers, initial_params, Sessions};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Named values crossing between stages (on the host, or left on the device that computed
/// them: [`Value`]); shared, so a value both sent on and kept for the backward is never
/// copied.
pub type Payload = HashMap<String, Arc<Value>>;

/// A stage's sessions and state.
pub struct OrtStage {
    pub(super) io: StageIo,
    /// Its ONNX Runtime sessions: forward, backward (whole or in halves), the last
    /// stage's fused forward and backward, evaluation.
    pub(super) sessions: Sessions,
    /// Gradients for the previous stage computed by the fused forward, per micro-batch.
    pub(super) fused_out: HashMap<usize, Payload>,
    pub(super) layout: ParamLayout,
    /// `params` and `grads` page-locked on a GPU (declared before them: unlocked before
    /// they are freed).
    pub(super) pinned: crate::compute::PinnedBuffers,
    pub(super) params: Vec<f32>,
    pub(super) grads: Vec<f32>,
    /// Per parameter: whether this step's gradients have reached its accumulator yet.
    pub(super) written: Vec<bool>,
    /// Gradient output name -> parameter index in the layout.
    pub(super) grad_slot: HashMap<String, usize>,
    pub(super) optimizer: Box<dyn Optimizer>,
    pub(super) settings: StageSettings,
    /// The loss scale of the current step.
    pub(super) loss_scale: f64,
    /// Per micro-batch: forward values the backward reads, and the data.
    pub(super) stash: HashMap<usize, Payload>,
    /// The most bytes `stash` held at once.
    pub(super) peak_stash: usize,
    /// Checkpoint snapshot buffers, reused from one checkpoint to the next.
    pub(super) snapshots: crate::checkpoint::SnapshotBuffers,
    /// Optimizer steps finished (applied or skipped).
    pub(super) steps_done: u64,
    /// The gradient graph in buckets (see `buckets`), when asked for and worth it.
    pub(super) chain: Option<Chain>,
    /// Where the buckets go this step, while the stage actor reduces them.
    pub(super) bucket_sink: Option<flume::Sender<pipetrain_actors::GradBucket>>,
    /// Under ZeRO stage 2, its buckets out and their sums coming back (`zero_grads`).
    pub(super) zero_grads: Option<super::zero_grads::ZeroGrads>,
    /// The tensor shard this stage is (`None`: not split).
    pub(super) shard: Option<super::StageShard>,
    /// This replica's part of the stage's optimizer state (ZeRO stage 1; `None`: it
    /// updates every parameter).
    pub(super) zero: Option<super::ZeroPart>,
    /// The tied weights' values it sent and received this step (`pipeline::tied`).
    pub(super) tied_handoffs: super::tied::TiedHandoffs,
    /// Micro-batches that contributed to this step's gradients so far.
    pub(super) contributions: usize,
    /// Buckets sent this step, awaiting their sums.
    pub(super) sent_buckets: usize,
    /// Running statistics this stage keeps, by name (see `StageIo::buffers`): fed to
    /// its graphs, replaced after each training forward.
    pub(super) buffers: Payload,
    /// The parameters, gradients and optimizer state on the stage's device, where it
    /// keeps them there (`stage_device.rs`); then `params` and the optimizer's own state
    /// are a host copy, older than the device's while `host_stale`.
    pub(super) device_state: Option<Box<dyn crate::compute::DeviceState>>,
    pub(super) host_stale: bool,
    /// The outputs a stage with its state on its device leaves there: what it hands to
    /// its backward and to its neighbours (`stage_device::left_on_device`).
    pub(super) device_values: std::collections::HashSet<String>,
    /// The bytes this step handed between host and device (`stage_device.rs`).
    pub(super) host_traffic: super::stage_device::Traffic,
    /// A device failure inside a method that cannot return it, returned by the next that
    /// can.
    pub(super) device_error: Option<Error>,
    /// Where its sessions copy their outputs, and its spent tensors go back
    /// (`compute::HostPool`); `None`: new buffers each time.
    pub(super) host_pool: Option<crate::compute::HostPool>,
}

impl OrtStage {
    /// Sessions for `graphs`, parameters from the training graph's initial values.
    ///
    /// # Errors
    /// `Ort` when a session cannot be made; `Config` for a bad optimizer.
    pub fn new(
        rt: &Runtime,
        tg: &TrainingGraph,
        graphs: &StageGraphs,
        opts: &SessionOptions,
        settings: &StageSettings,
    ) -> Result<OrtStage> {
        let (layout, params) = initial_params(tg, graphs, settings)?;
        let grad_slot: HashMap<String, usize> = graphs
            .io
            .params
            .iter()
            .filter_map(|n| tg.param(n))
            .enumerate()
            .map(|(i, p)| (p.grad.clone(), i))
            .collect();
        let mut sessions = Sessions::open(rt, graphs, opts, settings)?;
        // Sharded gradients (ZeRO stage 2) are never added to in place: no twins.
        let sharded_grads = settings.zero.is_some_and(|z| z.gradients);
        if settings.micro_batches > 1
            && opts.device == crate::compute::Device::Cpu
            && !sharded_grads
        {
            let grads = grad_slot.keys().cloned().collect();
            sessions.open_accumulating(rt, graphs, opts, settings, &grads)?;
        }
        let zero = settings
            .zero
            .map(|slot| super::ZeroPart::new(&layout, slot));
        if let Some(part) = &zero {
            tracing::info!(
                "stage {}: data-parallel rank {} keeps the optimizer state of {} of its {} \
                 parameter values (deepspeed_zero_stage = 1)",
                graphs.stage,
                part.rank,
                part.own_values().len(),
                layout.len()
            );
        }
        // Sharded, the optimizer holds its state for this replica's part only.
        let updated = match &zero {
            Some(part) => layout.part(part.own_tensors()),
            None => layout.clone(),
        };
        let optimizer =
            crate::optim::build_grouped(&settings.optimizer, &settings.param_groups, &updated)?;
        let chain = match settings.bucket_bytes {
            0 => None,
            bytes => {
                let g = sessions.gradient_graph(graphs, settings.split_backward);
                let sizes: Vec<usize> =
                    layout.shapes().iter().map(|s| s.iter().product()).collect();
                let shard = settings.shard.as_ref();
                let in_layout_order = zero.as_ref().is_some_and(|z| z.gradients);
                let cut = (sizes.as_slice(), bytes);
                Chain::new(rt, tg, g, (opts, shard), &grad_slot, cut, in_layout_order)?
            }
        };

        let device_state = match super::stage_device::keeps_state_on_device(opts, settings, &chain)
        {
            true => super::stage_device::open_state(opts.device, &params, optimizer.as_ref())?,
            false => None,
        };
        if opts.cuda_graph && device_state.is_none() {
            return Err(Error::Config {
                path: "<config>".into(),
                field: "runtime.cuda_graph".into(),
                rule: format!(
                    "stage {} keeps its state on the host (LAMB, tensor shards, gradient \
                     buckets, Adasum, ZeRO or histograms), and a CUDA graph replays only a \
                     stage whose state is on its device",
                    graphs.stage
                ),
            });
        }
        if let (Some(link), None) = (&settings.replicas, &device_state) {
            // Its replicas would wait for it in device memory while it reduced on the host.
            return Err(Error::Device {
                device: opts.device.to_string(),
                reason: format!(
                    "stage {}, {link:?}, is to sum its gradients in device memory but keeps \
                     its state on the host",
                    graphs.stage
                ),
            });
        }
        let device_values = match device_state {
            Some(_) => super::stage_device::left_on_device(&graphs.io),
            None => Default::default(),
        };
        Ok(OrtStage {
            zero,
            tied_handoffs: Default::default(),
            device_values,
            device_state,
            host_stale: false,
            host_traffic: Default::default(),
            device_error: None,
            host_pool: None,
            optimizer,
            sessions,
            fused_out: HashMap::new(),
            // Zeroed and mapped lazily: under ZeRO stage 2 only this replica's part is
            // ever written, and the rest never takes memory (`zero`).
            grads: vec![0.0; layout.len()],
            zero_grads: sharded_grads.then(super::zero_grads::ZeroGrads::new),
            shard: settings
                .shard
                .as_ref()
                .and_then(|link| super::StageShard::new(tg, &layout, link.0.rank())),
            written: vec![false; layout.count()],
            pinned: crate::compute::PinnedBuffers::new(opts.device),
            params,
            grad_slot,
            layout,
            io: graphs.io.clone(),
            loss_scale: settings.loss_scale,
            settings: settings.clone(),
            stash: HashMap::new(),
            peak_stash: 0,
            snapshots: Default::default(),
            steps_done: 0,
            chain,
            bucket_sink: None,
            contributions: 0,
            sent_buckets: 0,
            buffers: initial_buffers(tg, &graphs.io),
        })
    }

    /// Copies its sessions' outputs into `pool`'s buffers and gives its spent tensors
    /// back to it (on the host; a stage on a GPU keeps its own).
    pub fn use_host_pool(&mut self, pool: &crate::compute::HostPool) {
        self.sessions.use_host_pool(pool);
        self.host_pool = Some(pool.clone());
    }

    /// What this stage's tensor-shard all-reduces carried (`None`: not split).
    pub fn shard_traffic(&self) -> Option<crate::compute::ShardTraffic> {
        self.settings.shard.as_ref().map(|l| l.0.traffic())
    }

    /// The most bytes this stage kept at once for its micro-batches between their
    /// forward and their backward (the stash: activations, data, hand-offs).
    pub fn peak_stash_bytes(&self) -> usize {
        self.peak_stash
    }

    /// Takes the parameters and optimizer state of this stage from a checkpoint (any
    /// layout: by name).
    ///
    /// # Errors
    /// `Checkpoint` when a tensor is missing or of another shape; nothing changes then.
    pub fn restore(&mut self, ckpt: &LoadedCheckpoint) -> Result<()> {
        let mut stats = Vec::with_capacity(self.buffers.len());
        for (name, t) in &self.buffers {
            let shape = t.shape();
            let mut v = vec![0f32; shape.iter().product()];
            ckpt.copy_buffer(name, shape, &mut v)?;
            stats.push((name.clone(), Tensor::f32(shape.to_vec(), v)?));
        }
        crate::checkpoint::restore_stage(
            ckpt,
            (
                &self.layout,
                self.zero.as_ref().map(super::ZeroPart::own_tensors),
            ),
            &mut self.params,
            self.optimizer.as_mut(),
            self.shard.as_ref().map(super::StageShard::saved),
        )?;
        self.push_to_device(true)?;
        for (name, t) in stats {
            self.buffers.insert(name, Arc::new(t.into()));
        }
        self.steps_done = ckpt.manifest.steps_done;
        Ok(())
    }

    /// Takes the running statistics a training forward computed (`outputs`).
    pub(super) fn keep_buffers(&mut self, outputs: &Payload) {
        for (name, update) in &self.io.buffers {
            if let Some(t) = outputs.get(update) {
                self.buffers.insert(name.clone(), t.clone());
            }
        }
    }

    /// The running statistics, by name, sorted (a statistic is always a host value: the
    /// forward's values that update one come back to the host, `stage_device.rs`).
    pub fn buffer_values(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self
            .buffers
            .iter()
            .filter_map(|(n, t)| Some((n.clone(), t.to_host(n).ok()?.into_owned())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The backward seed `loss_grad` of a micro-batch: its share of the step's loss
    /// (`seed_scale`, or 1 / the step's counted positions when normalized by tokens),
    /// times the loss scale.
    pub(super) fn seed(&self, sources: &[&Payload]) -> Result<Tensor> {
        let share = match self.settings.normalize {
            LossNormalize::MicroBatch => self.settings.seed_scale,
            LossNormalize::Tokens => 1.0 / self.counted(sources)?,
        };
        Tensor::f32(vec![], vec![(share * self.loss_scale) as f32])
    }

    /// The step's count of counted label positions, sent with the data (at least 1, so
    /// a step with none contributes nothing rather than NaN).
    fn counted(&self, sources: &[&Payload]) -> Result<f64> {
        let n = sources
            .iter()
            .find_map(|s| s.get(LOSS_COUNT))
            .and_then(|t| t.first_f64())
            .ok_or_else(|| Error::MissingValue {
                role: "stage input",
                name: LOSS_COUNT.into(),
                hint: "; loss.normalize = \"tokens\" needs the step's count with the labels".into(),
            })?;
        Ok(n.max(1.0))
    }

    /// The micro-batch loss as the coordinator averages it: the graph's mean, or, when
    /// normalized by tokens, the graph's sum as a share of the step's mean (times the
    /// number of micro-batches x replicas, which the coordinator divides by).
    pub(super) fn reported_loss(&self, raw: f64, sources: &[&Payload]) -> Result<f64> {
        Ok(match self.settings.normalize {
            LossNormalize::MicroBatch => raw,
            LossNormalize::Tokens => raw / self.settings.seed_scale / self.counted(sources)?,
        })
    }

    /// Replaces the stage's optimizer by a fresh one of `cfg` (state zeroed, no steps):
    /// the on-device API creates its optimizer after its module.
    ///
    /// # Errors
    /// `Config` when `cfg` breaks a rule.
    pub fn set_optimizer(&mut self, cfg: &crate::optim::OptimizerConfig) -> Result<()> {
        let optimizer = crate::optim::build(cfg, &self.layout)?;
        self.sync_host()?;
        self.optimizer = optimizer;
        self.zero = None;
        if let Some(state) = self.device_state.take() {
            let device = state.params().device;
            let optimizer = self.optimizer.as_ref();
            self.device_state = super::stage_device::open_state(device, &self.params, optimizer)?;
        }
        self.settings.optimizer = cfg.clone();
        Ok(())
    }

    /// The parameters' layout and flat values, and the optimizer: for writing a
    /// checkpoint outside a run.
    pub fn state(&self) -> (&ParamLayout, &[f32], &dyn Optimizer) {
        (&self.layout, &self.params, self.optimizer.as_ref())
    }

    /// The names of the state buffers the stage's optimizer keeps (`exp_avg`, ...).
    pub fn optimizer_state_names(&self) -> Vec<String> {
        self.optimizer
            .state()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect()
    }

    /// Takes only the parameters of this stage from a checkpoint, by name (the optimizer
    /// state is left as it is).
    ///
    /// # Errors
    /// `Checkpoint` when a tensor is missing or of another shape; nothing changes then.
    pub fn restore_params(&mut self, ckpt: &LoadedCheckpoint) -> Result<()> {
        crate::checkpoint::restore_params(ckpt, &self.layout, &mut self.params)?;
        self.push_to_device(false)
    }
}
