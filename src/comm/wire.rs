//! Activations and gradients on the wire, and the links that carry them between workers.
//!
//! A transfer is encoded as: target replica and rank (u32 each), flow (u8: 0 activations,
//! 1 gradients), stage and micro-batch (u32 each), tensor count (u32), then per tensor
//! its name (u16 length + UTF-8), ONNX data type (i32), rank (u8), dimensions (u64 each)
//! and elements (little-endian). Decoding checks every length against what is left and
//! every element count against the shape, so bad bytes give an error, never a panic or
//! an allocation larger than the frame.

use std::collections::HashMap;
use std::sync::Arc;

use pipetrain_actors::{Flow, Mailboxes, Transfer};

use super::mesh::Mesh;
use super::DATA;
use crate::pipeline::Payload;
use crate::tensor::{DType, Tensor, TensorData};

/// A transfer for the member (`replica`, `rank`), as bytes; values in a device's memory
/// are copied to the host first.
///
/// # Errors
/// What failed to copy a value from its device, in words.
pub fn encode(replica: usize, rank: usize, t: &Transfer<Payload>) -> Result<Vec<u8>, String> {
    let mut names: Vec<&String> = t.payload.keys().collect();
    names.sort();
    let tensors = (names.iter())
        .map(|n| t.payload[*n].to_host(n).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, String>>()?;
    let size = 21
        + names
            .iter()
            .zip(&tensors)
            .map(|(n, tensor)| {
                2 + n.len() + 5 + 8 * tensor.shape.len() + tensor.len() * tensor.dtype().size()
            })
            .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    for v in [replica as u32, rank as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.push(match t.flow {
        Flow::Act => 0,
        Flow::Grad => 1,
    });
    for v in [t.stage as u32, t.mb as u32, t.payload.len() as u32] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for (name, tensor) in names.into_iter().zip(&tensors) {
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&tensor.dtype().onnx().to_le_bytes());
        out.push(tensor.shape.len() as u8);
        for &d in &tensor.shape {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        match &tensor.data {
            TensorData::F32(v) => put_le(&mut out, v),
            TensorData::F64(v) => put_le(&mut out, v),
            TensorData::I64(v) => put_le(&mut out, v),
            TensorData::I32(v) => put_le(&mut out, v),
            TensorData::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        }
    }
    Ok(out)
}

/// Appends `values` little-endian: in one copy where this machine is little-endian.
fn put_le<T: bytemuck::Pod>(out: &mut Vec<u8>, values: &[T]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        for v in values {
            out.extend(bytemuck::bytes_of(v).iter().rev());
        }
    }
}

/// The little-endian values in `raw` (a whole number of them).
fn values_le<T: bytemuck::Pod>(raw: &[u8]) -> Vec<T> {
    let mut values = vec![T::zeroed(); raw.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut values).copy_from_slice(raw);
    if cfg!(target_endian = "big") {
        for v in &mut values {
            bytemuck::bytes_of_mut(v).reverse();
        }
    }
    values
}

/// Reads what [`encode`] wrote.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end
            .ok_or_else(|| format!("ends at byte {} where {n} more were due", self.bytes.len()))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| "short")?))
    }
}

