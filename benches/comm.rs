//! pipetrain's TCP transport against PyTorch's gloo (issue: cluster): ring all-reduce of
//! float32 buffers from 1 MB to 256 MB across 2 and 4 processes on loopback, and the
//! time one 1 MB activation takes from one process to another (half a ping-pong). Each
//! round runs a pipetrain window (N processes of this bench, joined by `Mesh` with its
//! handshake, summing with `MeshCollective`) then a gloo window (N processes of
//! `benches/comm_gloo.py`), so drift between minutes lands in both; each window reports
//! the median of its iterations, and the table shows per-round ratios (gloo time /
//! pipetrain time: above 1 is pipetrain faster), their median and range. At 3 processes
//! or more the window also times the chain in replica order (`runtime.all_reduce =
//! "chain"`), its iterations alternating with the ring's, and the table adds its per-round
//! ratios to the ring (chain time / ring time).
//!
//! `cargo bench --bench comm [-- ROUNDS]` (default 3 rounds). The peer needs `torch`:
//! `PEERS_PYTHON` (default `~/.cache/pipetrain-peers/venv/bin/python`, the venv that
//! `benches/side_by_side.sh` builds); without it only pipetrain's figures are printed.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain::comm::{AllReduce, Mesh, MeshBus, MeshCollective, MeshTimeouts};
use pipetrain_actors::{Bus, Collective};

const MB: usize = 1 << 20;
const SIZES: [usize; 4] = [MB, 16 * MB, 64 * MB, 256 * MB];
const ITERS: [usize; 4] = [20, 8, 4, 2];
const WORLDS: [usize; 2] = [2, 4];
const HOP_BYTES: usize = MB;
const HOP_CHANNEL: u32 = 1 << 30;
const SECRET: &[u8] = b"bench-secret-bench-secret-bench!";

/// (what, bytes) -> seconds, as rank 0 printed them.
type Timings = BTreeMap<(String, usize), f64>;

