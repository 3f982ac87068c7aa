//! In-process AllReduce over shared memory: one group per pipeline stage; the replicas of
//! the stage reduce together, each on its own thread.
//!
//! A reduce-scatter then an all-gather, as a ring all-reduce does across machines, but
//! through memory: every replica lends its buffer to the group; replica `r` sums chunk `r`
//! of all buffers into its own buffer (in replica order, so every replica gets the same
//! bits, the same ones a sequential sum in replica order gives); after a barrier each
//! replica copies the other chunks' sums into its own buffer. The replicas' threads share
//! the work, and nothing is allocated or copied twice.
//!
//! Written with raw pointers into the lent buffers: the phases touch disjoint regions
//! (the `SAFETY` notes say which), which borrowing whole buffers cannot express.

use std::sync::{Arc, Mutex};

use tokio::sync::Barrier;
use tokio::task::JoinSet;

use crate::error::ActorError;
use crate::traits::Collective;

/// A replica's buffer lent to its group for one round: where it is and how long.
#[derive(Clone, Copy)]
struct Lent {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: a `Lent` is only dereferenced inside one all-reduce round, while its owner is
// blocked in the same round (between the first and the last barrier), and only on
// regions no other replica writes at the same time (see `Group::all_reduce`).
unsafe impl Send for Lent {}
unsafe impl Sync for Lent {}

/// One stage's replicas reducing together.
struct Group {
    replicas: usize,
    /// The buffers lent for the round in progress, by replica.
    lent: Mutex<Vec<Option<Lent>>>,
    /// Everyone has lent; everyone has summed its chunk; everyone has gathered.
    lent_all: Barrier,
    summed_all: Barrier,
    gathered_all: Barrier,
}

/// The collectives of replicas that share one process (threads of one machine).
#[derive(Clone)]
pub struct LocalCollective {
    replicas: usize,
    /// Tensor shards per data-parallel replica: the same shard of every data-parallel
    /// replica reduces together.
    shards: usize,
    /// By `stage * shards + shard`.
    groups: Vec<Arc<Group>>,
}

impl LocalCollective {
    /// One group per stage. (`tasks` is unused: the replicas do the work themselves; it
    /// stays for the engine's uniform start-up.)
    pub fn spawn(
        stages: usize,
        replicas: usize,
        _tasks: &mut JoinSet<Result<(), ActorError>>,
    ) -> LocalCollective {
        Self::groups(stages, replicas, 1)
    }

    /// One group per (stage, tensor shard) of `replicas / shards` data-parallel
    /// replicas (see [`crate::EngineSettings::shards`]).
    ///
    /// # Errors
    /// `Settings` when `shards` does not divide `replicas`.
    pub fn sharded(
        stages: usize,
        replicas: usize,
        shards: usize,
    ) -> Result<LocalCollective, ActorError> {
        if shards == 0 || replicas % shards != 0 {
            return Err(ActorError::Settings {
                reason: format!("{replicas} replicas are not a multiple of {shards} tensor shards"),
            });
        }
        Ok(Self::groups(stages, replicas, shards))
    }

    fn groups(stages: usize, replicas: usize, shards: usize) -> LocalCollective {
        let members = replicas / shards;
        let groups = (0..stages * shards)
            .map(|_| {
                Arc::new(Group {
                    replicas: members,
                    lent: Mutex::new(vec![None; members]),
                    lent_all: Barrier::new(members),
                    summed_all: Barrier::new(members),
                    gathered_all: Barrier::new(members),
                })
            })
            .collect();
        LocalCollective {
            replicas,
            shards,
            groups,
        }
    }
}

/// Values summed at a time (16 KiB: stays in the first-level cache).
const BLOCK: usize = 4096;

/// The half-open range of chunk `r` of `d` chunks over `n` values.
fn chunk(n: usize, d: usize, r: usize) -> std::ops::Range<usize> {
    (n * r / d)..(n * (r + 1) / d)
}

impl Group {
    fn protocol(&self, replica: usize, stage: usize, reason: String) -> ActorError {
        ActorError::Protocol {
            replica,
            rank: stage,
            reason,
        }
    }

