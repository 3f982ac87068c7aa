//! Micro-batches for the actor runtime: each step's global batch split into
//! `replicas x micro_batches` equal parts, replica `r` taking parts `r*m .. r*m + m`.

use std::sync::Arc;

use pipetrain_actors::{BoxError, DataSource};

use crate::data::Batches;
use crate::pipeline::stage::Payload;

/// The data each stage reads, from one data file.
pub struct StepData {
    batches: Batches,
    /// The evaluation set: its first batch, split like a training step's.
    eval: Option<(Batches, usize)>,
    micro_batches: usize,
    replicas: usize,
    /// For each stage, the data inputs its graphs read.
    reads: Vec<Vec<String>>,
}

impl StepData {
    /// `reads[stage]` names the data inputs of each stage (from its `StageIo`).
    pub fn new(
        batches: Batches,
        micro_batches: usize,
        replicas: usize,
        reads: Vec<Vec<String>>,
    ) -> StepData {
        StepData {
            batches,
            eval: None,
            micro_batches,
            replicas,
            reads,
        }
    }
}

impl StepData {
    /// Evaluates on the first batch of `eval`, split into `micro_batches` per replica.
    pub fn with_eval(mut self, eval: Batches, micro_batches: usize) -> StepData {
        self.eval = Some((eval, micro_batches));
        self
    }

    fn pick(&self, mut all: crate::compute::TensorMap, stage: usize) -> Payload {
        self.reads[stage]
            .iter()
            .filter_map(|n| all.remove(n).map(|t| (n.clone(), Arc::new(t))))
            .collect()
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
        let all = self
            .batches
            .part(step as usize, replica * self.micro_batches + mb, parts)?;
        Ok(self.pick(all, stage))
    }

    fn eval_micro_batch(
        &self,
        replica: usize,
        mb: usize,
        stage: usize,
    ) -> Result<Payload, BoxError> {
        let (eval, k) = self.eval.as_ref().ok_or("no evaluation data configured")?;
        let all = eval.part(0, replica * k + mb, k * self.replicas)?;
        Ok(self.pick(all, stage))
    }
}
