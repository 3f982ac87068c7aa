//! The in-process group the tensor shards of one stage sum through (see
//! [`super::ShardComm`]). The sum is taken in shard order by the last shard to arrive and
//! copied out by every shard, so every shard gets the same bits (as the replicas'
//! all-reduce does); the group's buffers are kept from one all-reduce to the next. Written
//! here because no crate offers an in-process blocking all-reduce over borrowed slices.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::shard_ops::{ShardComm, ShardLink, ShardTraffic, TrafficMeter};

/// The shards of one group that share a process: a meeting point per all-reduce.
pub struct LocalShards {
    shards: usize,
    state: Mutex<Round>,
    turn: Condvar,
    patience: Duration,
}

/// One all-reduce in progress.
#[derive(Default)]
struct Round {
    /// Each shard's tensor, and whether it brought it this round (kept allocated).
    parts: Vec<Vec<f32>>,
    brought: Vec<bool>,
    /// The round's sum, valid while `summed` (kept allocated).
    sum: Vec<f32>,
    summed: bool,
    taken: usize,
    /// Why the group failed: every shard waiting or coming later fails with it at once
    /// (rather than waiting out its patience).
    failed: Option<String>,
}

impl Round {
    /// Marks the group failed, wakes every shard, and hands back the reason.
    fn fail(&mut self, turn: &Condvar, why: String) -> String {
        self.failed.get_or_insert(why.clone());
        turn.notify_all();
        why
    }
}

impl LocalShards {
    /// A group of `shards`; a shard waits at most `patience` for the others (then its
    /// session fails, naming the wait, rather than hanging the run).
    pub fn new(shards: usize, patience: Duration) -> Arc<LocalShards> {
        Arc::new(LocalShards {
            shards,
            state: Mutex::new(Round {
                parts: vec![Vec::new(); shards],
                brought: vec![false; shards],
                ..Round::default()
            }),
            turn: Condvar::new(),
            patience,
        })
    }

    /// Shard `rank`'s handle.
    pub fn link(self: &Arc<Self>, rank: usize) -> ShardLink {
        ShardLink(Arc::new(LocalShard {
            group: self.clone(),
            rank,
            meter: TrafficMeter::default(),
        }))
    }

    fn wait<'a>(
        &self,
        mut state: MutexGuard<'a, Round>,
        until: Instant,
        rank: usize,
    ) -> Result<MutexGuard<'a, Round>, String> {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let why = format!(
                "tensor shard {rank} waited {:.0} s for the other shards of its group",
                self.patience.as_secs_f64()
            );
            return Err(state.fail(&self.turn, why));
        }
        let (state, _) = self
            .turn
            .wait_timeout(state, left)
            .map_err(|_| "a tensor shard panicked".to_string())?;
        match &state.failed {
            Some(why) => Err(why.clone()),
            None => Ok(state),
        }
    }
}

struct LocalShard {
    group: Arc<LocalShards>,
    rank: usize,
    meter: TrafficMeter,
}

impl ShardComm for LocalShard {
    fn shards(&self) -> usize {
        self.group.shards
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn traffic(&self) -> ShardTraffic {
        self.meter.read()
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), String> {
        let start = Instant::now();
        self.sum(buf)?;
        self.meter.count(buf.len(), start);
        Ok(())
    }
}

impl LocalShard {
    fn sum(&self, buf: &mut [f32]) -> Result<(), String> {
        let g = &self.group;
        let until = Instant::now() + g.patience;
        let mut st = g.state.lock().map_err(|_| "a tensor shard panicked")?;
        if let Some(why) = &st.failed {
            return Err(why.clone());
        }
        // The previous round's sum is still being copied out by slower shards.
        while st.summed {
            st = g.wait(st, until, self.rank)?;
        }
        if st.brought[self.rank] {
            let why = format!("tensor shard {} contributed twice", self.rank);
            return Err(st.fail(&g.turn, why));
        }
        let rank = self.rank;
        st.parts[rank].clear();
        st.parts[rank].extend_from_slice(buf);
        st.brought[rank] = true;
        if st.brought.iter().all(|&b| b) {
            let Round { parts, sum, .. } = &mut *st;
            sum.clear();
            sum.extend_from_slice(&parts[0]);
            let uneven = parts.iter().enumerate().find(|(_, p)| p.len() != sum.len());
            if let Some((k, p)) = uneven {
                let why = format!(
                    "tensor shard {k} brought {} values, shard 0 {}",
                    p.len(),
                    sum.len()
                );
                return Err(st.fail(&g.turn, why));
            }
            for p in &parts[1..] {
                sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
            }
            st.brought.fill(false);
            st.summed = true;
            g.turn.notify_all();
        }
        while !st.summed {
            st = g.wait(st, until, self.rank)?;
        }
        if st.sum.len() != buf.len() {
            let why = format!(
                "tensor shard {} has {} values, the sum {}",
                self.rank,
                buf.len(),
                st.sum.len()
            );
            return Err(st.fail(&g.turn, why));
        }
        buf.copy_from_slice(&st.sum);
        st.taken += 1;
        if st.taken == g.shards {
            st.summed = false;
            st.taken = 0;
            g.turn.notify_all();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_gets_the_sum_in_shard_order_round_after_round() {
        let group = LocalShards::new(3, Duration::from_secs(10));
        let parts: Vec<Vec<f32>> = (0..3)
            .map(|r| {
                (0..257)
                    .map(|i| (i as f32 * 0.37 + r as f32) * 1.3e-3)
                    .collect()
            })
            .collect();
        let want: Vec<f32> = (0..257)
            .map(|i| parts[0][i] + parts[1][i] + parts[2][i])
            .collect();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let link = group.link(r);
                let mine = parts[r].clone();
                std::thread::spawn(move || {
                    (0..20)
                        .map(|_| {
                            let mut b = mine.clone();
                            link.0.all_reduce(&mut b).map(|_| b)
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        for h in handles {
            for got in h.join().unwrap().unwrap() {
                assert!(got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn a_shard_whose_peers_never_come_fails_naming_the_wait() {
        let group = LocalShards::new(2, Duration::from_millis(50));
        let err = group.link(1).0.all_reduce(&mut [1.0]).unwrap_err();
        assert!(err.contains("tensor shard 1 waited"), "{err}");
        // The group stays failed: the late shard fails at once with the reason.
        let start = Instant::now();
        let late = group.link(0).0.all_reduce(&mut [1.0]).unwrap_err();
        assert_eq!(late, err);
        assert!(start.elapsed() < Duration::from_millis(40));
    }

    #[test]
    fn a_shard_bringing_another_length_fails_the_whole_group_at_once() {
        let group = LocalShards::new(2, Duration::from_secs(30));
        let other = group.link(1);
        let waiting = std::thread::spawn(move || other.0.all_reduce(&mut [1.0, 2.0]));
        std::thread::sleep(Duration::from_millis(20));
        let err = group.link(0).0.all_reduce(&mut [1.0]).unwrap_err();
        assert!(err.contains("brought 2 values, shard 0 1"), "{err}");
        assert_eq!(waiting.join().unwrap().unwrap_err(), err);
    }
}