/// The member (replica, rank) and the transfer in `bytes`.
///
/// # Errors
/// What is wrong with the bytes, in words.
pub fn decode(bytes: &[u8]) -> Result<((usize, usize), Transfer<Payload>), String> {
    let mut r = Reader { bytes, at: 0 };
    let member = (r.u32()? as usize, r.u32()? as usize);
    let flow = match r.u8()? {
        0 => Flow::Act,
        1 => Flow::Grad,
        f => return Err(format!("unknown flow {f}")),
    };
    let (stage, mb, count) = (r.u32()? as usize, r.u32()? as usize, r.u32()?);
    let mut payload = HashMap::new();
    for _ in 0..count {
        let len = r.u16()? as usize;
        let name = std::str::from_utf8(r.take(len)?)
            .map_err(|_| "a tensor name is not UTF-8".to_string())?
            .to_owned();
        let code = r.u32()? as i32;
        let dtype =
            DType::from_onnx(code).ok_or_else(|| format!("`{name}`: unknown data type {code}"))?;
        let ndim = r.u8()? as usize;
        let mut shape = Vec::with_capacity(ndim);
        let mut numel: usize = 1;
        for _ in 0..ndim {
            let d = usize::try_from(r.u64()?)
                .map_err(|_| format!("`{name}`: a dimension too large"))?;
            numel = numel
                .checked_mul(d)
                .ok_or_else(|| format!("`{name}`: too many elements"))?;
            shape.push(d);
        }
        let width = match dtype {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bool => 1,
        };
        let size = numel
            .checked_mul(width)
            .ok_or_else(|| format!("`{name}`: too many elements"))?;
        let raw = r.take(size).map_err(|e| format!("`{name}`: {e}"))?;
        let data = match dtype {
            DType::F32 => TensorData::F32(values_le(raw)),
            DType::I32 => TensorData::I32(values_le(raw)),
            DType::F64 => TensorData::F64(values_le(raw)),
            DType::I64 => TensorData::I64(values_le(raw)),
            DType::Bool => TensorData::Bool(raw.iter().map(|&b| b != 0).collect()),
        };
        let tensor = Tensor::new(shape, data).map_err(|e| format!("`{name}`: {e}"))?;
        payload.insert(name, Arc::new(tensor.into()));
    }
    if r.at != bytes.len() {
        return Err(format!("{} bytes left over", bytes.len() - r.at));
    }
    Ok((
        member,
        Transfer {
            flow,
            stage,
            mb,
            payload,
        },
    ))
}

/// Hands a process's own mailboxes to the transport (see [`link_transfers`]).
pub type Deliver = Box<dyn FnOnce(Mailboxes<Payload>) + Send>;

/// The transport's two halves for [`pipetrain_actors::Distribution`]: mailboxes for the
/// members other nodes run (`owner[replica][rank]` is a member's node), whose messages
/// go out over `mesh`, and the hand-over of this node's own mailboxes, into which what
/// arrives from other nodes is delivered. Tasks start on the current tokio runtime.
pub fn link_transfers(mesh: Arc<Mesh>, owner: Vec<Vec<usize>>) -> (Mailboxes<Payload>, Deliver) {
    let me = mesh.me();
    let mut peers = HashMap::new();
    for (replica, ranks) in owner.iter().enumerate() {
        for (rank, &node) in ranks.iter().enumerate() {
            if node == me {
                continue;
            }
            let (tx, rx) = flume::unbounded::<Transfer<Payload>>();
            peers.insert((replica, rank), tx);
            let mesh = mesh.clone();
            tokio::spawn(async move {
                while let Ok(t) = rx.recv_async().await {
                    let bytes = match encode(replica, rank, &t) {
                        Ok(bytes) => bytes,
                        Err(why) => {
                            mesh_fail(&mesh, format!("a transfer to node {node} could not be read from its device: {why}"));
                            return;
                        }
                    };
                    if let Err(why) = mesh.send_slice(node, DATA, &bytes).await {
                        tracing::debug!("a transfer to node {node} was not sent: {why}");
                        return;
                    }
                }
            });
        }
    }
    let nodes = mesh.nodes();
    let deliver = Box::new(move |mine: Mailboxes<Payload>| {
        let mine = Arc::new(mine);
        for peer in (0..nodes).filter(|&p| p != me) {
            let (mesh, mine) = (mesh.clone(), mine.clone());
            tokio::spawn(async move {
                while let Ok(bytes) = mesh.recv(peer, DATA).await {
                    let decoded = decode(&bytes);
                    mesh.recycle(bytes);
                    match decoded {
                        Ok((member, t)) => match mine.get(&member) {
                            Some(tx) => {
                                let _ = tx.send(t);
                            }
                            None => tracing::warn!("node {peer} sent a transfer for {member:?}, which does not run here"),
                        },
                        Err(why) => {
                            mesh_fail(&mesh, format!("node {peer} sent a malformed transfer: {why}"));
                            return;
                        }
                    }
                }
            });
        }
    });
    (peers, deliver)
}

fn mesh_fail(mesh: &Mesh, why: String) {
    tracing::error!("{why}");
    mesh.abort();
}
