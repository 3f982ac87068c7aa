//! The full mesh: one authenticated TCP connection between every pair of workers, with
//! logical channels multiplexed over it.
//!
//! The higher-numbered node dials the lower (retrying until the connect timeout, so
//! workers may start in any order); the lower accepts, and keeps accepting for the whole
//! job, refusing and logging anything that fails the handshake. Each connection has a
//! writer task (a bounded queue of frames; a heartbeat when idle) and a reader task that
//! files incoming frames by (peer, channel) (see `conn`). A peer that closes its
//! connection without saying goodbye, or sends nothing (not even a heartbeat) for the
//! peer timeout, fails the mesh: every receive under way or to come returns the reason,
//! naming the peer.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::conn::{accept_loop, dial, read_loop, write_loop, Conn, CutOff, Shared};
use super::frame::write_frame;
use super::handshake::Hello;

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

/// This worker's connections to every other worker of the job.
pub struct Mesh {
    me: usize,
    names: Vec<String>,
    outs: Mutex<Vec<Option<Conn>>>,
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
        let shared = Arc::new(Shared::new());
        let mut outs = Vec::with_capacity(n);
        let mut tasks = vec![acceptor];
        for (j, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                outs.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let who: Arc<str> = format!("node {} ({})", names[j], peers[j]).into();
            let (r, w) = s.into_split();
            let (tx, rx) = flume::bounded(QUEUE);
            let writer = Arc::new(tokio::sync::Mutex::new(BufWriter::with_capacity(
                1 << 16,
                w,
            )));
            outs.push(Some(Conn {
                queue: tx,
                writer: writer.clone(),
                who: who.clone(),
            }));
            tasks.push(tokio::spawn(write_loop(
                writer,
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
        let conn = self.conn(peer)?;
        conn.queue.send_async((channel, bytes)).await.map_err(|_| {
            self.failure()
                .unwrap_or_else(|| "the mesh is shut down".into())
        })
    }

    /// Sends `bytes` to `peer` on `channel` straight from the caller's memory, onto the
    /// socket in the caller's task: no copy and no hand-over to the writer task, for
    /// bulk data (ring segments). A channel's frames keep their order when they all go
    /// by [`Mesh::send`] or all by this. Dropping the future in the middle of a frame
    /// leaves the stream unreadable, so that fails the mesh.
    ///
    /// # Errors
    /// The mesh's failure, when it failed; writing failing (which fails the mesh).
    pub async fn send_slice(&self, peer: usize, channel: u32, bytes: &[u8]) -> Result<(), String> {
        if let Some(why) = self.failure() {
            return Err(why);
        }
        if peer == self.me {
            let _ = self.shared.queue(peer, channel).0.send(bytes.to_vec());
            return Ok(());
        }
        let conn = self.conn(peer)?;
        let mut w = conn.writer.lock().await;
        let mut cut = CutOff(Some((&self.shared, &conn.who)));
        let sent = async {
            write_frame(&mut *w, channel, bytes).await?;
            w.flush().await
        }
        .await;
        cut.0 = None;
        sent.map_err(|e| {
            let why = format!("{}: sending failed: {e}", conn.who);
            self.shared.fail(why.clone());
            why
        })
    }

    /// Hands a received payload back for reuse by the connections' readers (a large
    /// buffer refilled instead of fresh pages faulted in per frame).
    pub fn recycle(&self, bytes: Vec<u8>) {
        self.shared.recycle(bytes);
    }

    /// The sending side of the connection to `peer`.
    fn conn(&self, peer: usize) -> Result<Conn, String> {
        let outs = self.outs.lock().unwrap_or_else(|p| p.into_inner());
        outs.get(peer)
            .cloned()
            .flatten()
            .ok_or_else(|| format!("no connection to node {peer}"))
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
