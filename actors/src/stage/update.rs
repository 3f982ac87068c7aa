//! A stage actor's optimizer step: the update decision (its own, or the coordinator's
//! when every stage's statistics are needed first) and the update it carries out.

use pipetrain_schedules::Action;

use super::{StageActor, Status, StepOutcome};
use crate::decide::StepDecision;
use crate::error::ActorError;
use crate::traits::{Collective, StageCompute};

impl<C: StageCompute, K: Collective> StageActor<C, K> {
    /// A stage's update (`action`) of `step` at learning rate `lr`: with the rank's
    /// decision, taken at its first optimizer step; or, where the policy needs none, with
    /// the statistics taken on the update's own pass over the gradients.
    pub(super) async fn optimizer_step(
        &mut self,
        action: Action,
        (step, lr): (u64, f64),
        out: &mut StepOutcome,
        decision: &mut Option<StepDecision>,
    ) -> Result<(), ActorError> {
        let s = action.stage();
        if self.policy.update_is_fixed() {
            let stats = self
                .compute(s)?
                .update_counting(step, lr)
                .await
                .map_err(|source| self.failed(action, source))?;
            out.grads.push((s, stats));
            return self.gather_params(action).await;
        }
        let d = match *decision {
            Some(d) => d,
            None => {
                let d = self.decide(action, step, out).await?;
                *decision = Some(d);
                d
            }
        };
        self.compute(s)?
            .update(step, lr, &d)
            .await
            .map_err(|source| self.failed(action, source))?;
        self.gather_params(action).await
    }

    /// After an update of its part only (ZeRO stage 1), every replica's updated part of
    /// the stage's parameters, gathered from its data-parallel group.
    async fn gather_params(&mut self, action: Action) -> Result<(), ActorError> {
        let s = action.stage();
        let Some(parts) = self.compute(s)?.update_parts() else {
            return Ok(());
        };
        self.set(Status::Waiting {
            action,
            from: "the other replicas' updated parameters".into(),
        });
        let params = self.compute(s)?.take_params();
        let gathered = self
            .collective
            .all_gather(s, self.replica, params, &parts)
            .await?;
        self.compute(s)?.put_params(gathered);
        self.set(Status::Running(action));
        Ok(())
    }

    /// The update decision of `step`, taken at the rank's first optimizer step, when
    /// every stage of the rank has its reduced gradients (lowering puts all of a rank's
    /// all-reduces before its optimizer steps). It needs every stage's statistics when
    /// clipping or dynamic loss scaling are on (the coordinator waits for all of them);
    /// otherwise each stage's own statistics decide alone.
    async fn decide(
        &mut self,
        action: Action,
        step: u64,
        out: &mut StepOutcome,
    ) -> Result<StepDecision, ActorError> {
        let mut stages: Vec<usize> = self.computes.keys().copied().collect();
        stages.sort_unstable();
        for &s in &stages {
            let stats = self.compute(s)?.grad_stats(step);
            out.grads.push((s, stats));
        }
        if !self.policy.needs_barrier() {
            let state = self.policy.scaling.initial_state();
            let stats: Vec<_> = out.grads.iter().map(|&(_, g)| g).collect();
            return Ok(self.policy.decide(state, &stats).0);
        }
        self.set(Status::Waiting {
            action,
            from: "the coordinator's decision on every stage's gradients".into(),
        });
        let d = self
            .coordinator
            .decide(step, self.replica, out.grads.clone())
            .await?;
        self.set(Status::Running(action));
        Ok(d)
    }
}
