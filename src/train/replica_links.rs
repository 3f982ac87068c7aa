//! How each stage's data-parallel replicas that keep their state on their devices sum
//! their gradients without the host:
//!
//! - all of them in this process on one device: a group in device memory
//!   (`compute::ReplicaGroup`);
//! - each on a GPU of its own, in this process or across the job's processes: an NCCL
//!   communicator of the stage (`ReplicaLink::nccl`), its id made by the process that
//!   holds replica 0 and carried to the others over the job's bus;
//! - otherwise the engine's collective, through the host, as on the CPU: where a replica
//!   keeps its state on the host, where NCCL does not load, or where a GPU would hold two
//!   ranks (two members of one process, or two processes of one machine on one GPU,
//!   told apart by the machine's name: NCCL refuses two ranks on one GPU, and two
//!   communicators on one GPU may wait on each other).
//!
//! Every process must take the same way for a stage, so in a job of several processes
//! each says what its members of each stage can do ([`Here`]) in one gather over the bus,
//! and all decide from the same answers ([`decide`]); a second gather carries the ids.
//! Those gathers happen only where the configuration trains on a GPU with two replicas or
//! more and no tensor shards, which every process reads alike.
//!
//! What has run: the group, and the decisions and the ids' trip over a bus (tests on the
//! CPU). An NCCL communicator of two ranks or more has not run: the lent machines have one
//! GPU, on which NCCL refuses two ranks. Not handled: a process that fails while the
//! others wait in NCCL's initialization or all-reduce leaves them waiting (NCCL's
//! non-blocking initialization and an abort on the bus's failure would end it).

use std::collections::{BTreeMap, HashMap};

use pipetrain_actors::{ActorError, Bus};
use serde::{Deserialize, Serialize};

use crate::compute::{Device, ReplicaGroup, ReplicaLink, SessionOptions};
use crate::config::TrainConfig;
use crate::pipeline::StageSettings;
use crate::{Error, Result};

/// The device each (replica, stage) member of this process computes on.
pub(crate) type MemberDevices = HashMap<(usize, usize), Device>;

/// This process's (replica, stage) members, each with its settings.
pub(super) type Planned = [((usize, usize), StageSettings)];

/// The device of each (replica, stage) member of a run in one process, by
/// `runtime.devices` (empty: none, all on `runtime.device`): rank r, in the manifest's
/// order, on entry `r % len`. `placement` is the schedule's pipeline rank by stage.
pub(super) fn spread(
    cfg: &TrainConfig,
    owned: &[(usize, usize)],
    placement: &[usize],
) -> MemberDevices {
    let devices = &cfg.runtime.devices;
    let (hp, pp) = (
        cfg.horizontal_parallel_size,
        placement.iter().max().map_or(1, |k| k + 1),
    );
    let mut out = MemberDevices::new();
    for &(replica, stage) in owned.iter().filter(|_| !devices.is_empty()) {
        let (dp, tp, k) = (replica / hp, replica % hp, placement[stage]);
        let rank = (dp * pp + k) * hp + tp;
        out.insert((replica, stage), devices[rank % devices.len()]);
    }
    out
}

/// What a process's members of one stage can do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Here {
    /// No member of the stage runs here.
    Absent,
    /// Every replica of the stage runs here, on one device, keeping its state there.
    OneDevice,
    /// The members here keep their state each on a GPU of its own, which no other member
    /// of this process uses, named for the others (`host/cuda:N`): NCCL refuses two
    /// ranks on one GPU, and two communicators on one GPU may wait on each other.
    OwnGpus(Vec<String>),
    /// A member keeps its state on the host, shares its GPU, or NCCL is missing here.
    Cannot,
}

/// How one stage's replicas sum their gradients, as every process decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Way {
    /// In this process's device memory (`ReplicaGroup`).
    Group,
    /// By an NCCL communicator made from this id.
    Nccl([u8; 128]),
    /// Through the host, by the engine's collective.
    Host,
}

/// What the `members` here (replica, device, whether its state fits its device) of a
/// stage with `replicas` replicas can do. `gpu_name` names GPU `i` for the other
/// processes, or is `None` where it may not take an NCCL rank (another member of this
/// process uses it, or NCCL is missing).
pub(super) fn here(
    members: &[(usize, Device, bool)],
    replicas: usize,
    gpu_name: &dyn Fn(usize) -> Option<String>,
) -> Here {
    let Some(&(_, first, _)) = members.first() else {
        return Here::Absent;
    };
    if !members.iter().all(|&(_, _, fits)| fits) {
        return Here::Cannot;
    }
    if members.len() == replicas && members.iter().all(|&(_, d, _)| d == first) {
        return Here::OneDevice;
    }
    let names: Option<Vec<String>> = members
        .iter()
        .map(|&(_, d, _)| match d {
            Device::Cuda(i) => gpu_name(i),
            Device::Cpu => None,
        })
        .collect();
    match names {
        Some(names) if distinct(&names) => Here::OwnGpus(names),
        _ => Here::Cannot,
    }
}

