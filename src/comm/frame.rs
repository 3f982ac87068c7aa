//! Frames on a byte stream: a 4-byte channel, an 8-byte length (both little-endian),
//! then that many bytes. A length over the reader's maximum is refused before anything
//! is allocated, and a stream that ends inside a frame is told apart from one that ends
//! between frames.

use std::future::Future;
use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes before a frame's payload.
pub const HEADER: usize = 12;

/// The largest frame a connection accepts by default (activations and ring segments
/// are far smaller; a corrupt length must not become a 16 EiB allocation).
pub const MAX_FRAME: u64 = 1 << 30;

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Which logical channel it belongs to.
    pub channel: u32,
    /// Its payload.
    pub bytes: Vec<u8>,
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended between frames: the peer closed the connection.
    #[error("closed the connection")]
    Closed,
    /// The stream ended inside a frame.
    #[error("closed the connection inside a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes of the frame received.
        got: usize,
        /// Bytes the frame needed.
        want: usize,
    },
    /// A frame longer than allowed.
    #[error("sent a frame of {len} bytes, more than the {max} allowed")]
    TooLarge {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Nothing arrived for the reader's idle limit.
    #[error("sent nothing for {0:?}")]
    Silent(Duration),
    /// Reading failed.
    #[error("read failed: {0}")]
    Io(#[from] io::Error),
}

/// The header of a frame of `len` bytes on `channel`.
pub fn header(channel: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&channel.to_le_bytes());
    h[4..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// Parses the first frame of `buf`: `Ok(None)` when `buf` holds only part of one, else
/// the frame and the bytes it took.
///
/// # Errors
/// `TooLarge` when the announced length exceeds `max`.
pub fn parse(buf: &[u8], max: u64) -> Result<Option<(Frame, usize)>, FrameError> {
    let Some(h) = buf.get(..HEADER) else {
        return Ok(None);
    };
    let channel = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let len = u64::from_le_bytes([h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11]]);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let end = HEADER + len as usize;
    Ok(buf.get(HEADER..end).map(|bytes| {
        let frame = Frame {
            channel,
            bytes: bytes.to_vec(),
        };
        (frame, end)
    }))
}

/// Writes one frame (not flushed).
///
/// # Errors
/// What writing returned.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    channel: u32,
    bytes: &[u8],
) -> io::Result<()> {
    w.write_all(&header(channel, bytes.len())).await?;
    w.write_all(bytes).await
}

/// Reads one frame of at most `max` bytes.
///
/// # Errors
/// [`FrameError`]: closed, truncated, too large, or the read failing.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: u64) -> Result<Frame, FrameError> {
    read(r, max, None, Vec::with_capacity).await
}

/// [`read_frame`], failing with [`FrameError::Silent`] when the stream goes `idle` with
/// no byte arriving: before the frame starts, or in the middle of it. A large frame
/// that keeps arriving is never cut off, however long it takes in all.
///
/// # Errors
/// As [`read_frame`], and `Silent`.
pub async fn read_frame_within<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    idle: Duration,
) -> Result<Frame, FrameError> {
    read(r, max, Some(idle), Vec::with_capacity).await
}

/// [`read_frame_within`], reading the payload into `buffer(len)`: an empty vector the
/// caller hands out for a payload of `len` bytes (one of its own to reuse, so large
/// frames do not each fault in fresh pages).
///
/// # Errors
/// As [`read_frame_within`].
pub async fn read_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    idle: Duration,
    buffer: impl FnOnce(usize) -> Vec<u8>,
) -> Result<Frame, FrameError> {
    read(r, max, Some(idle), buffer).await
}

/// `step`, failing as `Silent` when it takes longer than `idle`.
async fn within<T>(
    idle: Option<Duration>,
    step: impl Future<Output = io::Result<T>>,
) -> Result<T, FrameError> {
    match idle {
        None => Ok(step.await?),
        Some(idle) => match tokio::time::timeout(idle, step).await {
            Ok(got) => Ok(got?),
            Err(_) => Err(FrameError::Silent(idle)),
        },
    }
}

async fn read<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    idle: Option<Duration>,
    buffer: impl FnOnce(usize) -> Vec<u8>,
) -> Result<Frame, FrameError> {
    let mut h = [0u8; HEADER];
    let got = within(idle, read_full(r, &mut h)).await?;
    if got == 0 {
        return Err(FrameError::Closed);
    }
    if got < HEADER {
        return Err(FrameError::Truncated { got, want: HEADER });
    }
    let channel = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let len = u64::from_le_bytes([h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11]]);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    // Read straight into the spare capacity: no zero-filling of large frames.
    let mut bytes = buffer(len as usize);
    bytes.clear();
    bytes.reserve_exact(len as usize);
    let mut body = (&mut *r).take(len);
    while (bytes.len() as u64) < len {
        if within(idle, body.read_buf(&mut bytes)).await? == 0 {
            return Err(FrameError::Truncated {
                got: HEADER + bytes.len(),
                want: HEADER + len as usize,
            });
        }
    }
    Ok(Frame { channel, bytes })
}

/// Fills `buf` unless the stream ends first; the bytes read.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]).await? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}
