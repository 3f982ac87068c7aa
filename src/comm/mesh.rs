//! The full mesh: one authenticated TCP connection between every pair of workers, with
//! logical channels multiplexed over it.
//!
//! The higher-numbered node dials the lower (retrying until the connect timeout, so
//! workers may start in any order); the lower accepts, and keeps accepting for the whole
//! job, refusing and logging anything that fails the handshake. Each connection has a
//! writer task (a bounded queue of frames; a heartbeat when idle) and a reader task that
//! files incoming frames by (peer, channel). A peer that closes its connection without
//! saying goodbye, or sends nothing (not even a heartbeat) for the peer timeout, fails
//! the mesh: every receive under way or to come returns the reason, naming the peer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::frame::{read_frame_within, write_frame, FrameError, MAX_FRAME};
use super::handshake::{handshake, Hello, Role};
use super::{GOODBYE, HEARTBEAT};

/// Frames waiting for a connection's writer; a sender past this waits (backpressure).
const QUEUE: usize = 64;

/// How long connections wait.
#[derive(Debug, Clone, Copy)]
pub struct MeshTimeouts {
    /// For every peer to be connected and authenticated.
    pub connect: Duration,
    /// Between frames to an idle peer (a heartbeat is sent).
    pub heartbeat: Duration,
    /// Silence after which a peer counts as gone.
    pub peer_timeout: Duration,
}

/// Frames (channel, payload) queued for one connection's writer.
type Outgoing = flume::Sender<(u32, Vec<u8>)>;

/// Received frames of one (peer, channel), in order.
type Queue = (flume::Sender<Vec<u8>>, flume::Receiver<Vec<u8>>);

/// What the connection tasks share with the mesh.
struct Shared {
    queues: Mutex<HashMap<(usize, u32), Queue>>,
    failure: watch::Sender<Option<String>>,
}

impl Shared {
    fn queue(&self, peer: usize, channel: u32) -> Queue {
        let mut q = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        q.entry((peer, channel))
            .or_insert_with(flume::unbounded)
            .clone()
    }

