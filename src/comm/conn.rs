//! One connection of the mesh: the tasks that dial, accept, write and read it, and the
//! state they share with [`super::Mesh`] (the received frames by (peer, channel), the
//! first failure, and spare payload buffers).
//!
//! Each connection has a writer task (a bounded queue of frames; a heartbeat when idle)
//! that takes turns on the socket with callers of `Mesh::send_slice` (bulk data written
//! from the caller's memory), and a reader task that files incoming frames, read into
//! recycled buffers where one fits.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::frame::{read_frame_into, write_frame, FrameError, MAX_FRAME};
use super::handshake::{handshake, Hello, Role};
use super::{GOODBYE, HEARTBEAT};

/// Received payloads at least this large are worth keeping for reuse ...
const SPARE_MIN: usize = 64 << 10;
/// ... up to this many bytes of them in all.
const SPARE_BYTES: usize = 64 << 20;

/// Frames (channel, payload) queued for one connection's writer.
pub(super) type Outgoing = flume::Sender<(u32, Vec<u8>)>;

/// A connection's sending half: its writer task and [`super::Mesh::send_slice`] take turns.
pub(super) type Writer = Arc<tokio::sync::Mutex<BufWriter<OwnedWriteHalf>>>;

/// The sending side of the connection to one peer.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) queue: Outgoing,
    pub(super) writer: Writer,
    pub(super) who: Arc<str>,
}

/// Received frames of one (peer, channel), in order.
pub(super) type Queue = (flume::Sender<Vec<u8>>, flume::Receiver<Vec<u8>>);

/// What the connection tasks share with the mesh.
pub(super) struct Shared {
    queues: Mutex<HashMap<(usize, u32), Queue>>,
    pub(super) failure: watch::Sender<Option<String>>,
    /// Large payload buffers handed back by receivers, for the readers to fill again.
    spare: Mutex<Vec<Vec<u8>>>,
}

impl Shared {
    pub(super) fn new() -> Shared {
        Shared {
            queues: Mutex::new(HashMap::new()),
            failure: watch::channel(None).0,
            spare: Mutex::new(Vec::new()),
        }
    }

    pub(super) fn queue(&self, peer: usize, channel: u32) -> Queue {
        let mut q = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        q.entry((peer, channel))
            .or_insert_with(flume::unbounded)
            .clone()
    }

    /// An empty buffer for a payload of `len` bytes: the smallest spare one that fits,
    /// or a new one.
    fn buffer(&self, len: usize) -> Vec<u8> {
        if len >= SPARE_MIN {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            let fits = spare
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            if let Some(i) = fits {
                return spare.swap_remove(i);
            }
        }
        Vec::with_capacity(len)
    }

    /// Keeps a received payload's buffer for [`Shared::buffer`], while the spare ones
    /// hold less than `SPARE_BYTES`.
    pub(super) fn recycle(&self, mut bytes: Vec<u8>) {
        if bytes.capacity() < SPARE_MIN {
            return;
        }
        bytes.clear();
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let kept: usize = spare.iter().map(Vec::capacity).sum();
        if kept + bytes.capacity() <= SPARE_BYTES {
            spare.push(bytes);
        }
    }

    /// Records the mesh's first failure.
    pub(super) fn fail(&self, reason: String) {
        self.failure.send_if_modified(|f| {
            let first = f.is_none();
            if first {
                tracing::error!("{reason}");
                *f = Some(reason);
            }
            first
        });
    }
}

/// Fails the mesh when dropped while still armed: a frame was cut off mid-way.
pub(super) struct CutOff<'a>(pub(super) Option<(&'a Shared, &'a str)>);

impl Drop for CutOff<'_> {
    fn drop(&mut self) {
        if let Some((shared, who)) = self.0 {
            shared.fail(format!("{who}: a frame was abandoned half sent"));
        }
    }
}