fn distinct(names: &[String]) -> bool {
    let set: std::collections::BTreeSet<&String> = names.iter().collect();
    set.len() == names.len()
}

/// The way every process takes for a stage, from what each process's members of it can
/// do (`all`, by process): NCCL only where no process holds back and no GPU is named
/// twice (two processes of one machine on one GPU). An NCCL way's id is zeros here;
/// [`agree`] puts in the one the process holding replica 0 made.
pub(super) fn decide(all: &[&Here]) -> Way {
    let present: Vec<&Here> = all
        .iter()
        .copied()
        .filter(|h| **h != Here::Absent)
        .collect();
    let mut gpus = Vec::new();
    for h in &present {
        match h {
            Here::OwnGpus(names) => gpus.extend(names.iter().cloned()),
            Here::OneDevice if present.len() == 1 => return Way::Group,
            _ => return Way::Host,
        }
    }
    match !gpus.is_empty() && distinct(&gpus) {
        true => Way::Nccl([0; 128]),
        false => Way::Host,
    }
}

/// Every stage's way, each process telling the others over `bus` (`None`: this process
/// runs the whole job) what its members can do (`mine`, by stage). The id of each NCCL
/// stage comes from `make_id` in the process that holds its replica 0 (`roots`, by
/// stage, whether that is this one).
///
/// # Errors
/// `Runtime` when the bus breaks or a process sends what does not decode; `Device` where
/// the id cannot be made, in the process that makes it (the others say which failed).
pub(super) async fn agree(
    bus: Option<&dyn Bus>,
    mine: &[Here],
    roots: &[bool],
    make_id: &(dyn Fn() -> Result<[u8; 128]> + Sync),
) -> Result<Vec<Way>> {
    let all: Vec<Vec<Here>> = match bus {
        Some(bus) => gather(bus, "replica links", &mine.to_vec()).await?,
        None => vec![mine.to_vec()],
    };
    if let Some(node) = all.iter().position(|h| h.len() != mine.len()) {
        return Err(Error::runtime(ActorError::Peer {
            reason: format!(
                "node {node} sent {} stages' replica links, not {}",
                all[node].len(),
                mine.len()
            ),
        }));
    }
    let mut ways: Vec<Way> = (0..mine.len())
        .map(|s| decide(&all.iter().map(|h| &h[s]).collect::<Vec<_>>()))
        .collect();
    let mut ids: Vec<Option<Vec<u8>>> = vec![None; ways.len()];
    let mut failure = None;
    for (s, way) in ways.iter().enumerate() {
        if matches!(way, Way::Nccl(_)) && roots[s] {
            match make_id() {
                Ok(id) => ids[s] = Some(id.to_vec()),
                Err(e) => failure = Some(e),
            }
        }
    }
    let all_ids = match bus {
        Some(bus) => gather(bus, "nccl ids", &ids).await?,
        None => vec![ids],
    };
    if let Some(e) = failure {
        return Err(e);
    }
    for (s, way) in ways.iter_mut().enumerate() {
        if let Way::Nccl(id) = way {
            let given = all_ids.iter().find_map(|ids| ids.get(s).cloned().flatten());
            *id = given
                .and_then(|bytes| bytes.try_into().ok())
                .ok_or_else(|| Error::Device {
                    device: format!("stage {s}'s data-parallel replicas"),
                    reason: "the process holding replica 0 sent no NCCL id".into(),
                })?;
        }
    }
    Ok(ways)
}

/// Every process's `data` for `key` over `bus`, as JSON.
async fn gather<T: Serialize + for<'de> Deserialize<'de>>(
    bus: &dyn Bus,
    key: &str,
    data: &T,
) -> Result<Vec<T>> {
    let peer = |reason: String| Error::runtime(ActorError::Peer { reason });
    let bytes = serde_json::to_vec(data).map_err(|e| peer(format!("`{key}`: {e}")))?;
    let all = bus
        .all_gather(key.into(), bytes)
        .await
        .map_err(Error::runtime)?;
    all.iter()
        .enumerate()
        .map(|(node, b)| {
            serde_json::from_slice(b)
                .map_err(|e| peer(format!("node {node} sent a bad `{key}` message: {e}")))
        })
        .collect()
}

