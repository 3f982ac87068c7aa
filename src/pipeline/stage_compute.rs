//! [`OrtStage`] as the actor runtime's [`StageCompute`]: forward, backward (whole, or
//! its input and weight halves), evaluation, and the update the coordinator decides.

use std::path::Path;

use pipetrain_actors::{
    BackwardPart, BoxError, ForwardOut, GradBucket, GradStats, SaveJob, StageCompute, StepDecision,
};

use super::stage::{OrtStage, Payload};
use crate::graph::{ACC_CORRECT, ACC_COUNTED, LOSS};
use crate::optim::Optimizer;
use crate::Result;

impl OrtStage {
    /// Runs the forward (or, for `eval`, the evaluation) graph; its outputs, shared.
    fn forward_pass(&mut self, eval: bool, input: &Payload, data: &Payload) -> Result<Payload> {
        let mut session = if eval {
            self.sessions.evaluate.take()
        } else {
            self.sessions.forward.take()
        };
        let outputs = match session.as_mut() {
            Some(s) => self.run(s, &[input, data]),
            None => Ok(Payload::new()),
        };
        if eval {
            self.sessions.evaluate = session;
        } else {
            self.sessions.forward = session;
        }
        outputs
    }

    /// What a forward pass hands on: the next stage's activations (its own outputs and
    /// what it passes through) and the loss on the last stage.
    fn forward_out(
        &mut self,
        outputs: &Payload,
        input: &Payload,
        data: &Payload,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        let loss = match outputs.get(LOSS) {
            Some(t) => {
                let raw = t.first_f64().ok_or("empty loss")?;
                Some(self.reported_loss(raw, &[data])?)
            }
            None => None,
        };
        let scalar = |name: &str| outputs.get(name).and_then(|t| t.first_f64());
        let accuracy = scalar(ACC_CORRECT).zip(scalar(ACC_COUNTED));
        let mut send = pick(&self.io.fwd_send, &[outputs, input]);
        (self.tied_handoffs).outgoing(self.steps_done, &self.io.tied, &mut send);
        Ok(ForwardOut {
            output: (!self.io.fwd_send.is_empty()).then_some(send),
            loss,
            accuracy,
        })
    }
}

impl OrtStage {
    /// Gives the tensors of `payloads` nothing else holds back to the host pool.
    fn recycle<const N: usize>(&self, payloads: [Payload; N]) {
        if let Some(pool) = &self.host_pool {
            pool.recycle(payloads.into_iter().flat_map(|p| p.into_values()));
        }
    }

    /// Notes the stash's size after it grew.
    fn stash_grew(&mut self) {
        let now: usize = self
            .stash
            .values()
            .flat_map(|p| p.values())
            .map(|t| t.bytes())
            .sum();
        self.peak_stash = self.peak_stash.max(now);
    }
}

/// The values of `names` found in `sources` (first match wins).
fn pick(names: &[String], sources: &[&Payload]) -> Payload {
    names
        .iter()
        .filter_map(|n| {
            sources
                .iter()
                .find_map(|s| s.get(n))
                .map(|t| (n.clone(), t.clone()))
        })
        .collect()
}

/// The optimizer step's parts, shared by [`StageCompute::update`] (after a decision) and
/// [`StageCompute::update_counting`] (none needed).
impl OrtStage {
    /// The step's gradients complete, with the overflow a test asked for at `step`.
    fn final_grads(&mut self, step: u64) {
        self.complete_grads();
        if self.settings.overflow_at.contains(&step) {
            if let Some(state) = self.device_state.as_mut() {
                if let Err(e) = state.set_grad(0, f32::INFINITY) {
                    self.device_error.get_or_insert(e);
                }
            } else {
                // The first value this replica holds reduced.
                let at = self.zero.as_ref().map_or(0, |z| z.own_values().start);
                if let Some(g) = self.grads.get_mut(at) {
                    *g = f32::INFINITY;
                }
            }
        }
    }

