//! The link between two nodes of a cluster, measured through pipetrain's own transport on
//! this machine's loopback: two endpoints of the job's mesh (authenticated TCP
//! connections) in this process, and messages of each size sent and sent back. Half the
//! round trip is one crossing; the latency is a small message's, the seconds per byte are
//! fitted over the larger ones. A stage's message is encoded and decoded as the wire does
//! it ([`crate::comm::wire`]); a ring segment goes as raw floats, as the ring sends them.
//!
//! What a stage's message costs beside the socket (the actors' hand-over to the
//! transport's tasks, another process woken) is calibrated against a launched run where
//! the nodes are on this machine (`cluster::calibrate_hop`). Between machines the network
//! is slower: `--link-latency-us` and `--link-gbps` give its figures instead.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain_actors::{Flow, Transfer};

use crate::comm::wire::{decode, encode};
use crate::comm::{Mesh, MeshTimeouts};
use crate::cost::{Link, Rate};
use crate::pipeline::Payload;
use crate::tensor::Tensor;

use super::plan_error;
use crate::Result;

/// The channels of the measurement's stage messages and raw segments (no job runs on
/// this mesh).
const MESSAGE: u32 = 1 << 30;
const SEGMENT: u32 = MESSAGE + 1;
/// Message sizes, floats: a small one for the latency, larger ones for the rate.
const SIZES: [usize; 3] = [16, 1 << 18, 1 << 21];
/// Round trips per size (the first not counted).
const ROUNDS: usize = 12;

/// The link between two pipetrain processes on this machine, measured.
///
/// # Errors
/// `Plan` when the two endpoints cannot listen or connect on loopback.
pub fn measure_loopback() -> Result<Link> {
    let failed = |reason: String| plan_error("measuring the link between nodes", reason);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| failed(e.to_string()))?;
    let (message, segment) = runtime.block_on(round_trips()).map_err(failed)?;
    let message = fit(&message);
    // On loopback the bytes' time is all copying: work, not waiting.
    Ok(Link {
        message: Rate {
            latency: message.latency,
            per_byte: 0.0,
        },
        message_work: message.per_byte,
        wake: 0.0,
        segment: fit(&segment),
    })
}

/// `(bytes, seconds)` points.
type Points = Vec<(f64, f64)>;

/// Per size in [`SIZES`], the median seconds of one way (half a round trip): of a stage's
/// message, and of a raw segment.
async fn round_trips() -> std::result::Result<(Points, Points), String> {
    let addrs = free_addresses()?;
    let names = vec!["plan-a".to_string(), "plan-b".to_string()];
    let timeouts = MeshTimeouts {
        connect: Duration::from_secs(10),
        heartbeat: Duration::from_secs(1),
        peer_timeout: Duration::from_secs(10),
    };
    let secret = b"pipetrain-plan-link-measurement!";
    let connect = |me: usize| {
        let (addrs, names) = (addrs.clone(), names.clone());
        async move { Mesh::connect(me, "plan", addrs[me], addrs, names, secret, timeouts).await }
    };
    let (a, b) = tokio::join!(connect(0), connect(1));
    let (a, b) = (a?, b?);
    let echo = tokio::spawn(echo(b.clone()));
    let (mut message, mut segment) = (Vec::new(), Vec::new());
    for floats in SIZES {
        let t = transfer(floats)?;
        // A host payload: encoding it copies nothing from a device and cannot fail.
        encode(0, 1, &t)?;
        let encoded = time_round_trips(
            &a,
            MESSAGE,
            || encode(0, 1, &t).unwrap_or_default(),
            |bytes| decode(bytes).map(|_| ()),
        )
        .await?;
        message.push(((floats * 4) as f64, encoded));
        let raw = vec![0u8; floats * 4];
        let sent = time_round_trips(&a, SEGMENT, || raw.clone(), |_| Ok(())).await?;
        segment.push(((floats * 4) as f64, sent));
    }
    echo.abort();
    a.shutdown().await;
    b.shutdown().await;
    Ok((message, segment))
}

/// The median of [`ROUNDS`] (the first not counted) one-way times of the bytes `make`
/// makes, sent on `channel` and read back with `read`.
async fn time_round_trips(
    mesh: &Mesh,
    channel: u32,
    make: impl Fn() -> Vec<u8>,
    read: impl Fn(&[u8]) -> std::result::Result<(), String>,
) -> std::result::Result<f64, String> {
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        mesh.send_slice(1, channel, &make()).await?;
        let back = mesh.recv(1, channel).await?;
        read(&back)?;
        mesh.recycle(back);
        times.push(start.elapsed().as_secs_f64() / 2.0);
    }
    Ok(median(&mut times[1..]))
}

