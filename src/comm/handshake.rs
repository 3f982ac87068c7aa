//! Mutual authentication of two workers of one job by challenge-response over HMAC-SHA256:
//! each side sends a hello (protocol tag, its node index, the job's name, a fresh random
//! 32-byte nonce), then a proof: the HMAC, keyed by the shared secret, of both hellos and
//! which side it speaks for. A proof covers the other side's fresh nonce, so it cannot be
//! replayed; the secret itself never crosses the wire; proofs are checked in constant
//! time. A side that cannot prove the secret is refused, and learns nothing it could
//! use.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::frame::{read_frame, write_frame};

/// The first bytes of a hello.
const MAGIC: &[u8; 8] = b"PTRAIN01";
/// Channels of the handshake's two frames.
const HELLO: u32 = 0;
const PROOF: u32 = 1;
/// A hello is small; anything longer is not one.
const MAX_HELLO: u64 = 1024;

/// Which end of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Dialer,
    /// The side that accepted.
    Acceptor,
}

/// What one side says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Its node index.
    pub node: u32,
    /// Its job's name.
    pub job: String,
    /// A fresh random value.
    pub nonce: [u8; 32],
}

impl Hello {
    /// A hello with a fresh nonce from the operating system.
    ///
    /// # Errors
    /// When the operating system has no randomness to give.
    pub fn new(node: u32, job: &str) -> Result<Hello, String> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| format!("no randomness for a nonce: {e}"))?;
        Ok(Hello {
            node,
            job: job.to_owned(),
            nonce,
        })
    }

    /// Its bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 4 + 32 + 2 + self.job.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.node.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&(self.job.len() as u16).to_le_bytes());
        out.extend_from_slice(self.job.as_bytes());
        out
    }

    /// Parses a hello.
    ///
    /// # Errors
    /// What is wrong with `bytes`, in words.
    pub fn decode(bytes: &[u8]) -> Result<Hello, String> {
        if bytes.len() < 46 || &bytes[..8] != MAGIC {
            return Err("not a pipetrain hello (another program, or another version)".into());
        }
        let node = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&bytes[12..44]);
        let len = u16::from_le_bytes([bytes[44], bytes[45]]) as usize;
        let job = bytes
            .get(46..46 + len)
            .filter(|_| bytes.len() == 46 + len)
            .and_then(|b| std::str::from_utf8(b).ok())
            .ok_or("a malformed hello (job name)")?;
        Ok(Hello {
            node,
            job: job.to_owned(),
            nonce,
        })
    }
}

/// The proof `role` gives, over the dialer's and the acceptor's hellos.
fn proof(secret: &[u8], role: Role, dialer: &[u8], acceptor: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"pipetrain handshake v1");
    mac.update(match role {
        Role::Dialer => b"D",
        Role::Acceptor => b"A",
    });
    for part in [dialer, acceptor] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// Runs the handshake on `stream` as `role`, saying `mine`; the peer's hello once it
/// proved it holds `secret` and runs job `mine.job`.
///
/// # Errors
/// Why the peer is refused, in words: no answer within `timeout`, not a pipetrain
/// worker, another job, or a proof that does not verify (the wrong secret).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    role: Role,
    mine: &Hello,
    secret: &[u8],
    timeout: Duration,
) -> Result<Hello, String> {
    tokio::time::timeout(timeout, exchange(stream, role, mine, secret))
        .await
        .map_err(|_| format!("no handshake within {timeout:?}"))?
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    role: Role,
    mine: &Hello,
    secret: &[u8],
) -> Result<Hello, String> {
    let io = |e: std::io::Error| format!("handshake: {e}");
    let my_hello = mine.encode();
    write_frame(stream, HELLO, &my_hello).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let frame = read_frame(stream, MAX_HELLO)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    if frame.channel != HELLO {
        return Err("not a pipetrain hello (wrong frame)".into());
    }
    let theirs = Hello::decode(&frame.bytes)?;
    if theirs.job != mine.job {
        return Err(format!("runs job `{}`, not `{}`", theirs.job, mine.job));
    }
    let (dialer, acceptor) = match role {
        Role::Dialer => (&my_hello, &frame.bytes),
        Role::Acceptor => (&frame.bytes, &my_hello),
    };
    let (their_role, my_role) = match role {
        Role::Dialer => (Role::Acceptor, Role::Dialer),
        Role::Acceptor => (Role::Dialer, Role::Acceptor),
    };
    let my_proof = proof(secret, my_role, dialer, acceptor)
        .finalize()
        .into_bytes();
    write_frame(stream, PROOF, &my_proof).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let frame = read_frame(stream, MAX_HELLO).await.map_err(|e| {
        format!("handshake: {e} (it may have refused our proof: a different secret?)")
    })?;
    if frame.channel != PROOF {
        return Err("a malformed handshake (wrong frame)".into());
    }
    proof(secret, their_role, dialer, acceptor)
        .verify_slice(&frame.bytes)
        .map_err(|_| "its proof does not verify: it does not hold this job's secret".to_string())?;
    Ok(theirs)
}
