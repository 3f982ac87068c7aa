//! Micro-batches for the actor runtime: each step's global batch split into
//! `replicas x micro_batches` equal parts, replica `r` taking parts `r*m .. r*m + m`.

use std::sync::Arc;

use pipetrain_actors::{BoxError, DataSource};

use crate::data::Batches;
use crate::pipeline::stage::Payload;

/// The data each stage reads, from one data file.
pub struct StepData {
    batches: Batches,
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
            micro_batches,
            replicas,
            reads,
        }
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
        let mut all = self
            .batches
            .part(step as usize, replica * self.micro_batches + mb, parts)?;
        Ok(self.reads[stage]
            .iter()
            .filter_map(|n| all.remove(n).map(|t| (n.clone(), Arc::new(t))))
            .collect())
    }
}
