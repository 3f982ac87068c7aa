//! The transport on its own: the frame, hello and transfer parsers against many random
//! and mutated inputs (never a panic, never an allocation beyond the input), the
//! handshake against a wrong secret and garbage, and a mesh of three workers in this
//! process on loopback: concurrent keyed all-gathers, ring all-reduce sums, transfers
//! to the right mailbox, and a vanished peer named within the peer timeout (the chain's
//! sums in replica order: `comm_chain.rs`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipetrain::comm::frame::{header, parse, read_frame, read_frame_within, FrameError};
use pipetrain::comm::handshake::{handshake, Hello, Role};
use pipetrain::comm::wire::{decode, encode};
use pipetrain::comm::{link_transfers, Mesh, MeshBus, MeshCollective, MeshTimeouts};
use pipetrain::tensor::Tensor;
use pipetrain_actors::{Bus, Collective, Flow, Transfer};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::AsyncWriteExt;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

fn transfer() -> Transfer<pipetrain::pipeline::Payload> {
    let mut payload = HashMap::new();
    payload.insert(
        "h".to_string(),
        Arc::new(
            Tensor::f32(
                vec![2, 3],
                vec![1.0, -2.5, 3.25, f32::MIN_POSITIVE, -0.0, 7.0],
            )
            .unwrap()
            .into(),
        ),
    );
    payload.insert(
        "ids".to_string(),
        Arc::new(Tensor::i64(vec![3], vec![1, -2, i64::MAX]).unwrap().into()),
    );
    Transfer {
        flow: Flow::Grad,
        stage: 1,
        mb: 6,
        payload,
    }
}

#[test]
fn parsers_survive_random_and_mutated_input() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let good_frame = [header(5, 3).as_slice(), b"abc"].concat();
    let good_hello = Hello::new(2, "job").unwrap().encode();
    let good_transfer = encode(1, 0, &transfer()).unwrap();
    let mut runs = 0u64;
    for round in 0..100_000 {
        for seed in [&good_frame, &good_hello, &good_transfer] {
            let mut bytes = match round % 3 {
                // Random bytes of random length.
                0 => {
                    let mut b = vec![0u8; rng.random_range(0..96)];
                    rng.fill_bytes(&mut b);
                    b
                }
                // The valid message with a few bytes flipped.
                1 => {
                    let mut b = seed.clone();
                    for _ in 0..rng.random_range(1..4) {
                        let i = rng.random_range(0..b.len());
                        b[i] ^= rng.random::<u8>() | 1;
                    }
                    b
                }
                // Truncated.
                _ => seed[..rng.random_range(0..seed.len())].to_vec(),
            };
            if bytes.len() > 12 && round % 7 == 0 {
                // A huge announced length must be refused, not allocated.
                bytes[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
            }
            let _ = parse(&bytes, 1 << 20);
            let _ = Hello::decode(&bytes);
            let _ = decode(&bytes);
            runs += 3;
        }
    }
    eprintln!("{runs} parser executions on random, mutated and truncated input");
    // And the valid ones parse.
    let (f, used) = parse(&good_frame, 1 << 20).unwrap().unwrap();
    assert_eq!(
        (f.channel, f.bytes.as_slice(), used),
        (5, b"abc".as_slice(), 15)
    );
    assert!(matches!(
        parse(&header(1, 1 << 21), 1 << 20),
        Err(FrameError::TooLarge { .. })
    ));
    assert_eq!(Hello::decode(&good_hello).unwrap().node, 2);
    let ((replica, rank), t) = decode(&good_transfer).unwrap();
    assert_eq!(
        (replica, rank, t.stage, t.mb, t.flow),
        (1, 0, 1, 6, Flow::Grad)
    );
    assert_eq!(
        t.payload["h"].host("h").unwrap().as_f32().unwrap()[3],
        f32::MIN_POSITIVE
    );
    assert_eq!(
        t.payload["h"].host("h").unwrap().as_f32().unwrap()[4].to_bits(),
        (-0.0f32).to_bits()
    );
    assert_eq!(
        t.payload["ids"].host("ids").unwrap().as_i64().unwrap(),
        [1, -2, i64::MAX]
    );
}