    /// Records the mesh's first failure.
    fn fail(&self, reason: String) {
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

/// This worker's connections to every other worker of the job.
pub struct Mesh {
    me: usize,
    names: Vec<String>,
    outs: Mutex<Vec<Option<Outgoing>>>,
    shared: Arc<Shared>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Mesh {
    /// Joins the job as node `me`: listens on `listen`, dials the lower-numbered nodes
    /// at `peers[j]` and accepts the higher ones, each proving it holds `secret` and runs
    /// `job`. `names` name the nodes in messages.
    ///
    /// # Errors
    /// The listener cannot bind; a peer refuses our proof or proves nothing; not every
    /// peer joined within `timeouts.connect` (naming those missing and any refusals).
    pub async fn connect(
        me: usize,
        job: &str,
        listen: SocketAddr,
        peers: Vec<SocketAddr>,
        names: Vec<String>,
        secret: &[u8],
        timeouts: MeshTimeouts,
    ) -> Result<Arc<Mesh>, String> {
        let n = peers.len();
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let deadline = Instant::now() + timeouts.connect;
        let hello = Hello::new(me as u32, job)?;
        let secret: Arc<[u8]> = secret.into();
        // The accepting side runs for the whole job, handing over the expected peers.
        let (joined_tx, joined_rx) = flume::unbounded::<(usize, TcpStream)>();
        let acceptor = tokio::spawn(accept_loop(
            listener,
            me,
            n,
            hello.clone(),
            secret.clone(),
            joined_tx,
            timeouts.connect,
        ));
        let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        for j in 0..me {
            let s = dial(peers[j], j, &names[j], &hello, &secret, deadline).await?;
            streams[j] = Some(s);
        }
        while streams
            .iter()
            .enumerate()
            .any(|(j, s)| j > me && s.is_none())
        {
            match tokio::time::timeout_at(deadline, joined_rx.recv_async()).await {
                Ok(Ok((j, s))) => streams[j] = Some(s),
                _ => {
                    let missing: Vec<&str> = (me + 1..n)
                        .filter(|&j| streams[j].is_none())
                        .map(|j| names[j].as_str())
                        .collect();
                    acceptor.abort();
                    return Err(format!(
                        "nodes {} did not join within {:?} (see the log for refused connections)",
                        missing.join(", "),
                        timeouts.connect
                    ));
                }
            }
        }
        let shared = Arc::new(Shared {
            queues: Mutex::new(HashMap::new()),
            failure: watch::channel(None).0,
        });
        let mut outs = Vec::with_capacity(n);
        let mut tasks = vec![acceptor];
        for (j, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                outs.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let who = format!("node {} ({})", names[j], peers[j]);
            let (r, w) = s.into_split();
            let (tx, rx) = flume::bounded(QUEUE);
            outs.push(Some(tx));
            tasks.push(tokio::spawn(write_loop(
                w,
                rx,
                timeouts.heartbeat,
                shared.clone(),
                who.clone(),
            )));
            tasks.push(tokio::spawn(read_loop(
                r,
                j,
                timeouts.peer_timeout,
                shared.clone(),
                who,
            )));
        }
        Ok(Arc::new(Mesh {
            me,
            names,
            outs: Mutex::new(outs),
            shared,
            tasks: Mutex::new(tasks),
        }))
    }

    /// This node's index.
    pub fn me(&self) -> usize {
        self.me
    }

    /// The number of nodes.
    pub fn nodes(&self) -> usize {
        self.names.len()
    }

    /// Sends `bytes` to `peer` on `channel` (to this node itself through memory).
    ///
    /// # Errors
    /// The mesh's failure, when it failed.
    pub async fn send(&self, peer: usize, channel: u32, bytes: Vec<u8>) -> Result<(), String> {
        if let Some(why) = self.failure() {
            return Err(why);
        }
        if peer == self.me {
            let _ = self.shared.queue(peer, channel).0.send(bytes);
            return Ok(());
        }
        let tx = {
            let outs = self.outs.lock().unwrap_or_else(|p| p.into_inner());
            outs.get(peer).cloned().flatten()
        };
        let tx = tx.ok_or_else(|| format!("no connection to node {peer}"))?;
        tx.send_async((channel, bytes)).await.map_err(|_| {
            self.failure()
                .unwrap_or_else(|| "the mesh is shut down".into())
        })
    }

    /// The next frame from `peer` on `channel`.
    ///
    /// # Errors
    /// The mesh's failure (a peer gone or silent), when nothing is queued.
    pub async fn recv(&self, peer: usize, channel: u32) -> Result<Vec<u8>, String> {
        let (_, rx) = self.shared.queue(peer, channel);
        if let Ok(bytes) = rx.try_recv() {
            return Ok(bytes);
        }
        tokio::select! {
            biased;
            got = rx.recv_async() => got.map_err(|_| "the mesh is shut down".to_string()),
            why = self.failed() => Err(why),
        }
    }

    /// The mesh's failure, if it failed.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.borrow().clone()
    }

    /// Resolves with the reason once the mesh fails.
    pub async fn failed(&self) -> String {
        let mut rx = self.shared.failure.subscribe();
        let reason = match rx.wait_for(Option::is_some).await {
            Ok(f) => f.clone().unwrap_or_default(),
            Err(_) => "the mesh is shut down".into(),
        };
        reason
    }

    /// Says goodbye to every peer (so the end of the job is not taken for a failure),
    /// waits for the queued frames to go out, and closes the connections.
    pub async fn shutdown(&self) {
        let outs: Vec<_> =
            std::mem::take(&mut *self.outs.lock().unwrap_or_else(|p| p.into_inner()));
        drop(outs);
        let tasks: Vec<_> =
            std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        // Writers end after their goodbye; readers after the peers' goodbyes or a
        // moment's grace.
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            for t in tasks.iter().skip(1) {
                while !t.is_finished() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        })
        .await;
        for t in tasks {
            t.abort();
        }
    }

    /// Drops every connection at once (after a failure).
    pub fn abort(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Dials node `j` until it answers or `deadline`, and authenticates it.
async fn dial(
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
async fn accept_loop(
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

async fn write_loop(
    w: OwnedWriteHalf,
    rx: flume::Receiver<(u32, Vec<u8>)>,
    heartbeat: Duration,
    shared: Arc<Shared>,
    who: String,
) {
    let mut w = BufWriter::with_capacity(1 << 16, w);
    let result: std::io::Result<()> = async {
        loop {
            match tokio::time::timeout(heartbeat, rx.recv_async()).await {
                Ok(Ok((channel, bytes))) => {
                    write_frame(&mut w, channel, &bytes).await?;
                    while let Ok((channel, bytes)) = rx.try_recv() {
                        write_frame(&mut w, channel, &bytes).await?;
                    }
                }
                // The mesh is shutting down: say goodbye.
                Ok(Err(_)) => {
                    write_frame(&mut w, GOODBYE, &[]).await?;
                    w.flush().await?;
                    return w.shutdown().await;
                }
                Err(_) => write_frame(&mut w, HEARTBEAT, &[]).await?,
            }
            w.flush().await?;
        }
    }
    .await;
    if let Err(e) = result {
        shared.fail(format!("{who}: sending failed: {e}"));
    }
}

async fn read_loop(
    mut r: OwnedReadHalf,
    peer: usize,
    peer_timeout: Duration,
    shared: Arc<Shared>,
    who: String,
) {
    let mut said_goodbye = false;
    loop {
        // The timeout counts silence, not the time a large frame takes to arrive.
        match read_frame_within(&mut r, MAX_FRAME, peer_timeout).await {
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