/// The second endpoint: decodes each stage message and sends it back encoded again, as
/// a stage's receiving and sending ends would; sends each segment back as it came.
async fn echo(mesh: Arc<Mesh>) -> std::result::Result<(), String> {
    let messages = async {
        loop {
            let bytes = mesh.recv(0, MESSAGE).await?;
            let ((replica, rank), t) = decode(&bytes)?;
            mesh.recycle(bytes);
            mesh.send_slice(0, MESSAGE, &encode(replica, rank, &t)?)
                .await?;
        }
    };
    let segments = async {
        loop {
            let bytes = mesh.recv(0, SEGMENT).await?;
            mesh.send_slice(0, SEGMENT, &bytes).await?;
            mesh.recycle(bytes);
        }
    };
    let both: (
        std::result::Result<(), String>,
        std::result::Result<(), String>,
    ) = tokio::join!(messages, segments);
    both.0.and(both.1)
}

/// An activation message of `floats` values.
fn transfer(floats: usize) -> std::result::Result<Transfer<Payload>, String> {
    let values: Vec<f32> = (0..floats).map(|i| (i % 251) as f32 * 0.5).collect();
    let tensor = Tensor::f32(vec![floats], values).map_err(|e| e.to_string())?;
    Ok(Transfer {
        flow: Flow::Act,
        stage: 0,
        mb: 0,
        payload: HashMap::from([("activation".to_string(), Arc::new(tensor.into()))]),
    })
}

fn free_addresses() -> std::result::Result<Vec<SocketAddr>, String> {
    // Bound together so the two ports differ, then released for the mesh to bind.
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()
        .map_err(|e| format!("no free port on 127.0.0.1: {e}"))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map_err(|e| e.to_string()))
        .collect()
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// The rate through `(bytes, seconds)` points: the smallest message's time as the
/// latency, the seconds per byte by least squares over the rest.
fn fit(points: &[(f64, f64)]) -> Rate {
    let Some(&(b0, t0)) = points.first() else {
        return Rate {
            latency: 0.0,
            per_byte: 0.0,
        };
    };
    let (num, den) = points[1..].iter().fold((0.0, 0.0), |(n, d), &(b, t)| {
        let x = b - b0;
        (n + x * (t - t0), d + x * x)
    });
    let per_byte = if den > 0.0 { (num / den).max(0.0) } else { 0.0 };
    Rate {
        latency: (t0 - b0 * per_byte).max(0.0),
        per_byte,
    }
}

/// A network given in words, `latency_us` microseconds and `gbps` gigabits per second,
/// for stage messages and ring segments alike; the work of encoding and copying a
/// message as `measured` here.
pub fn given(latency_us: f64, gbps: f64, measured: Link) -> Link {
    let rate = Rate {
        latency: latency_us * 1e-6,
        per_byte: if gbps > 0.0 { 8.0 / (gbps * 1e9) } else { 0.0 },
    };
    Link {
        message: rate,
        segment: rate,
        ..measured
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_the_points_is_the_link() {
        let link = fit(&[(64.0, 1e-4 + 64e-9), (1e6, 1e-4 + 1e-3), (8e6, 1e-4 + 8e-3)]);
        assert!((link.per_byte - 1e-9).abs() < 1e-15, "{link:?}");
        assert!((link.latency - 1e-4).abs() < 1e-9, "{link:?}");
        // 10 Gbit/s: 0.8 ns a byte, with the work measured here.
        let here = Link {
            message: link,
            message_work: 2e-9,
            wake: 0.0,
            segment: link,
        };
        let network = given(50.0, 10.0, here);
        assert!((network.segment.per_byte - 0.8e-9).abs() < 1e-18);
        assert!((network.message.latency - 50e-6).abs() < 1e-18);
        assert_eq!(network.message_work, 2e-9);
    }

    #[test]
    fn loopback_through_the_transport_is_measured() {
        let link = measure_loopback().unwrap();
        for (latency, per_byte) in [
            (link.message.latency, link.message_work),
            (link.segment.latency, link.segment.per_byte),
        ] {
            assert!(latency > 0.0 && latency < 0.05, "{link:?}");
            // Between a byte a millisecond and 1000 GB/s.
            assert!(per_byte > 1e-12 && per_byte < 1e-3, "{link:?}");
        }
    }
}