/// Gives each stage's replicas that keep their state on their devices a way to sum their
/// gradients there (see the module's doc); such a stage goes without gradient buckets.
/// `planned` are this process's members; `stages` the pipeline's stage count; `bus` the
/// job's, where it has several processes.
///
/// # Errors
/// As [`agree`]; `Device` where NCCL cannot make a communicator.
pub(super) async fn join_device_replicas(
    cfg: &TrainConfig,
    opts: &SessionOptions,
    (planned, devices): (&mut Planned, &MemberDevices),
    stages: usize,
    bus: Option<&dyn Bus>,
) -> Result<()> {
    let device_of = |key: &(usize, usize)| devices.get(key).copied().unwrap_or(opts.device);
    if cfg.debug.nccl_one_rank {
        return join_one_rank_nccl(opts, planned, &device_of).await;
    }
    let d = cfg.data_parallel_size;
    if d < 2 || cfg.horizontal_parallel_size > 1 {
        return Ok(());
    }
    let mut by_stage: BTreeMap<usize, Vec<(usize, Device, bool)>> = BTreeMap::new();
    for (key, st) in planned.iter() {
        let device = device_of(key);
        let fits = crate::pipeline::state_fits_device(&SessionOptions { device, ..*opts }, st);
        by_stage
            .entry(key.1)
            .or_default()
            .push((key.0, device, fits));
    }
    let members = |s: usize| by_stage.get(&s).map_or(&[][..], Vec::as_slice);
    // Only a job on GPUs asks the others: every process reads the same configuration.
    let bus = bus.filter(|_| cfg.runtime.device != Device::Cpu);
    let gpu_name = gpu_names(planned, &device_of);
    // Asking no one, a stage can do without the host only with all its replicas here.
    let mine: Vec<Here> = (0..stages)
        .map(|s| match here(members(s), d, &gpu_name) {
            Here::OwnGpus(_) if bus.is_none() && members(s).len() < d => Here::Cannot,
            h => h,
        })
        .collect();
    let roots: Vec<bool> = (0..stages)
        .map(|s| members(s).iter().any(|&(r, _, _)| r == 0))
        .collect();
    let ways = agree(bus, &mine, &roots, &ReplicaLink::nccl_id).await?;
    for (s, way) in ways.into_iter().enumerate() {
        let local: Vec<(usize, Device)> = members(s).iter().map(|&(r, dv, _)| (r, dv)).collect();
        let links = match (&way, local.is_empty()) {
            (Way::Host, _) | (_, true) => continue,
            (Way::Group, false) => {
                let group = ReplicaGroup::new(d);
                local.iter().map(|&(r, _)| group.link(r)).collect()
            }
            (Way::Nccl(id), false) => nccl_links(&local, d, *id).await?,
        };
        for ((r, _), link) in local.iter().zip(links) {
            let (_, st) = (planned.iter_mut())
                .find(|((replica, stage), _)| (*replica, *stage) == (*r, s))
                .expect("a member of this process");
            st.replicas = Some(link);
            st.bucket_bytes = 0;
        }
        match way {
            Way::Group => tracing::info!(
                "stage {s}: its {d} data-parallel replicas sum their gradients in device memory"
            ),
            _ => tracing::info!(
                "stage {s}: its {d} data-parallel replicas sum their gradients by NCCL ({} here)",
                local.len()
            ),
        }
    }
    Ok(())
}

/// Names GPU `i` for the other processes (`host/cuda:i`), where it may take an NCCL
/// rank: NCCL loads here, and no more than one of the `planned` members uses it.
fn gpu_names(
    planned: &Planned,
    device_of: &dyn Fn(&(usize, usize)) -> Device,
) -> impl Fn(usize) -> Option<String> {
    let mut users: HashMap<usize, usize> = HashMap::new();
    for (key, _) in planned {
        if let Device::Cuda(i) = device_of(key) {
            *users.entry(i).or_default() += 1;
        }
    }
    let nccl = match users.values().any(|&n| n == 1) {
        true => ReplicaLink::nccl_ready(),
        false => Ok(()),
    };
    if let Err(why) = &nccl {
        tracing::warn!("replicas on GPUs of their own reduce through the host: {why}");
    }
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    move |i| (nccl.is_ok() && users.get(&i) == Some(&1)).then(|| format!("{host}/cuda:{i}"))
}

/// This process's NCCL links of a stage's `local` (replica, device) members, of
/// `replicas` in all: made on a blocking thread, since NCCL's initialization waits for
/// every rank of the job.
async fn nccl_links(
    local: &[(usize, Device)],
    replicas: usize,
    id: [u8; 128],
) -> Result<Vec<ReplicaLink>> {
    let ranks: Vec<(Device, usize)> = local.iter().map(|&(r, d)| (d, r)).collect();
    tokio::task::spawn_blocking(move || ReplicaLink::nccl(&ranks, replicas, id))
        .await
        .map_err(|e| Error::Device {
            device: format!(
                "{:?}",
                local.iter().map(|(_, d)| d.to_string()).collect::<Vec<_>>()
            ),
            reason: format!("making an NCCL communicator: {e}"),
        })?
}

/// `debug.nccl_one_rank`: each stage that keeps its state on its device sums its
/// gradients every step through a one-rank NCCL communicator of its own, made as a
/// stage's communicator of several ranks is ([`nccl_links`]).
async fn join_one_rank_nccl(
    opts: &SessionOptions,
    planned: &mut Planned,
    device_of: &(dyn Fn(&(usize, usize)) -> Device + Sync),
) -> Result<()> {
    for (key, st) in planned.iter_mut() {
        let device = device_of(key);
        if !crate::pipeline::state_fits_device(&SessionOptions { device, ..*opts }, st) {
            continue;
        }
        let id = ReplicaLink::nccl_id()?;
        st.replicas = nccl_links(&[(0, device)], 1, id).await?.pop();
        st.bucket_bytes = 0;
        tracing::info!(
            "stage {}: its gradients summed by a one-rank NCCL communicator each step",
            key.1
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