/// Dials node `j` until it answers or `deadline`, and authenticates it.
pub(super) async fn dial(
    addr: SocketAddr,
    j: usize,
    name: &str,
    hello: &Hello,
    secret: &[u8],
    deadline: Instant,
) -> Result<TcpStream, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect(addr).await {
            Ok(mut s) => {
                let theirs = handshake(&mut s, Role::Dialer, hello, secret, left)
                    .await
                    .map_err(|e| format!("node {name} ({addr}) refused or was refused: {e}"))?;
                if theirs.node as usize != j {
                    return Err(format!(
                        "{addr} answers as node {}, but the manifest puts node {name} (index {j}) there",
                        theirs.node
                    ));
                }
                return Ok(s);
            }
            Err(e) if left.is_zero() => {
                return Err(format!("node {name} ({addr}) did not answer: {e}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100).min(left)).await,
        }
    }
}

/// Accepts connections for the whole job: the higher-numbered nodes' first ones go to
/// `joined`; anything else (the wrong secret, another job, garbage, a node already
/// joined) is refused and logged. Each handshake runs on its own task, so a connection
/// that says nothing holds up no other.
pub(super) async fn accept_loop(
    listener: TcpListener,
    me: usize,
    n: usize,
    hello: Hello,
    secret: Arc<[u8]>,
    joined: flume::Sender<(usize, TcpStream)>,
    timeout: Duration,
) {
    let seen = Arc::new(Mutex::new(vec![false; n]));
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        let Ok((mut s, from)) = listener.accept().await else {
            continue;
        };
        while handshakes.try_join_next().is_some() {}
        let (hello, secret, joined, seen) =
            (hello.clone(), secret.clone(), joined.clone(), seen.clone());
        handshakes.spawn(async move {
            match handshake(&mut s, Role::Acceptor, &hello, &secret, timeout).await {
                Ok(theirs) => {
                    let j = theirs.node as usize;
                    let first = {
                        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                        let first = j > me && j < n && !seen[j];
                        if first {
                            seen[j] = true;
                        }
                        first
                    };
                    match first {
                        true => {
                            let _ = joined.send((j, s));
                        }
                        false => tracing::warn!(
                            "refused a connection from {from}: it claims node {j}, which is not one to join here now"
                        ),
                    }
                }
                Err(why) => tracing::warn!("refused a connection from {from}: {why}"),
            }
        });
    }
}

pub(super) async fn write_loop(
    writer: Writer,
    rx: flume::Receiver<(u32, Vec<u8>)>,
    heartbeat: Duration,
    shared: Arc<Shared>,
    who: Arc<str>,
) {
    let result: std::io::Result<()> = async {
        loop {
            let next = tokio::time::timeout(heartbeat, rx.recv_async()).await;
            let mut w = writer.lock().await;
            match next {
                Ok(Ok((channel, bytes))) => {
                    write_frame(&mut *w, channel, &bytes).await?;
                    while let Ok((channel, bytes)) = rx.try_recv() {
                        write_frame(&mut *w, channel, &bytes).await?;
                    }
                }
                // The mesh is shutting down: say goodbye.
                Ok(Err(_)) => {
                    write_frame(&mut *w, GOODBYE, &[]).await?;
                    w.flush().await?;
                    return w.shutdown().await;
                }
                Err(_) => write_frame(&mut *w, HEARTBEAT, &[]).await?,
            }
            w.flush().await?;
        }
    }
    .await;
    if let Err(e) = result {
        shared.fail(format!("{who}: sending failed: {e}"));
    }
}

pub(super) async fn read_loop(
    mut r: OwnedReadHalf,
    peer: usize,
    peer_timeout: Duration,
    shared: Arc<Shared>,
    who: Arc<str>,
) {
    let mut said_goodbye = false;
    loop {
        // The timeout counts silence, not the time a large frame takes to arrive.
        let frame = read_frame_into(&mut r, MAX_FRAME, peer_timeout, |len| shared.buffer(len));
        match frame.await {
            Err(FrameError::Silent(_) | FrameError::Closed) if said_goodbye => return,
            Err(FrameError::Silent(_)) => {
                return shared.fail(format!(
                    "{who} sent nothing for {peer_timeout:?}: gone or hung"
                ));
            }
            Err(e) => return shared.fail(format!("{who} {e}")),
            Ok(f) => match f.channel {
                HEARTBEAT => {}
                GOODBYE => said_goodbye = true,
                ch => {
                    let _ = shared.queue(peer, ch).0.send(f.bytes);
                }
            },
        }
    }
}