#[tokio::test]
async fn a_stream_ending_inside_a_frame_is_truncated_not_closed() {
    let bytes = [header(3, 10).as_slice(), b"abcd"].concat();
    let err = read_frame(&mut bytes.as_slice(), 100).await.unwrap_err();
    assert!(
        matches!(err, FrameError::Truncated { got: 16, want: 22 }),
        "{err}"
    );
    let err = read_frame(&mut [].as_slice(), 100).await.unwrap_err();
    assert!(matches!(err, FrameError::Closed));
}

#[tokio::test]
async fn the_idle_limit_counts_silence_not_the_time_a_large_frame_takes() {
    let idle = Duration::from_millis(200);
    // A frame trickling in, 50 ms a piece over 600 ms in all: read whole.
    let (mut tx, mut rx) = tokio::io::duplex(64);
    let writer = tokio::spawn(async move {
        let frame = [header(9, 48).as_slice(), &[5u8; 48]].concat();
        for piece in frame.chunks(5) {
            tx.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tx
    });
    let start = Instant::now();
    let f = read_frame_within(&mut rx, 100, idle).await.unwrap();
    assert!(start.elapsed() > idle * 2, "{:?}", start.elapsed());
    assert_eq!((f.channel, f.bytes), (9, vec![5u8; 48]));
    // Silent for longer than the limit in the middle of a frame, or before one: Silent.
    let mut tx = writer.await.unwrap();
    tx.write_all(&header(9, 48)).await.unwrap();
    tx.write_all(&[1u8; 20]).await.unwrap();
    let err = read_frame_within(&mut rx, 100, idle).await.unwrap_err();
    assert!(matches!(err, FrameError::Silent(d) if d == idle), "{err}");
    let (_quiet, mut rx) = tokio::io::duplex(64);
    let err = read_frame_within(&mut rx, 100, idle).await.unwrap_err();
    assert!(matches!(err, FrameError::Silent(_)), "{err}");
}

#[tokio::test]
async fn the_handshake_accepts_the_secret_and_refuses_anything_else() {
    let run = |a_secret: &'static [u8], b_secret: &'static [u8], b_job: &'static str| async move {
        let (mut x, mut y) = tokio::io::duplex(4096);
        let a = tokio::spawn(async move {
            handshake(
                &mut x,
                Role::Acceptor,
                &Hello::new(0, "job").unwrap(),
                a_secret,
                Duration::from_secs(2),
            )
            .await
        });
        let b = handshake(
            &mut y,
            Role::Dialer,
            &Hello::new(1, b_job).unwrap(),
            b_secret,
            Duration::from_secs(2),
        )
        .await;
        (a.await.unwrap(), b)
    };
    let (a, b) = run(SECRET, SECRET, "job").await;
    assert_eq!((a.unwrap().node, b.unwrap().node), (1, 0));
    let (a, b) = run(SECRET, b"another secret of 32 bytes......", "job").await;
    assert!(a.unwrap_err().contains("does not hold this job's secret"));
    assert!(b.unwrap_err().contains("does not hold this job's secret"));
    let (a, _) = run(SECRET, SECRET, "other").await;
    assert!(a.unwrap_err().contains("runs job `other`"));
    // Random bytes instead of a handshake, many times: refused, never a panic.
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for _ in 0..2000 {
        let (mut x, mut y) = tokio::io::duplex(4096);
        let mut junk = vec![0u8; rng.random_range(0..200)];
        rng.fill_bytes(&mut junk);
        let a = tokio::spawn(async move {
            handshake(
                &mut x,
                Role::Acceptor,
                &Hello::new(0, "job").unwrap(),
                SECRET,
                Duration::from_millis(200),
            )
            .await
        });
        tokio::io::AsyncWriteExt::write_all(&mut y, &junk)
            .await
            .ok();
        drop(y);
        assert!(a.await.unwrap().is_err());
    }
}

fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners.iter().map(|l| l.local_addr().unwrap()).collect()
}

