#[cfg(feature = "cluster")]
use std::sync::Arc;
#[cfg(feature = "cluster")]
use std::time::Duration;

use super::*;
#[cfg(feature = "cluster")]
use crate::comm::{Mesh, MeshBus, MeshTimeouts};
use crate::pipeline::HistogramTap;
use crate::train::settings::{replica_settings, session_options, stage_settings};

#[cfg(feature = "cluster")]
const SECRET: &[u8] = b"replica links test secret, 32 bytes+";

/// The built-in MLP's configuration, `tail` (tables) after the rest, parsed.
fn parse(tail: &str) -> Result<TrainConfig> {
    crate::train::settings::tests::parse("", tail)
}

fn config(tail: &str) -> TrainConfig {
    parse(tail).unwrap()
}

/// GPU `i` named as machine `m` would name it, for every GPU but cuda:9 (shared here).
fn named(m: &'static str) -> impl Fn(usize) -> Option<String> {
    move |i| (i != 9).then(|| format!("{m}/cuda:{i}"))
}

fn own(names: &[&str]) -> Here {
    Here::OwnGpus(names.iter().map(|n| n.to_string()).collect())
}

#[test]
fn what_a_process_can_do_follows_its_members_devices_and_state() {
    let (cpu, g0, g1, g9) = (
        Device::Cpu,
        Device::Cuda(0),
        Device::Cuda(1),
        Device::Cuda(9),
    );
    let m = named("m");
    assert_eq!(here(&[], 2, &m), Here::Absent);
    assert_eq!(
        here(&[(0, g0, true), (1, g0, true)], 2, &m),
        Here::OneDevice
    );
    assert_eq!(
        here(&[(0, cpu, true), (1, cpu, true)], 2, &m),
        Here::OneDevice
    );
    let both = here(&[(0, g0, true), (1, g1, true)], 2, &m);
    assert_eq!(both, own(&["m/cuda:0", "m/cuda:1"]));
    // One of two replicas here, on a GPU: the other is elsewhere.
    assert_eq!(here(&[(1, g1, true)], 2, &m), own(&["m/cuda:1"]));
    assert_eq!(here(&[(1, cpu, true)], 2, &m), Here::Cannot);
    // Two of three on one GPU, the third elsewhere: NCCL refuses two ranks on one GPU.
    assert_eq!(here(&[(0, g0, true), (1, g0, true)], 3, &m), Here::Cannot);
    assert_eq!(here(&[(0, g0, true), (1, g1, false)], 2, &m), Here::Cannot);
    // A GPU that another member of this process uses (or without NCCL) takes no rank.
    assert_eq!(here(&[(1, g9, true)], 2, &m), Here::Cannot);
}

#[test]
fn nccl_is_chosen_only_where_no_process_holds_back_and_no_gpu_is_named_twice() {
    use Here::*;
    let (a0, b0) = (own(&["a/cuda:0"]), own(&["b/cuda:0"]));
    assert_eq!(decide(&[&OneDevice, &Absent]), Way::Group);
    assert_eq!(decide(&[&a0, &b0]), Way::Nccl([0; 128]));
    assert_eq!(
        decide(&[&Absent, &own(&["a/cuda:0", "a/cuda:1"])]),
        Way::Nccl([0; 128])
    );
    // Two processes of one machine on one GPU.
    assert_eq!(decide(&[&a0, &a0.clone()]), Way::Host);
    assert_eq!(decide(&[&a0, &Cannot]), Way::Host);
    assert_eq!(decide(&[&Cannot, &Absent]), Way::Host);
    assert_eq!(decide(&[&Absent, &Absent]), Way::Host);
}