    /// Applies the optimizer to the gradients as they are now, by `step_with` (the
    /// optimizer's `step` or `step_counting`), and returns what that returns.
    fn optimize<T>(
        &mut self,
        step: u64,
        lr: f64,
        step_with: impl FnOnce(&mut dyn Optimizer, &mut [f32], &[f32], f64) -> Result<T>,
    ) -> Result<T> {
        let Some(part) = &self.zero else {
            self.tap("grad", step, &self.grads);
            let out = step_with(self.optimizer.as_mut(), &mut self.params, &self.grads, lr)?;
            self.tap("param", step, &self.params);
            return Ok(out);
        };
        // This replica's part (of the gradients, the only one reduced); the parameters
        // are tapped once gathered.
        let own = part.own_values();
        self.tap_part("grad", step, &self.grads, part.own_tensors());
        let (params, grads) = (&mut self.params[own.clone()], &self.grads[own]);
        step_with(self.optimizer.as_mut(), params, grads, lr)
    }

    /// Clears the gradients for step `step + 1`, whose loss is scaled by `loss_scale`.
    fn end_step(&mut self, step: u64, loss_scale: f64) {
        if self.zero_grads.is_some() {
            tracing::debug!(
                "step {step}: {} of the gradient buffer's {} bytes in memory",
                super::zero_grads::resident_bytes(&self.grads),
                std::mem::size_of_val(self.grads.as_slice())
            );
        }
        if self.device_state.is_some() {
            self.host_traffic.end_step(step);
        }
        self.steps_done = step + 1;
        self.reset_grads();
        self.loss_scale = loss_scale;
    }
}

impl StageCompute for OrtStage {
    type Payload = Payload;

