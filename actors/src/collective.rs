//! In-process AllReduce: one group actor per pipeline stage gathers the replicas'
//! gradient buffers, sums them in replica order and hands the sum back to each.

use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::error::ActorError;
use crate::traits::Collective;

/// Pending contributions per group: at most one per replica is ever in flight, since a
/// replica waits for the sum before it contributes again.
fn group_capacity(replicas: usize) -> usize {
    replicas
}

struct Contribution {
    replica: usize,
    buf: Vec<f32>,
    reply: oneshot::Sender<Vec<f32>>,
}

/// The collectives of replicas that share one process (threads of one machine).
#[derive(Clone)]
pub struct LocalCollective {
    replicas: usize,
    groups: Vec<flume::Sender<Contribution>>,
}

impl LocalCollective {
    /// Starts one group actor per stage in `tasks`.
    pub fn spawn(
        stages: usize,
        replicas: usize,
        tasks: &mut JoinSet<Result<(), ActorError>>,
    ) -> LocalCollective {
        let mut groups = Vec::with_capacity(stages);
        for stage in 0..stages {
            let (tx, rx) = flume::bounded(group_capacity(replicas));
            if replicas > 1 {
                tasks.spawn(group_actor(stage, replicas, rx));
            }
            groups.push(tx);
        }
        LocalCollective { replicas, groups }
    }
}

impl Collective for LocalCollective {
    async fn all_reduce_sum(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
    ) -> Result<Vec<f32>, ActorError> {
        if self.replicas == 1 {
            return Ok(buf);
        }
        let gone = || ActorError::ActorGone {
            actor: format!("all-reduce group of stage {stage}"),
        };
        let group = self.groups.get(stage).ok_or_else(gone)?;
        let (reply, answer) = oneshot::channel();
        group
            .send_async(Contribution {
                replica,
                buf,
                reply,
            })
            .await
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())
    }
}

#[tracing::instrument(skip(rx))]
async fn group_actor(
    stage: usize,
    replicas: usize,
    rx: flume::Receiver<Contribution>,
) -> Result<(), ActorError> {
    loop {
        let mut slots: Vec<Option<Contribution>> = (0..replicas).map(|_| None).collect();
        for received in 0..replicas {
            let Ok(c) = rx.recv_async().await else {
                // Every replica has finished (or a run is being torn down).
                return if received == 0 {
                    Ok(())
                } else {
                    Err(ActorError::ActorGone {
                        actor: format!("a replica of stage {stage} in the middle of an all-reduce"),
                    })
                };
            };
            let r = c.replica;
            if r >= replicas || slots[r].is_some() {
                return Err(ActorError::Protocol {
                    replica: r,
                    rank: stage,
                    reason: "contributed twice to one all-reduce".into(),
                });
            }
            slots[r] = Some(c);
        }
        let mut parts: Vec<Contribution> = slots.into_iter().flatten().collect();
        let mut sum = std::mem::take(&mut parts[0].buf);
        for p in &parts[1..] {
            if p.buf.len() != sum.len() {
                return Err(ActorError::Protocol {
                    replica: p.replica,
                    rank: stage,
                    reason: format!(
                        "gradient of {} values, replica 0 has {}",
                        p.buf.len(),
                        sum.len()
                    ),
                });
            }
            sum.iter_mut().zip(&p.buf).for_each(|(s, x)| *s += x);
        }
        let last = parts.len() - 1;
        for (i, p) in parts.into_iter().enumerate() {
            // A replica that stopped waiting only loses its own answer.
            let _ = p.reply.send(if i == last {
                std::mem::take(&mut sum)
            } else {
                sum.clone()
            });
        }
    }
}