/// Two processes joined by a real mesh on loopback.
#[cfg(feature = "cluster")]
async fn two_buses() -> Vec<Arc<MeshBus>> {
    let listeners: Vec<_> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    drop(listeners);
    let names: Vec<String> = vec!["a".into(), "b".into()];
    let timeouts = MeshTimeouts {
        connect: Duration::from_secs(10),
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_secs(10),
    };
    let joins: Vec<_> = (0..2)
        .map(|i| {
            let (addrs, names) = (addrs.clone(), names.clone());
            tokio::spawn(async move {
                Mesh::connect(i, "t", addrs[i], addrs, names, SECRET, timeouts).await
            })
        })
        .collect();
    let mut buses = Vec::new();
    for j in joins {
        buses.push(Arc::new(MeshBus::new(j.await.unwrap().unwrap())));
    }
    buses
}

#[cfg(feature = "cluster")]
/// Process `node`'s ways for three stages over `bus`: stage 0 on own GPUs in both,
/// stage 1 held back by process 1, stage 2 only in process 0 on one device. Process 0
/// holds replica 0 of stage 0; its ids are `id_byte` repeated, or it fails to make one.
async fn ways_of(bus: Arc<MeshBus>, node: usize, id_byte: Option<u8>) -> Result<Vec<Way>> {
    use Here::*;
    let mine = match node {
        0 => [own(&["a/cuda:0"]), own(&["a/cuda:1"]), OneDevice],
        _ => [own(&["b/cuda:0"]), Cannot, Absent],
    };
    let roots = [node == 0, node == 0, node == 0];
    let make_id = move || match id_byte {
        Some(b) => Ok([b; 128]),
        None => Err(Error::Device {
            device: "cuda:0".into(),
            reason: "no NCCL here".into(),
        }),
    };
    agree(Some(bus.as_ref()), &mine, &roots, &make_id).await
}

#[cfg(feature = "cluster")]
/// Over a real bus, both processes reach the same ways, and the id process 0 made
/// reaches process 1; where process 0 cannot make it, each says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_agree_on_ways_and_carry_the_id_over_the_bus() {
    let buses = two_buses().await;
    let (a, b) = (
        tokio::spawn(ways_of(buses[0].clone(), 0, Some(7))),
        tokio::spawn(ways_of(buses[1].clone(), 1, Some(9))),
    );
    let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    assert_eq!(a, [Way::Nccl([7; 128]), Way::Host, Way::Group]);
    assert_eq!(
        b, a,
        "both processes take the same ways, with process 0's id"
    );
    let (a, b) = (
        tokio::spawn(ways_of(buses[0].clone(), 0, None)),
        tokio::spawn(ways_of(buses[1].clone(), 1, Some(9))),
    );
    let a = a.await.unwrap().unwrap_err().to_string();
    let b = b.await.unwrap().unwrap_err().to_string();
    assert!(a.contains("no NCCL here"), "{a}");
    assert!(
        b.contains("stage 0") && b.contains("sent no NCCL id"),
        "{b}"
    );
}

/// This process's `owned` members of the built-in MLP's one stage under `cfg`, on
/// `devices`, joined to their replicas as [`join_device_replicas`] joins them.
fn join_members(
    cfg: &TrainConfig,
    owned: &[(usize, usize)],
    tap: Option<&HistogramTap>,
    devices: &MemberDevices,
) -> Result<Vec<((usize, usize), StageSettings)>> {
    let (opts, shared) = (session_options(cfg, 2, 1), stage_settings(cfg, 1.0));
    assert!(shared.bucket_bytes > 0, "buckets by default");
    let mut planned: Vec<_> = owned
        .iter()
        .map(|&(r, s)| ((r, s), replica_settings(cfg, &shared, (r, s), tap)))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let joined = join_device_replicas(cfg, &opts, (&mut planned, devices), 1, None);
    rt.block_on(joined).map(|()| planned)
}

