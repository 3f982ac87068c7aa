//! Micro-batches for the actor runtime: each step's global batch split into
//! `replicas x micro_batches` equal parts, replica `r` taking parts `r*m .. r*m + m`.

use std::sync::Arc;

use pipetrain_actors::{BoxError, DataSource};

use crate::compute::TensorMap;
use crate::data::StepBatches;
use crate::graph::DROPOUT_KEY;
use crate::pipeline::stage::Payload;
use crate::tensor::Tensor;

/// The payload entry (a float64 scalar) with the count of counted label positions of the
/// whole step (every micro-batch, every replica), sent beside the labels when the loss is
/// normalized by tokens. Not a graph input: sessions only take the names they read.
pub const LOSS_COUNT: &str = "pipetrain/counted_positions";

/// The data each stage reads, from one data file.
pub struct StepData {
    batches: Box<dyn StepBatches>,
    /// The evaluation set: its first batch, split like a training step's.
    eval: Option<(Box<dyn StepBatches>, usize)>,
    micro_batches: usize,
    replicas: usize,
    /// Tensor shards per replica: the engine's replica `r` reads data-parallel replica
    /// `r / shards`'s data.
    shards: usize,
    /// For each stage, the data inputs its graphs read.
    reads: Vec<Vec<String>>,
    /// `(label, ignore_index)`: send [`LOSS_COUNT`] with this label.
    count_labels: Option<(String, Option<i64>)>,
    /// The run's seed, first of the training micro-batches' [`DROPOUT_KEY`]s.
    seed: u64,
}

impl StepData {
    /// `reads[stage]` names the data inputs of each stage (from its `StageIo`).
    pub fn new(
        batches: Box<dyn StepBatches>,
        micro_batches: usize,
        replicas: usize,
        reads: Vec<Vec<String>>,
    ) -> StepData {
        StepData {
            batches,
            eval: None,
            micro_batches,
            replicas,
            shards: 1,
            reads,
            count_labels: None,
            seed: 0,
        }
    }

    /// Keys the training-mode dropouts of the stages that read [`DROPOUT_KEY`] with
    /// `seed`, and each micro-batch's step, data-parallel replica and index.
    pub fn with_seed(mut self, seed: u64) -> StepData {
        self.seed = seed;
        self
    }

    /// The engine's replicas are `shards` tensor shards of each data-parallel replica:
    /// every shard of one reads the same data.
    pub fn with_shards(mut self, shards: usize) -> StepData {
        self.shards = shards.max(1);
        self
    }

    /// Sends the step's count of `label` positions other than `ignore_index` with the
    /// label (for `loss.normalize = "tokens"`).
    pub fn with_token_count(mut self, label: &str, ignore_index: Option<i64>) -> StepData {
        self.count_labels = Some((label.to_string(), ignore_index));
        self
    }
}

impl StepData {
    /// Evaluates on the first batch of `eval`, split into `micro_batches` per replica.
    pub fn with_eval(mut self, eval: Box<dyn StepBatches>, micro_batches: usize) -> StepData {
        self.eval = Some((eval, micro_batches));
        self
    }

    /// What `stage` reads of a micro-batch, and the step's count of counted positions
    /// when it reads the label and the loss is normalized by tokens (`whole`: the step's
    /// whole batch).
    fn pick(
        &self,
        mut all: TensorMap,
        stage: usize,
        whole: impl FnOnce() -> crate::Result<TensorMap>,
    ) -> Result<Payload, BoxError> {
        let mut out: Payload = self.reads[stage]
            .iter()
            .filter_map(|n| all.remove(n).map(|t| (n.clone(), Arc::new(t.into()))))
            .collect();
        if let Some((label, ignore)) = &self.count_labels {
            if self.reads[stage].contains(label) {
                let batch = whole()?;
                let labels = batch
                    .get(label)
                    .and_then(Tensor::to_i64_vec)
                    .ok_or_else(|| format!("the label `{label}` is not integer data"))?;
                let n = labels.iter().filter(|&&l| Some(l) != *ignore).count();
                out.insert(
                    LOSS_COUNT.into(),
                    Arc::new(Tensor::f64(vec![], vec![n as f64])?.into()),
                );
            }
        }
        Ok(out)
    }
}

impl DataSource for StepData {
    type Payload = Payload;

    fn feeds(&self, stage: usize) -> bool {
        self.reads.get(stage).is_some_and(|r| !r.is_empty())
    }

    fn micro_batch(
        &self,
        step: u64,
        replica: usize,
        mb: usize,
        stage: usize,
    ) -> Result<Payload, BoxError> {
        let parts = self.micro_batches * self.replicas;
        let replica = replica / self.shards;
        let all = self
            .batches
            .part(step as usize, replica * self.micro_batches + mb, parts)?;
        let mut out = self.pick(all, stage, || self.batches.batch(step as usize))?;
        if self.reads[stage].iter().any(|r| r == DROPOUT_KEY) {
            let key = [self.seed as i64, step as i64, replica as i64, mb as i64];
            out.insert(
                DROPOUT_KEY.into(),
                Arc::new(Tensor::i64(vec![4], key.to_vec())?.into()),
            );
        }
        Ok(out)
    }

    fn eval_micro_batch(
        &self,
        replica: usize,
        mb: usize,
        stage: usize,
    ) -> Result<Payload, BoxError> {
        let (eval, k) = self.eval.as_ref().ok_or("no evaluation data configured")?;
        let replica = replica / self.shards;
        let all = eval.part(0, replica * k + mb, k * self.replicas)?;
        self.pick(all, stage, || eval.batch(0))
    }
}
