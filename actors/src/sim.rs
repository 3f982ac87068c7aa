//! Simulated stages: they do no arithmetic, they take the time a cost model (or a
//! recorded run) says. Under `tokio::time::pause` the clock is virtual, so a schedule
//! runs through the real runtime exactly and instantly: how schedules are tested and
//! recorded runs replayed without tensors.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pipetrain_schedules::{Action, ActionKind};

use crate::engine::{run, EngineSettings, RunTrace};
use crate::error::{ActorError, BoxError};
use crate::traits::{BackwardPart, DataSource, ForwardOut, StageCompute};

/// The time an action takes: `(step, replica, action)` -> duration.
pub type CostFn = Arc<dyn Fn(u64, usize, Action) -> Duration + Send + Sync>;

/// A stage that sleeps instead of computing. Its payload is the micro-batch number, so
/// a mix-up of micro-batches between stages is caught.
pub struct SimStage {
    stage: usize,
    stages: usize,
    replica: usize,
    step: u64,
    cost: CostFn,
    hang_in_forward: Option<usize>,
    reduced_own: Option<Arc<AtomicUsize>>,
}

impl SimStage {
    /// Stage `stage` of `stages`, replica `replica`, timed by `cost`.
    pub fn new(stage: usize, stages: usize, replica: usize, cost: CostFn) -> SimStage {
        SimStage {
            stage,
            stages,
            replica,
            step: 0,
            cost,
            hang_in_forward: None,
            reduced_own: None,
        }
    }

    /// Makes the stage sum its gradients with its replicas' itself (as a stage keeping
    /// them on a device does), counting each such reduction in `count`; handing them
    /// out then panics.
    pub fn reducing_its_own(mut self, count: Arc<AtomicUsize>) -> SimStage {
        self.reduced_own = Some(count);
        self
    }

    /// Makes the forward of micro-batch `mb` never finish (so nothing is ever sent on):
    /// how the watchdog is tested.
    pub fn hang_in_forward(mut self, mb: usize) -> SimStage {
        self.hang_in_forward = Some(mb);
        self
    }

    async fn spend(&self, action: Action) {
        tokio::time::sleep((self.cost)(self.step, self.replica, action)).await;
    }
}

fn mismatch(what: &str, want: usize, got: Option<usize>) -> BoxError {
    format!("{what}: expected micro-batch {want}, got {got:?}").into()
}

impl StageCompute for SimStage {
    type Payload = usize;

    async fn forward(
        &mut self,
        mb: usize,
        input: Option<usize>,
        data: Option<usize>,
    ) -> Result<ForwardOut<usize>, BoxError> {
        if self.stage > 0 && input != Some(mb) {
            return Err(mismatch("activation", mb, input));
        }
        if let Some(d) = data.filter(|&d| d != mb) {
            return Err(mismatch("data", mb, Some(d)));
        }
        if self.hang_in_forward == Some(mb) {
            std::future::pending::<()>().await;
        }
        self.spend(Action::forward(self.stage, mb)).await;
        let last = self.stage + 1 == self.stages;
        Ok(ForwardOut {
            output: (!last).then_some(mb),
            loss: last.then(|| 1.0 / (1.0 + self.step as f64 + mb as f64)),
            accuracy: None,
        })
    }

    async fn backward(
        &mut self,
        mb: usize,
        part: BackwardPart,
        grad: Option<usize>,
    ) -> Result<Option<usize>, BoxError> {
        let last = self.stage + 1 == self.stages;
        if !last && part != BackwardPart::Weight && grad != Some(mb) {
            return Err(mismatch("gradient", mb, grad));
        }
        let action = match part {
            BackwardPart::Full => Action::backward(self.stage, mb),
            BackwardPart::Input => Action::backward_input(self.stage, mb),
            BackwardPart::Weight => Action::backward_weight(self.stage, mb),
        };
        self.spend(action).await;
        Ok((part != BackwardPart::Weight && self.stage > 0).then_some(mb))
    }

    async fn evaluate(
        &mut self,
        mb: usize,
        input: Option<usize>,
        data: Option<usize>,
    ) -> Result<ForwardOut<usize>, BoxError> {
        let out = self.forward(mb, input, data).await?;
        // Evaluation losses (2 + mb) differ from training ones, so tests tell them apart;
        // half of each micro-batch's 4 predictions are right.
        let last = out.loss.is_some();
        Ok(ForwardOut {
            loss: out.loss.map(|_| 2.0 + mb as f64),
            accuracy: last.then_some((2.0, 4.0)),
            ..out
        })
    }

    fn take_grads(&mut self) -> Vec<f32> {
        assert!(
            self.reduced_own.is_none(),
            "a stage reducing its own gradients was asked for them"
        );
        vec![self.replica as f32]
    }

    fn reduces_own_grads(&self) -> bool {
        self.reduced_own.is_some()
    }