/// Where every data-parallel replica of a stage runs in this process on a GPU, each
/// keeping its state there, they join one group and go without gradient buckets;
/// a replica elsewhere, histograms on replica 0 (whose state then stays on the host)
/// or the state on the host keep them all on the engine's collective. Replicas each on
/// a GPU of its own in this process would take NCCL, which this build or machine
/// lacks, so they reduce through the host.
#[test]
fn replicas_on_one_gpu_sum_there_only_where_all_of_them_can() {
    let dp2 = |runtime: &str| {
        let mut cfg = config(&format!("[runtime]\ndevice = \"cuda\"\n{runtime}"));
        cfg.data_parallel_size = 2;
        cfg
    };
    let plan = |cfg: &TrainConfig, owned: &[(usize, usize)], tap: Option<&HistogramTap>| {
        let planned = join_members(cfg, owned, tap, &MemberDevices::new()).unwrap();
        let ranks: Vec<_> = planned
            .iter()
            .map(|(_, st)| st.replicas.as_ref().map(|l| l.rank()))
            .collect();
        let buckets: Vec<bool> = planned.iter().map(|(_, st)| st.bucket_bytes > 0).collect();
        (ranks, buckets)
    };
    let cfg = dp2("");
    let (ranks, buckets) = plan(&cfg, &[(0, 0), (1, 0)], None);
    assert_eq!(ranks, [Some((0, 2)), Some((1, 2))]);
    assert_eq!(buckets, [false, false]);
    assert_eq!(plan(&cfg, &[(1, 0)], None), (vec![None], vec![true]));
    let tap = HistogramTap {
        names: vec!["w".into()],
        shards: 1,
        tx: flume::unbounded().0,
    };
    let none = (vec![None, None], vec![true, true]);
    assert_eq!(plan(&cfg, &[(0, 0), (1, 0)], Some(&tap)), none);
    let host = dp2("state_on_device = false\n");
    assert_eq!(plan(&host, &[(0, 0), (1, 0)], None), none);
    // Each replica on a GPU of its own takes NCCL; where it does not load (or in a
    // build without CUDA), they reduce through the host.
    let apart: MemberDevices = [((0, 0), Device::Cuda(0)), ((1, 0), Device::Cuda(1))].into();
    if ReplicaLink::nccl_ready().is_err() {
        let planned = join_members(&cfg, &[(0, 0), (1, 0)], None, &apart).unwrap();
        assert!(planned
            .iter()
            .all(|(_, st)| st.replicas.is_none() && st.bucket_bytes > 0));
    }
}

/// `runtime.devices` spreads one process's ranks in the manifest's order, wrapping
/// around the list; it is refused with the CPU as `runtime.device` or as an entry.
#[test]
fn runtime_devices_spread_ranks_in_the_manifests_order() {
    let mut cfg =
        config("[runtime]\ndevice = \"cuda\"\ndevices = [\"cuda:0\", \"cuda:1\", \"cuda:2\"]\n");
    cfg.data_parallel_size = 2;
    let owned = [(0, 0), (0, 1), (1, 0), (1, 1)];
    let spread = spread(&cfg, &owned, &[0, 1]);
    let on = |key| spread[&key];
    // Ranks 0..4 are (dp 0, stage 0), (0, 1), (1, 0), (1, 1).
    assert_eq!(
        [on((0, 0)), on((0, 1)), on((1, 0)), on((1, 1))],
        [
            Device::Cuda(0),
            Device::Cuda(1),
            Device::Cuda(2),
            Device::Cuda(0)
        ]
    );
    assert!(super::spread(&config(""), &owned, &[0, 1]).is_empty());
    let bad = |runtime: &str| {
        let parsed = parse(&format!("[runtime]\n{runtime}"));
        parsed.map(|_| ()).unwrap_err().to_string()
    };
    let cpu = bad("devices = [\"cuda:0\"]\n");
    assert!(
        cpu.contains("runtime.devices") && cpu.contains("runtime.device = "),
        "{cpu}"
    );
    let entry = bad("device = \"cuda\"\ndevices = [\"cuda:0\", \"cpu\"]\n");
    assert!(
        entry.contains("runtime.devices[1]") && entry.contains("not the CPU"),
        "{entry}"
    );
}