pub(crate) async fn mesh_of(n: usize, peer_timeout: Duration) -> Vec<Arc<Mesh>> {
    let addrs = free_addrs(n);
    let names: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
    let timeouts = MeshTimeouts {
        connect: Duration::from_secs(10),
        heartbeat: Duration::from_millis(50),
        peer_timeout,
    };
    let joins: Vec<_> = (0..n)
        .map(|i| {
            let (addrs, names) = (addrs.clone(), names.clone());
            tokio::spawn(async move {
                Mesh::connect(i, "t", addrs[i], addrs, names, SECRET, timeouts).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for j in joins {
        out.push(j.await.unwrap().unwrap());
    }
    out
}

/// One reduce-scatter (or all-gather, `gather`) of `bufs` over `parts`, replica `r` on
/// worker `r`; what each replica got back.
async fn ring_round(
    meshes: &[Arc<Mesh>],
    placement: &[Vec<usize>],
    bufs: &[Vec<f32>],
    parts: &[std::ops::Range<usize>],
    gather: bool,
) -> Vec<Vec<f32>> {
    let tasks: Vec<_> = (0..bufs.len())
        .map(|r| {
            let c = MeshCollective::new(meshes[r].clone(), placement.to_vec());
            let (buf, parts) = (bufs[r].clone(), parts.to_vec());
            tokio::spawn(async move {
                match gather {
                    true => c.all_gather(0, r, buf, &parts).await.unwrap(),
                    false => c.reduce_scatter(0, r, buf, &parts).await.unwrap(),
                }
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_gather_reduce_and_transfer() {
    let meshes = mesh_of(3, Duration::from_secs(5)).await;
    // Keyed all-gathers, all 20 in flight at once on each worker, started in a
    // different order on worker 1: messages for a key nobody waits on yet are kept.
    let buses: Vec<Arc<MeshBus>> = meshes
        .iter()
        .map(|m| Arc::new(MeshBus::new(m.clone())))
        .collect();
    let mut tasks = Vec::new();
    for (i, bus) in buses.iter().enumerate() {
        let mut keys: Vec<u32> = (0..20).collect();
        if i == 1 {
            keys.reverse();
        }
        for k in keys {
            let bus = bus.clone();
            tasks.push(tokio::spawn(async move {
                let all = bus
                    .all_gather(format!("k{k}"), format!("{i}:{k}").into_bytes())
                    .await
                    .unwrap();
                (k, all)
            }));
        }
    }
    for t in tasks {
        let (k, all) = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("a gather finishes")
            .unwrap();
        let want: Vec<Vec<u8>> = (0..3).map(|i| format!("{i}:{k}").into_bytes()).collect();
        assert_eq!(all, want);
    }
    // All-reduce over 3 replicas of stage 0, one per worker.
    let placement = vec![vec![0], vec![1], vec![2]];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // Segments of about 1.17M values: each crosses the wire as two pieces (PIECE = 2^20).
    let len = 3_500_003;
    let inputs: Vec<Vec<f32>> = (0..3)
        // Drawn in f64 and rounded: full f32 mantissas, so the order of a sum shows in
        // its bits (rand's f32 draws are multiples of 2^-22: sums of three are exact).
        .map(|_| {
            (0..len)
                .map(|_| rng.random_range(-1.0f64..1.0) as f32)
                .collect()
        })
        .collect();
    let reduced: Vec<Vec<f32>> = {
        let tasks: Vec<_> = (0..3)
            .map(|r| {
                let c = MeshCollective::new(meshes[r].clone(), placement.clone());
                let buf = inputs[r].clone();
                let lent = buf.as_ptr() as usize;
                tokio::spawn(async move { (lent, c.all_reduce_sum(0, r, buf).await.unwrap()) })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            let (lent, sum) = t.await.unwrap();
            // The `Collective` contract: the sum comes back in the buffer lent.
            assert_eq!(sum.as_ptr() as usize, lent);
            out.push(sum);
        }
        out
    };
    // Every replica holds the same bits (each element summed once, by one replica), and
    // the sum is right to float32 rounding (summed in ring order, not replica order).
    assert!(reduced.iter().all(|r| r
        .iter()
        .map(|x| x.to_bits())
        .eq(reduced[0].iter().map(|x| x.to_bits()))));
    for i in 0..len {
        let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
        assert!((reduced[0][i] as f64 - exact).abs() <= 1e-6, "element {i}");
    }
    // A reduce-scatter over uneven parts (one empty) leaves each replica its part of the
    // same sum, and the all-gather then hands every replica each owner's part.
    let parts = vec![0..2_000_000, 2_000_000..2_000_000, 2_000_000..len];
    let scattered = ring_round(&meshes, &placement, &inputs, &parts, false).await;
    for (r, got) in scattered.iter().enumerate() {
        let own = parts[r].clone();
        for i in own.clone().step_by(997) {
            let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
            assert!(
                (got[i] as f64 - exact).abs() <= 1e-6,
                "replica {r} element {i}"
            );
        }
    }
    let gathered = ring_round(&meshes, &placement, &scattered, &parts, true).await;
    for got in &gathered {
        for (r, own) in parts.iter().enumerate() {
            assert!(got[own.clone()] == scattered[r][own.clone()], "part {r}");
        }
    }
    // Transfers reach the mailbox of the member they are for.
    let owner = vec![vec![0, 1, 2]];
    let (peers0, deliver0) = link_transfers(meshes[0].clone(), owner.clone());
    let (_peers2, deliver2) = link_transfers(meshes[2].clone(), owner);
    deliver0(HashMap::new());
    let (tx, rx) = flume::unbounded();
    deliver2(HashMap::from([((0, 2), tx)]));
    peers0[&(0, 2)].send(transfer()).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), rx.recv_async())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((got.stage, got.mb, got.flow), (1, 6, Flow::Grad));
    assert_eq!(
        got.payload["h"].host("h").unwrap(),
        transfer().payload["h"].host("h").unwrap()
    );
    for m in &meshes {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sum_exactly_and_a_vanished_peer_is_named() {
    let meshes = mesh_of(2, Duration::from_millis(600)).await;
    let placement = vec![vec![0], vec![1]];
    let (a, b): (Vec<f32>, Vec<f32>) = (
        (0..1000).map(|i| i as f32 * 0.1).collect(),
        (0..1000).map(|i| 1.0 / (i as f32 + 3.0)).collect(),
    );
    let ca = MeshCollective::new(meshes[0].clone(), placement.clone());
    let cb = MeshCollective::new(meshes[1].clone(), placement);
    let (ra, rb) = tokio::join!(
        ca.all_reduce_sum(0, 0, a.clone()),
        cb.all_reduce_sum(0, 1, b.clone())
    );
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(ra.unwrap(), want);
    assert_eq!(rb.unwrap(), want);
    // Worker 1 vanishes without a goodbye; worker 0's receive fails naming it.
    meshes[1].abort();
    let start = Instant::now();
    let err = meshes[0].recv(1, 99).await.unwrap_err();
    assert!(err.contains("n1"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_frames_arrive_whole_and_in_order_through_reused_buffers() {
    let meshes = mesh_of(2, Duration::from_secs(5)).await;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    // Large and small frames in turn, so a recycled buffer is often larger than the
    // next payload read into it: each must come out at exactly its own length and bytes.
    let sizes = [
        5 << 20,
        100 << 10,
        3 << 20,
        70 << 10,
        (5 << 20) + 1,
        10,
        0,
        1 << 20,
    ];
    let frames: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| {
            let mut b = vec![0u8; n];
            rng.fill_bytes(&mut b);
            b
        })
        .collect();
    let sender = {
        let (mesh, frames) = (meshes[0].clone(), frames.clone());
        tokio::spawn(async move {
            for (i, f) in frames.iter().enumerate() {
                mesh.send_slice(1, 40, f).await.unwrap();
                // Queued frames on another channel go alongside.
                mesh.send(1, 41, vec![i as u8; 3]).await.unwrap();
            }
        })
    };
    for (i, want) in frames.iter().enumerate() {
        let got = meshes[1].recv(0, 40).await.unwrap();
        assert!(got == *want, "frame {i} of {} bytes", want.len());
        meshes[1].recycle(got);
        assert_eq!(meshes[1].recv(0, 41).await.unwrap(), vec![i as u8; 3]);
    }
    sender.await.unwrap();
    // A frame given up half sent leaves the stream unreadable: the mesh fails and says so.
    let huge = vec![1u8; 64 << 20];
    let cut = tokio::time::timeout(Duration::from_millis(1), meshes[0].send_slice(1, 40, &huge));
    assert!(cut.await.is_err(), "64 MiB went out within 1 ms");
    let why = meshes[0].failure().expect("the mesh failed");
    assert!(why.contains("n1") && why.contains("abandoned"), "{why}");
    assert!(meshes[0].send_slice(1, 40, b"x").await.is_err());
}