    async fn all_reduce_own(&mut self) -> Result<(), BoxError> {
        let count = self.reduced_own.as_ref().ok_or("hands its gradients out")?;
        count.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn put_grads(&mut self, _grads: Vec<f32>) {}

    fn grad_stats(&mut self, _step: u64) -> crate::decide::GradStats {
        crate::decide::GradStats { sum_sq: 1.0 }
    }

    async fn update(
        &mut self,
        _step: u64,
        _lr: f64,
        _decision: &crate::decide::StepDecision,
    ) -> Result<(), BoxError> {
        self.spend(Action::optimizer_step(self.stage)).await;
        self.step += 1;
        Ok(())
    }
}

/// Data for simulated stages: the first and last stage read it; the payload is the
/// micro-batch number.
pub struct SimData {
    /// Number of stages.
    pub stages: usize,
}

impl DataSource for SimData {
    type Payload = usize;

    fn feeds(&self, stage: usize) -> bool {
        stage == 0 || stage + 1 == self.stages
    }

    fn micro_batch(
        &self,
        _step: u64,
        _replica: usize,
        mb: usize,
        _stage: usize,
    ) -> Result<usize, BoxError> {
        Ok(mb)
    }

    fn eval_micro_batch(
        &self,
        _replica: usize,
        mb: usize,
        _stage: usize,
    ) -> Result<usize, BoxError> {
        Ok(mb)
    }
}

/// Where a replay first did something else than the recorded run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayDivergence {
    /// Step.
    pub step: usize,
    /// Replica.
    pub replica: usize,
    /// Rank.
    pub rank: usize,
    /// Position in the rank's list.
    pub index: usize,
    /// What the recorded run did there.
    pub recorded: Option<Action>,
    /// What the replay did there.
    pub replayed: Option<Action>,
}

/// Re-drives the runtime with simulated stages taking the recorded compute times (and
/// nothing for transfers), and compares each actor's order of actions with the record.
/// Run it on a paused clock (`tokio::time::pause`) to make it exact and instant.
///
/// # Errors
/// Whatever the runtime reports for the recorded schedule.
pub async fn replay(
    recorded: &RunTrace,
) -> Result<(RunTrace, Option<ReplayDivergence>), ActorError> {
    let mut durations: HashMap<(u64, usize, Action), Duration> = HashMap::new();
    for (step, replicas) in recorded.steps.iter().enumerate() {
        for (replica, trace) in replicas.iter().enumerate() {
            for e in trace.ranks.iter().flatten() {
                if e.action.kind().is_compute() || e.action.kind() == ActionKind::OptimizerStep {
                    let d = Duration::from_nanos(e.end_ns.saturating_sub(e.start_ns));
                    durations.insert((step as u64, replica, e.action), d);
                }
            }
        }
    }
    let cost: CostFn = Arc::new(move |step, replica, action| {
        durations
            .get(&(step, replica, action))
            .copied()
            .unwrap_or_default()
    });
    let schedule = recorded.schedule.compute_only();
    let stages = schedule.stages();
    let computes = (0..recorded.replicas)
        .map(|r| {
            (0..stages)
                .map(|s| SimStage::new(s, stages, r, cost.clone()))
                .collect()
        })
        .collect();
    let settings = EngineSettings {
        watchdog: Duration::from_secs(3600),
        record_trace: true,
        threads: crate::engine::ActorThreads::Tasks,
        evaluation: None,
        ..EngineSettings::new(schedule, recorded.replicas)
    };
    let out = run(
        &settings,
        computes,
        Arc::new(SimData { stages }),
        Box::new(|_| 0.0),
        0..recorded.steps.len() as u64,
        |_| {},
    )
    .await?;
    let replayed = out.trace.ok_or_else(|| ActorError::Settings {
        reason: "the replay recorded no trace".into(),
    })?;
    Ok((replayed.clone(), first_difference(recorded, &replayed)))
}

fn first_difference(a: &RunTrace, b: &RunTrace) -> Option<ReplayDivergence> {
    for (step, (ra, rb)) in a.steps.iter().zip(&b.steps).enumerate() {
        for (replica, (ta, tb)) in ra.iter().zip(rb).enumerate() {
            for rank in 0..ta.ranks.len().max(tb.ranks.len()) {
                let ea: Vec<Action> = ta
                    .ranks
                    .get(rank)
                    .into_iter()
                    .flatten()
                    .map(|e| e.action)
                    .collect();
                let eb: Vec<Action> = tb
                    .ranks
                    .get(rank)
                    .into_iter()
                    .flatten()
                    .map(|e| e.action)
                    .collect();
                if ea != eb {
                    let index = ea.iter().zip(&eb).take_while(|(x, y)| x == y).count();
                    return Some(ReplayDivergence {
                        step,
                        replica,
                        rank,
                        index,
                        recorded: ea.get(index).copied(),
                        replayed: eb.get(index).copied(),
                    });
                }
            }
        }
    }
    (a.steps.len() != b.steps.len()).then(|| ReplayDivergence {
        step: a.steps.len().min(b.steps.len()),
        replica: 0,
        rank: 0,
        index: 0,
        recorded: None,
        replayed: None,
    })
}