    /// One round, from replica `replica`. Who touches what (chunk `c` of buffer `b`):
    /// - reduce-scatter: replica `r` reads chunk `r` of every buffer and writes chunk `r`
    ///   of its own; no one else touches chunk `r` of any buffer then;
    /// - all-gather: replica `r` reads chunk `s` of buffer `s` (the sum replica `s` made)
    ///   and writes it to chunk `s` of its own, for every `s != r`; chunk `s` of buffer
    ///   `s` is only read then, and chunk `s` of buffer `r` only written by `r`.
    ///
    /// Barriers separate the phases, and the last one keeps every buffer alive until no
    /// one reads it any more.
    async fn all_reduce(
        &self,
        stage: usize,
        replica: usize,
        mut buf: Vec<f32>,
    ) -> Result<Vec<f32>, ActorError> {
        let d = self.replicas;
        if replica >= d {
            return Err(self.protocol(replica, stage, format!("not a replica of {d}")));
        }
        let n = buf.len();
        let (all, uneven) = self.lend_all(stage, replica, &mut buf).await?;
        if uneven.is_none() {
            // SAFETY: chunk `replica` of every buffer is touched by this replica alone in
            // this phase (see above); every owner is blocked in this round.
            unsafe { sum_into(&all, replica, chunk(n, d, replica)) };
        }
        self.summed_all.wait().await;
        if uneven.is_none() {
            // SAFETY: as above, for the all-gather phase.
            unsafe { copy_others(&all, replica, |s| chunk(n, d, s)) };
        }
        self.gathered_all.wait().await;
        self.take_back(stage, replica, buf, (&all, uneven), "gradient")
    }

    /// One reduce-scatter round, from member `member`: it sums part `parts[member]` of
    /// every buffer into its own, as the first phase of [`Group::all_reduce`] does with
    /// its chunk (the same order, so the same bits). The parts are disjoint (checked
    /// first), so no two members touch the same values; the second barrier keeps every
    /// buffer alive until no one reads it.
    async fn reduce_scatter(
        &self,
        stage: usize,
        member: usize,
        mut buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        self.check_parts(stage, member, parts, buf.len())?;
        let (all, uneven) = self.lend_all(stage, member, &mut buf).await?;
        if uneven.is_none() {
            // SAFETY: part `member` of every buffer is touched by this member alone in
            // this round; every owner is blocked in it.
            unsafe { sum_into(&all, member, parts[member].clone()) };
        }
        self.summed_all.wait().await;
        self.take_back(stage, member, buf, (&all, uneven), "gradient")
    }

    /// Refuses parts that are not one disjoint range per member within `len` values.
    fn check_parts(
        &self,
        stage: usize,
        member: usize,
        parts: &[std::ops::Range<usize>],
        len: usize,
    ) -> Result<(), ActorError> {
        if parts.len() == self.replicas && disjoint_within(parts, len) {
            return Ok(());
        }
        Err(self.protocol(
            member,
            stage,
            format!(
                "parts {parts:?} are not {} disjoint ranges within {len} values",
                self.replicas
            ),
        ))
    }

    /// One all-gather round, from member `member`: it copies part `s` of buffer `s`
    /// into its own buffer for every `s != member`. Part `s` of buffer `s` is only read
    /// in this round, and the other parts of a buffer only written by its owner; the
    /// parts are disjoint (checked first). The barriers keep every buffer alive until
    /// no one reads it.
    async fn all_gather(
        &self,
        stage: usize,
        member: usize,
        mut buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        self.check_parts(stage, member, parts, buf.len())?;
        let (all, uneven) = self.lend_all(stage, member, &mut buf).await?;
        if uneven.is_none() {
            // SAFETY: see above.
            unsafe { copy_others(&all, member, |s| parts[s].clone()) };
        }
        self.gathered_all.wait().await;
        self.take_back(stage, member, buf, (&all, uneven), "parameters")
    }

    /// Lends `buf` to the round, waits for every member's, and returns them all (in
    /// member order) with the first member whose buffer is of another length.
    async fn lend_all(
        &self,
        stage: usize,
        member: usize,
        buf: &mut [f32],
    ) -> Result<(Vec<Lent>, Option<usize>), ActorError> {
        self.lend(stage, member, buf)?;
        self.lent_all.wait().await;
        let all: Vec<Lent> = {
            let lent = self.lent.lock().map_err(|_| self.poisoned(stage))?;
            lent.iter().flatten().copied().collect()
        };
        let uneven = all.iter().position(|b| b.len != buf.len());
        Ok((all, uneven))
    }

    /// Ends `member`'s part in the round (after its last barrier): takes `buf` back, or
    /// names the member whose `what` was of another length.
    fn take_back(
        &self,
        stage: usize,
        member: usize,
        mut buf: Vec<f32>,
        (all, uneven): (&[Lent], Option<usize>),
        what: &str,
    ) -> Result<Vec<f32>, ActorError> {
        self.lent.lock().map_err(|_| self.poisoned(stage))?[member] = None;
        if let Some(r) = uneven {
            let (got, n) = (all[r].len, buf.len());
            return Err(self.protocol(
                r,
                stage,
                format!("{what} of {got} values, replica {member} has {n}"),
            ));
        }
        // Nobody holds a pointer into `buf` any more.
        Ok(std::mem::take(&mut buf))
    }

