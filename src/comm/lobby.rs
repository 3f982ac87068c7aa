//! The lobby of an elastic job: before its mesh forms, the first node learns which
//! nodes have come back, and tells them.
//!
//! The first node listens at the rendezvous; every other node dials it, proving the
//! job's secret as the mesh's connections do (under the job name with `/lobby`, so no
//! lobby connection is taken for a mesh one). The first node waits until every node has
//! come or the wait is over, closes its listener, and sends each node that came the same
//! [`Gathered`]: who is present, and a fresh generation that names the mesh they form
//! next, so a node left behind cannot join it. The first node decides alone, so every
//! node agrees; the job cannot go on without it (as torchrun's static rendezvous host).

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::conn::{accept_loop, dial};
use super::frame::{read_frame_within, write_frame};
use super::handshake::Hello;

/// The lobby's one message (channel 0 is the handshake's, free after it).
const GATHERED: u32 = 0;

/// What the lobby decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gathered {
    /// The nodes present, ascending (the first node among them).
    pub present: Vec<usize>,
    /// Names the mesh the present nodes form next.
    pub generation: u64,
}

impl Gathered {
    /// The job name the mesh of this generation proves: `job` and the generation.
    pub fn mesh_job(&self, job: &str) -> String {
        format!("{job}/{:016x}", self.generation)
    }
}

/// The first node's side: listens on `listen` until each of the other `nodes - 1` has
/// come, or `wait` is over; tells each who came.
///
/// # Errors
/// The listener cannot bind; no randomness for the generation.
pub async fn host_lobby(
    listen: SocketAddr,
    nodes: usize,
    job: &str,
    secret: &[u8],
    wait: Duration,
) -> Result<Gathered, String> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let hello = Hello::new(0, &lobby_job(job))?;
    let (came, arrivals) = flume::unbounded();
    let acceptor = tokio::spawn(accept_loop(
        listener,
        0,
        nodes,
        hello,
        secret.into(),
        came,
        wait,
    ));
    let deadline = Instant::now() + wait;
    let mut streams = Vec::new();
    while streams.len() + 1 < nodes {
        match tokio::time::timeout_at(deadline, arrivals.recv_async()).await {
            Ok(Ok(arrival)) => streams.push(arrival),
            _ => break,
        }
    }
    // Closed before anyone hears, so the mesh's dials never reach the lobby.
    acceptor.abort();
    let _ = acceptor.await;
    streams.sort_by_key(|(j, _)| *j);
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness: {e}"))?;
    let gathered = Gathered {
        present: std::iter::once(0)
            .chain(streams.iter().map(|(j, _)| *j))
            .collect(),
        generation: u64::from_le_bytes(bytes),
    };
    let message = serde_json::to_vec(&gathered).map_err(|e| e.to_string())?;
    for (j, s) in &mut streams {
        let told = async {
            write_frame(s, GATHERED, &message).await?;
            s.flush().await
        };
        if let Err(e) = told.await {
            // It goes in `present` all the same: the mesh then fails to form, naming it.
            tracing::warn!("lobby: could not tell node {j} who came: {e}");
        }
    }
    Ok(gathered)
}

/// Another node's side: dials the first node at `rendezvous` (named `first` in
/// messages) as node `me` until it answers or `wait` is over, and waits for its word.
///
/// # Errors
/// The first node did not answer, refused our proof, or said nothing in time.
pub async fn join_lobby(
    me: usize,
    rendezvous: SocketAddr,
    first: &str,
    job: &str,
    secret: &[u8],
    wait: Duration,
) -> Result<Gathered, String> {
    let hello = Hello::new(me as u32, &lobby_job(job))?;
    let mut s = dial(rendezvous, 0, first, &hello, secret, Instant::now() + wait).await?;
    // The first node may have started its wait up to `wait` after ours.
    let frame = read_frame_within(&mut s, 1 << 20, 2 * wait)
        .await
        .map_err(|e| format!("node {first} ({rendezvous}) said nothing of the job: {e}"))?;
    let gathered: Gathered = serde_json::from_slice(&frame.bytes)
        .map_err(|e| format!("node {first} ({rendezvous}) sent a malformed word: {e}"))?;
    match gathered.present.contains(&me) {
        true => Ok(gathered),
        false => Err(format!("node {first} left this node out of the job")),
    }
}

fn lobby_job(job: &str) -> String {
    format!("{job}/lobby")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three of four nodes come: the host waits out its wait, then all three hear the
    /// same word; a node with another secret is refused and not counted.
    #[tokio::test]
    async fn the_host_tells_everyone_who_came() {
        let addr: SocketAddr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (secret, wait) = (b"0123456789abcdef0123".as_slice(), Duration::from_secs(2));
        let host = tokio::spawn(host_lobby(addr, 4, "j", secret, wait));
        let join = |me: usize, secret: &'static [u8]| {
            tokio::spawn(join_lobby(me, addr, "a", "j", secret, wait))
        };
        let (b, d) = (
            join(1, b"0123456789abcdef0123"),
            join(3, b"0123456789abcdef0123"),
        );
        let stranger = join(2, b"another secret, same length");
        let host = host.await.unwrap().unwrap();
        assert_eq!(host.present, vec![0, 1, 3]);
        assert_eq!(b.await.unwrap().unwrap(), host);
        assert_eq!(d.await.unwrap().unwrap(), host);
        assert!(stranger.await.unwrap().is_err());
        assert_ne!(host.mesh_job("j"), "j");
    }
}