    async fn forward(
        &mut self,
        mb: usize,
        input: Option<Payload>,
        data: Option<Payload>,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        if let Some((step, hold)) = self.settings.stall {
            if step == self.steps_done && mb == 0 {
                // A test aid: this stage's thread is held, its process runs on.
                std::thread::sleep(hold);
            }
        }
        let input = self.received(input)?;
        let data = data.unwrap_or_default();
        if let Some(mut session) = self.sessions.fused.take() {
            let outputs = self.run_grads(&mut session, &[&input, &data]);
            self.sessions.fused = Some(session);
            let rest = outputs?;
            self.keep_buffers(&rest);
            let raw = rest
                .get(LOSS)
                .and_then(|t| t.first_f64())
                .ok_or("the fused stage computed no loss")?;
            let loss = self.reported_loss(raw, &[&data])?;
            let send = pick(&self.io.bwd_send, &[&rest, &input]);
            self.fused_out.insert(mb, send);
            return Ok(ForwardOut {
                output: None,
                loss: Some(loss),
                accuracy: None,
            });
        }
        let outputs = self.forward_pass(false, &input, &data)?;
        self.keep_buffers(&outputs);
        let mut keep = pick(&self.io.stash, &[&outputs, &input]);
        keep.extend(data.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.stash.insert(mb, keep);
        self.stash_grew();
        let out = self.forward_out(&outputs, &input, &data);
        self.recycle([outputs, input]);
        out
    }

    async fn backward(
        &mut self,
        mb: usize,
        part: BackwardPart,
        grad: Option<Payload>,
    ) -> Result<Option<Payload>, BoxError> {
        if self.sessions.fused.is_some() {
            let send = self
                .fused_out
                .remove(&mb)
                .ok_or_else(|| format!("backward of micro-batch {mb} before its forward"))?;
            return Ok((!self.io.bwd_send.is_empty()).then_some(send));
        }
        let grad = self.readable(grad.unwrap_or_default())?;
        let stash = match part {
            BackwardPart::Input => self.stash.get(&mb).cloned(),
            BackwardPart::Full | BackwardPart::Weight => self.stash.remove(&mb),
        }
        .ok_or_else(|| format!("backward of micro-batch {mb} before its forward"))?;
        let slot = match part {
            BackwardPart::Full => &mut self.sessions.backward,
            BackwardPart::Input => &mut self.sessions.backward_input,
            BackwardPart::Weight => &mut self.sessions.backward_weight,
        };
        let mut session = slot.take();
        let outputs = match (session.as_mut(), part) {
            (Some(s), BackwardPart::Input) => self.run(s, &[&grad, &stash]),
            (Some(s), _) => self.run_grads(s, &[&grad, &stash]),
            (None, _) => Ok(Payload::new()),
        };
        match part {
            BackwardPart::Full => self.sessions.backward = session,
            BackwardPart::Input => self.sessions.backward_input = session,
            BackwardPart::Weight => self.sessions.backward_weight = session,
        }
        let rest = outputs?;
        if part == BackwardPart::Input {
            // What the weight half will read: values the input half computed for it, and
            // the gradients that arrived from the next stage.
            let handoff = pick(&self.io.i_to_w, &[&rest]);
            if let Some(s) = self.stash.get_mut(&mb) {
                s.extend(handoff);
                s.extend(grad.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            self.stash_grew();
        }
        let send = match part {
            BackwardPart::Weight => None,
            _ => Some(pick(&self.io.bwd_send, &[&rest, &grad])),
        };
        // What this micro-batch's backward was the last to read goes back to the pool
        // (what is sent on, or still stashed, is held elsewhere and stays).
        self.recycle([stash, grad, rest]);
        Ok(send.filter(|_| !self.io.bwd_send.is_empty()))
    }

    async fn evaluate(
        &mut self,
        _mb: usize,
        input: Option<Payload>,
        data: Option<Payload>,
    ) -> Result<ForwardOut<Payload>, BoxError> {
        let input = self.received(input)?;
        let data = data.unwrap_or_default();
        let outputs = self.forward_pass(true, &input, &data)?;
        self.forward_out(&outputs, &input, &data)
    }

    fn take_grads(&mut self) -> Vec<f32> {
        self.complete_grads();
        if let Err(e) = self.grads_to_host() {
            self.device_error.get_or_insert(e);
        }
        match self.settings.adasum {
            Some(slot) => {
                // The buffer is freed here: unlocked first.
                self.pinned.release(&self.grads);
                slot.spread(&std::mem::take(&mut self.grads))
            }
            // Lent: collectives sum in place and give this allocation back (the
            // `Collective` contract), so it stays page-locked meanwhile.
            None => std::mem::take(&mut self.grads),
        }
    }

    fn put_grads(&mut self, grads: Vec<f32>) {
        self.grads = match self.settings.adasum {
            Some(slot) => {
                let tensors: Vec<_> = self.layout.ranges().collect();
                slot.combine(&grads, &tensors)
            }
            None => grads,
        };
        if let Err(e) = self.grads_to_device() {
            self.device_error.get_or_insert(e);
        }
    }

    fn reduces_own_grads(&self) -> bool {
        self.settings.replicas.is_some() && self.device_state.is_some()
    }

    async fn all_reduce_own(&mut self) -> Result<(), BoxError> {
        // A failure still takes part in the round, so that no replica waits for ever.
        self.complete_grads();
        let link = self.settings.replicas.clone();
        let summed = match (link, self.device_state.as_mut()) {
            (Some(link), Some(state)) => link.all_reduce(state.as_mut()).await,
            _ => return Err("this stage has no replicas on its device to reduce with".into()),
        };
        match self.device_error.take() {
            Some(e) => Err(e.into()),
            None => Ok(summed?),
        }
    }

    fn update_parts(&self) -> Option<Vec<std::ops::Range<usize>>> {
        self.zero.as_ref().map(|z| z.values().to_vec())
    }

    fn take_params(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.params)
    }

    fn put_params(&mut self, params: Vec<f32>) {
        self.params = params;
        if self.zero.is_some() {
            self.tap("param", self.steps_done.saturating_sub(1), &self.params);
        }
    }

    fn reduce_buckets_into(&mut self, sink: Option<flume::Sender<GradBucket>>) -> bool {
        // Sharded gradients go out in buckets, cut or not.
        if self.chain.is_none() && self.zero_grads.is_none() {
            return false;
        }
        if let (Some(zg), Some(_)) = (self.zero_grads.as_mut(), &sink) {
            zg.restart();
        }
        self.bucket_sink = sink;
        true
    }

    fn put_buckets(&mut self, sums: Vec<Vec<f32>>) -> Result<(), BoxError> {
        match self.zero_grads.is_some() {
            true => Ok(self.put_sharded_sums(sums)?),
            false => Ok(self.put_bucket_sums(sums)?),
        }
    }

    fn grad_stats(&mut self, step: u64) -> GradStats {
        self.final_grads(step);
        if let Some(stats) = self.device_grad_stats() {
            return stats;
        }
        // A replica updating its part of the stage holds only that part reduced.
        if let Some(part) = &self.zero {
            return match &self.shard {
                Some(shard) => shard.grad_stats_of(&self.layout, &self.grads, part.own_tensors()),
                None => GradStats::of(&self.grads[part.own_values()]),
            };
        }
        match &self.shard {
            Some(shard) => shard.grad_stats(&self.layout, &self.grads),
            None => GradStats::of(&self.grads),
        }
    }

    async fn update(
        &mut self,
        step: u64,
        lr: f64,
        decision: &StepDecision,
    ) -> Result<(), BoxError> {
        if self.device_state.is_some() {
            if decision.apply {
                self.device_update(lr, decision.grad_scale)?;
            }
            self.end_step(step, decision.next_loss_scale);
            return Ok(());
        }
        if decision.apply {
            // Unscale and clip in one pass; skipped when it is exactly 1, so runs without
            // clipping or scaling stay bitwise what they were.
            if decision.grad_scale != 1.0 {
                let k = decision.grad_scale as f32;
                // A replica updating its part needs (and under ZeRO stage 2 has) only it.
                let mine = self
                    .zero
                    .as_ref()
                    .map_or(0..self.grads.len(), |z| z.own_values());
                self.grads[mine].iter_mut().for_each(|g| *g *= k);
            }
            self.optimize(step, lr, |o, p, g, lr| o.step(p, g, lr))?;
        }
        self.end_step(step, decision.next_loss_scale);
        Ok(())
    }

    async fn update_counting(&mut self, step: u64, lr: f64) -> Result<GradStats, BoxError> {
        // A tensor-parallel shard counts only its part of the split parameters, a
        // replica updating its part of the stage (ZeRO) that part.
        if self.shard.is_some() || self.zero.is_some() {
            let stats = self.grad_stats(step);
            self.optimize(step, lr, |o, p, g, lr| o.step(p, g, lr))?;
            self.end_step(step, 1.0);
            return Ok(stats);
        }
        self.final_grads(step);
        if let Some(stats) = self.device_grad_stats() {
            self.device_update(lr, 1.0)?;
            self.end_step(step, 1.0);
            return Ok(stats);
        }
        let stats = self.optimize(step, lr, |o, p, g, lr| o.step_counting(p, g, lr))?;
        self.end_step(step, 1.0);
        Ok(stats)
    }

    fn save(&mut self, stage: usize, dir: &Path) -> Result<SaveJob, BoxError> {
        self.sync_host()?;
        let stats = self.buffer_values();
        let mut entries = Vec::with_capacity(stats.len());
        for (name, t) in &stats {
            let values = t.as_f32().ok_or_else(|| {
                format!("running statistic `{name}` is not float32; checkpoints hold float32")
            })?;
            entries.push((name.clone(), t.shape.as_slice(), values));
        }
        let state = crate::checkpoint::StageState {
            layout: &self.layout,
            params: &self.params,
            optimizer: self.optimizer.as_ref(),
            stats: &entries,
            shard: self.shard.as_ref().map(super::StageShard::saved),
            zero: self.zero.as_ref().map(|z| (z.rank, z.own_tensors())),
        };
        Ok(crate::checkpoint::save_job(
            stage,
            dir,
            state,
            self.settings.slow_save,
            &self.snapshots,
        )?)
    }
}