    /// Lends `buf` to the round in progress.
    fn lend(&self, stage: usize, member: usize, buf: &mut [f32]) -> Result<(), ActorError> {
        let mut lent = self.lent.lock().map_err(|_| self.poisoned(stage))?;
        if lent[member].is_some() {
            return Err(self.protocol(member, stage, "contributed twice to one round".into()));
        }
        lent[member] = Some(Lent {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        });
        Ok(())
    }

    fn poisoned(&self, stage: usize) -> ActorError {
        ActorError::ActorGone {
            actor: format!("all-reduce group of stage {stage} (a replica panicked)"),
        }
    }
}

impl LocalCollective {
    /// The group `replica` of `stage` reduces in, and its place there; `None` when each
    /// group has one member (nothing to do).
    fn group_of(
        &self,
        stage: usize,
        replica: usize,
    ) -> Result<Option<(&Group, usize)>, ActorError> {
        if self.replicas == self.shards {
            return Ok(None);
        }
        let group = self
            .groups
            .get(stage * self.shards + replica % self.shards)
            .ok_or_else(|| ActorError::ActorGone {
                actor: format!("collective group of stage {stage}"),
            })?;
        Ok(Some((group, replica / self.shards)))
    }
}

impl Collective for LocalCollective {
    async fn all_reduce_sum(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
    ) -> Result<Vec<f32>, ActorError> {
        match self.group_of(stage, replica)? {
            Some((group, member)) => group.all_reduce(stage, member, buf).await,
            None => Ok(buf),
        }
    }

    async fn reduce_scatter(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        match self.group_of(stage, replica)? {
            Some((group, member)) => group.reduce_scatter(stage, member, buf, parts).await,
            None => Ok(buf),
        }
    }

    async fn all_gather(
        &self,
        stage: usize,
        replica: usize,
        buf: Vec<f32>,
        parts: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ActorError> {
        match self.group_of(stage, replica)? {
            Some((group, member)) => group.all_gather(stage, member, buf, parts).await,
            None => Ok(buf),
        }
    }
}

/// Sums `range` of every buffer of `all` (in their order) into `range` of buffer `own`,
/// block by block through a small buffer: each block of every input is read (own
/// values included) before the sum is written over the own block.
///
/// # Safety
/// Every buffer of `all` is alive and at least `range.end` long, and no one else
/// touches `range` of any of them meanwhile.
unsafe fn sum_into(all: &[Lent], own: usize, range: std::ops::Range<usize>) {
    let mut tmp = [0.0f32; BLOCK];
    let mut at = range.start;
    while at < range.end {
        let len = BLOCK.min(range.end - at);
        let t = &mut tmp[..len];
        // SAFETY: within the buffers (the caller's promise), and not written by anyone
        // else meanwhile.
        unsafe {
            t.copy_from_slice(std::slice::from_raw_parts(all[0].ptr.add(at), len));
            for b in &all[1..] {
                let x = std::slice::from_raw_parts(b.ptr.add(at), len);
                t.iter_mut().zip(x).for_each(|(s, v)| *s += v);
            }
            std::slice::from_raw_parts_mut(all[own].ptr.add(at), len).copy_from_slice(t);
        }
        at += len;
    }
}

/// Copies `part(s)` of buffer `s` into the same range of buffer `own`, for every `s`
/// but `own`.
///
/// # Safety
/// Every buffer of `all` is alive and holds every part; `part(s)` of buffer `s` is not
/// written meanwhile, and no one else touches buffer `own` outside `part(own)`.
unsafe fn copy_others(all: &[Lent], own: usize, part: impl Fn(usize) -> std::ops::Range<usize>) {
    for (s, b) in all.iter().enumerate().filter(|&(s, _)| s != own) {
        let range = part(s);
        // SAFETY: the caller's promise.
        unsafe {
            let from = std::slice::from_raw_parts(b.ptr.add(range.start), range.len());
            let to = std::slice::from_raw_parts_mut(all[own].ptr.add(range.start), range.len());
            to.copy_from_slice(from);
        }
    }
}

/// Whether `parts` are in order, do not overlap and end within `len`.
pub(crate) fn disjoint_within(parts: &[std::ops::Range<usize>], len: usize) -> bool {
    let ordered = parts.windows(2).all(|w| w[0].end <= w[1].start);
    ordered && parts.iter().all(|p| p.start <= p.end && p.end <= len)
}

#[cfg(test)]
mod tests;
