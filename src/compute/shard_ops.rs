//! The tensor shards' collectives as ONNX Runtime custom operators (domain
//! `ai.pipetrain`; see [`crate::graph::tensor_parallel`]), and the in-process group
//! they sum through.
//!
//! A kernel blocks until every shard of its group brought its tensor: each shard's
//! sessions run on the thread of its own stage actor, so the shards meet inside their
//! sessions as the data-parallel replicas meet in their all-reduce. The sum is taken in
//! shard order by one shard and copied by the others, so every shard gets the same
//! bits (as the replicas' all-reduce does). Written here because no crate offers an
//! in-process blocking all-reduce over borrowed slices.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorDomain, OperatorInput,
    OperatorOutput,
};
use ort::value::TensorElementType;

use crate::graph::custom_ops::{ALL_REDUCE, DOMAIN, SHARD_ENTRY};

/// One shard's end of its group's all-reduce.
pub trait ShardComm: Send + Sync + 'static {
    /// Shards in the group.
    fn shards(&self) -> usize;

    /// This shard's rank in the group.
    fn rank(&self) -> usize;

    /// Sums `buf` over the group's shards in shard order, in place.
    ///
    /// # Errors
    /// When a shard is gone, brings a tensor of another length, or does not come.
    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), String>;

    /// What this shard's all-reduces have carried so far.
    fn traffic(&self) -> ShardTraffic {
        ShardTraffic::default()
    }
}

/// What a tensor shard's all-reduces carried: how many, how many bytes it brought, and
/// the time spent in them (waiting for the other shards included).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardTraffic {
    /// All-reduces.
    pub calls: u64,
    /// Bytes this shard brought to them.
    pub bytes: u64,
    /// Seconds spent in them.
    pub seconds: f64,
}

impl std::ops::Add for ShardTraffic {
    type Output = ShardTraffic;
    fn add(self, o: ShardTraffic) -> ShardTraffic {
        ShardTraffic {
            calls: self.calls + o.calls,
            bytes: self.bytes + o.bytes,
            seconds: self.seconds + o.seconds,
        }
    }
}

/// A shard's running [`ShardTraffic`], counted by its comm.
#[derive(Debug, Default)]
pub(crate) struct TrafficMeter {
    calls: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
    nanos: std::sync::atomic::AtomicU64,
}

impl TrafficMeter {
    /// Counts one all-reduce of `values` that took from `start` until now.
    pub(crate) fn count(&self, values: usize, start: Instant) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.bytes.fetch_add(values as u64 * 4, Relaxed);
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    pub(crate) fn read(&self) -> ShardTraffic {
        use std::sync::atomic::Ordering::Relaxed;
        ShardTraffic {
            calls: self.calls.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            seconds: self.nanos.load(Relaxed) as f64 * 1e-9,
        }
    }
}

/// A shard's collective handle, as sessions are given it.
#[derive(Clone)]
pub struct ShardLink(pub Arc<dyn ShardComm>);

impl fmt::Debug for ShardLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ShardLink(shard {} of {})",
            self.0.rank(),
            self.0.shards()
        )
    }
}

impl ShardLink {
    /// A group of one (shape probes, and graphs run outside a sharded run): the sum is
    /// the tensor itself.
    pub fn alone() -> ShardLink {
        ShardLink(Arc::new(Alone))
    }
}

struct Alone;

impl ShardComm for Alone {
    fn shards(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn all_reduce(&self, _buf: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
}

/// pipetrain's operator domain: both collectives bound to `link`, and the fused
/// kernels.
pub(crate) fn custom_domain(link: &ShardLink) -> ort::Result<OperatorDomain> {
    OperatorDomain::new(DOMAIN)?
        .add(Collective {
            link: link.clone(),
            sums: true,
        })?
        .add(Collective {
            link: link.clone(),
            sums: false,
        })?
        .add(super::fused_ops::LayerNormGrad)?
        .add(super::fused_ops::SoftmaxGrad)
}

/// `AllReduce` (`sums`) or `ShardEntry` (the identity forward).
struct Collective {
    link: ShardLink,
    sums: bool,
}

impl Operator for Collective {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        if self.sums {
            ALL_REDUCE
        } else {
            SHARD_ENTRY
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        let link = self.link.clone();
        let sums = self.sums;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let x = ctx.input(0)?.ok_or_else(|| ort::Error::new("no input"))?;
            let (shape, xs) = x.try_extract_tensor::<f32>()?;
            let mut y = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("no output"))?;
            let (_, ys) = y.try_extract_tensor_mut::<f32>()?;
            ys.copy_from_slice(xs);
            if sums {
                link.0.all_reduce(ys).map_err(ort::Error::new)?;
            }
            Ok(())
        }))
    }
}

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
    parts: Vec<Option<Vec<f32>>>,
    sum: Option<Arc<Vec<f32>>>,
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
                parts: vec![None; shards],
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
        while st.sum.is_some() {
            st = g.wait(st, until, self.rank)?;
        }
        if st.parts[self.rank].is_some() {
            let why = format!("tensor shard {} contributed twice", self.rank);
            return Err(st.fail(&g.turn, why));
        }
        st.parts[self.rank] = Some(buf.to_vec());
        if st.parts.iter().all(Option::is_some) {
            let mut parts = st.parts.iter_mut().map(|p| p.take().unwrap_or_default());
            let mut sum = parts.next().unwrap_or_default();
            let mut uneven = None;
            for (k, p) in parts.enumerate() {
                if p.len() != sum.len() {
                    uneven.get_or_insert((k + 1, p.len()));
                    continue;
                }
                sum.iter_mut().zip(&p).for_each(|(s, v)| *s += v);
            }
            if let Some((k, n)) = uneven {
                let why = format!("tensor shard {k} brought {n} values, shard 0 {}", sum.len());
                return Err(st.fail(&g.turn, why));
            }
            st.sum = Some(Arc::new(sum));
            g.turn.notify_all();
        }
        while st.sum.is_none() {
            st = g.wait(st, until, self.rank)?;
        }
        let sum = st.sum.clone().unwrap_or_default();
        if sum.len() != buf.len() {
            let why = format!(
                "tensor shard {} has {} values, the sum {}",
                self.rank,
                buf.len(),
                sum.len()
            );
            return Err(st.fail(&g.turn, why));
        }
        buf.copy_from_slice(&sum);
        st.taken += 1;
        if st.taken == g.shards {
            st.sum = None;
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