fn main() {
    if let Ok(rank) = std::env::var("PT_COMM_RANK") {
        worker(rank.parse().expect("PT_COMM_RANK"));
        return;
    }
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    let python = std::env::var_os("PEERS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/pipetrain-peers/venv/bin/python")
        });
    let gloo = python.exists().then_some(python);
    if gloo.is_none() {
        println!("no PEERS_PYTHON with torch: pipetrain's figures only");
    }
    for world in WORLDS {
        let mut ours: Vec<Timings> = Vec::new();
        let mut theirs: Vec<Timings> = Vec::new();
        for round in 0..rounds {
            ours.push(run_pipetrain(world));
            if let Some(py) = &gloo {
                theirs.push(run_gloo(py, world));
            }
            eprintln!("world {world}: round {} of {rounds} done", round + 1);
        }
        report(world, &ours, &theirs);
        chain_to_ring(&ours);
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn joined(list: &[usize]) -> String {
    list.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Starts `world` processes from `command(rank)`, returns rank 0's timings.
fn run_world(world: usize, command: impl Fn(usize) -> Command) -> Timings {
    let children: Vec<_> = (0..world)
        .map(|rank| {
            command(rank)
                .stdout(if rank == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .expect("start a bench process")
        })
        .collect();
    let mut out = Timings::new();
    for (rank, child) in children.into_iter().enumerate() {
        let done = child.wait_with_output().expect("a bench process");
        assert!(done.status.success(), "rank {rank} failed: {}", done.status);
        for line in String::from_utf8_lossy(&done.stdout).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if let [what, bytes, secs] = f[..] {
                out.insert(
                    (what.to_string(), bytes.parse().unwrap()),
                    secs.parse().unwrap(),
                );
            }
        }
    }
    out
}

fn run_pipetrain(world: usize) -> Timings {
    let ports = free_ports(world);
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let exe = std::env::current_exe().expect("this bench's path");
    run_world(world, |rank| {
        let mut c = Command::new(&exe);
        c.env("PT_COMM_RANK", rank.to_string())
            .env("PT_COMM_ADDRS", addrs.join(","));
        c
    })
}

fn run_gloo(python: &PathBuf, world: usize) -> Timings {
    let port = free_ports(1)[0];
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/comm_gloo.py");
    run_world(world, |rank| {
        let mut c = Command::new(python);
        c.arg(script)
            .arg(rank.to_string())
            .arg(world.to_string())
            .arg(port.to_string())
            .arg(joined(&SIZES))
            .arg(joined(&ITERS))
            .env("OMP_NUM_THREADS", "1");
        c
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Per-round ratios of the chain's time to the ring's, by size: median (range).
fn chain_to_ring(ours: &[Timings]) {
    for (key, _) in ours[0].iter().filter(|(k, _)| k.0 == "chain") {
        let ring = ("allreduce".to_string(), key.1);
        let r: Vec<f64> = ours.iter().map(|t| t[key] / t[&ring]).collect();
        let (lo, hi) = (
            r.iter().copied().fold(f64::MAX, f64::min),
            r.iter().copied().fold(0.0, f64::max),
        );
        let mb = key.1 as f64 / MB as f64;
        println!(
            "chain / ring at {mb} MB: {:.2}x ({lo:.2}-{hi:.2})",
            median(r)
        );
    }
}

fn report(world: usize, ours: &[Timings], theirs: &[Timings]) {
    println!("\n{world} processes on loopback ({} rounds)", ours.len());
    println!(
        "{:<10} {:>10} {:>12} {:>12} {:>22}",
        "what", "MB", "pipetrain s", "gloo s", "gloo/pipetrain (range)"
    );
    for key in ours[0].keys() {
        let us: Vec<f64> = ours.iter().map(|t| t[key]).collect();
        let them: Vec<f64> = theirs.iter().filter_map(|t| t.get(key).copied()).collect();
        let mb = key.1 as f64 / MB as f64;
        let ratio = if them.len() == us.len() && !them.is_empty() {
            let r: Vec<f64> = us.iter().zip(&them).map(|(u, t)| t / u).collect();
            let (lo, hi) = (
                r.iter().copied().fold(f64::MAX, f64::min),
                r.iter().copied().fold(0.0, f64::max),
            );
            format!("{:.2}x ({lo:.2}-{hi:.2})", median(r))
        } else {
            "-".into()
        };
        let them = if them.is_empty() {
            "-".into()
        } else {
            format!("{:.5}", median(them))
        };
        println!(
            "{:<10} {mb:>10} {:>12.5} {them:>12} {ratio:>22}",
            key.0,
            median(us)
        );
    }
}

/// One process of a pipetrain window: join the mesh, time the all-reduces and the hop.
fn worker(rank: usize) {
    let addrs: Vec<SocketAddr> = std::env::var("PT_COMM_ADDRS")
        .expect("PT_COMM_ADDRS")
        .split(',')
        .map(|a| a.parse().expect("an address"))
        .collect();
    let world = addrs.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let names = (0..world).map(|i| format!("rank{i}")).collect();
        let timeouts = MeshTimeouts {
            connect: Duration::from_secs(30),
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(60),
        };
        let mesh = Mesh::connect(rank, "bench", addrs[rank], addrs, names, SECRET, timeouts)
            .await
            .expect("join the mesh");
        let bus = Arc::new(MeshBus::new(mesh.clone()));
        let placement: Vec<Vec<usize>> = (0..world).map(|r| vec![r]).collect();
        let ring = MeshCollective::new(mesh.clone(), placement.clone());
        let chain = MeshCollective::new(mesh.clone(), placement).with_algorithm(AllReduce::Chain);
        let mut barrier = 0u64;
        let mut sync = || {
            barrier += 1;
            let (bus, key) = (bus.clone(), format!("b{barrier}"));
            async move { bus.all_gather(key, Vec::new()).await.expect("barrier") }
        };
        for (size, iters) in SIZES.into_iter().zip(ITERS) {
            let mut buf: Vec<f32> = (0..size / 4).map(|i| (i % 97 + rank) as f32).collect();
            let (mut times, mut chained) = (Vec::new(), Vec::new());
            for i in 0..=iters {
                sync().await;
                let start = Instant::now();
                buf = ring.all_reduce_sum(0, rank, buf).await.expect("all-reduce");
                if i > 0 {
                    times.push(start.elapsed().as_secs_f64());
                }
                if world >= 3 {
                    sync().await;
                    let start = Instant::now();
                    buf = chain.all_reduce_sum(0, rank, buf).await.expect("chain");
                    if i > 0 {
                        chained.push(start.elapsed().as_secs_f64());
                    }
                }
            }
            if rank == 0 {
                println!("allreduce {size} {}", median(times));
                if world >= 3 {
                    println!("chain {size} {}", median(chained));
                }
            }
        }
        if world == 2 {
            let activation = vec![7u8; HOP_BYTES];
            let mut times = Vec::new();
            for i in 0..21 {
                sync().await;
                let start = Instant::now();
                let other = 1 - rank;
                // As the stage transport sends activations: straight from the
                // sender's bytes, and the received buffer handed back for reuse.
                if rank == 0 {
                    mesh.send_slice(other, HOP_CHANNEL, &activation)
                        .await
                        .unwrap();
                    mesh.recycle(mesh.recv(other, HOP_CHANNEL).await.unwrap());
                } else {
                    let got = mesh.recv(other, HOP_CHANNEL).await.unwrap();
                    mesh.send_slice(other, HOP_CHANNEL, &got).await.unwrap();
                    mesh.recycle(got);
                }
                if i > 0 {
                    times.push(start.elapsed().as_secs_f64() / 2.0);
                }
            }
            if rank == 0 {
                println!("hop {HOP_BYTES} {}", median(times));
            }
        }
        sync().await;
        mesh.shutdown().await;
    });
}
