//! The control bus over the mesh: keyed all-gathers of small messages, the
//! [`pipetrain_actors::Bus`] through which every worker reaches the same decisions.
//! Every worker sends its message for a key to every other; a gather ends once a message
//! from each is in. Messages for keys nobody waits on yet are kept until someone does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pipetrain_actors::{ActorError, Bus, Gathered};
use tokio::sync::Notify;

use super::mesh::Mesh;
use super::BUS;

/// Each key's messages so far, by node.
type Pending = HashMap<String, Vec<Option<Vec<u8>>>>;

/// The bus of one worker.
pub struct MeshBus {
    mesh: Arc<Mesh>,
    pending: Arc<(Mutex<Pending>, Notify)>,
}

impl MeshBus {
    /// The bus over `mesh`; starts a task per peer filing its messages (on the current
    /// tokio runtime).
    pub fn new(mesh: Arc<Mesh>) -> MeshBus {
        let pending: Arc<(Mutex<Pending>, Notify)> = Arc::default();
        let n = mesh.nodes();
        for peer in (0..n).filter(|&p| p != mesh.me()) {
            let (mesh, pending) = (mesh.clone(), pending.clone());
            tokio::spawn(async move {
                while let Ok(bytes) = mesh.recv(peer, BUS).await {
                    let Some((key, data)) = decode(&bytes) else {
                        tracing::warn!("node {peer} sent a malformed bus message; ignored");
                        continue;
                    };
                    let mut p = pending.0.lock().unwrap_or_else(|e| e.into_inner());
                    p.entry(key).or_insert_with(|| vec![None; n])[peer] = Some(data);
                    drop(p);
                    pending.1.notify_waiters();
                }
            });
        }
        MeshBus { mesh, pending }
    }
}

fn encode(key: &str, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + key.len() + data.len());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(data);
    out
}

fn decode(bytes: &[u8]) -> Option<(String, Vec<u8>)> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let key = std::str::from_utf8(bytes.get(4..4usize.checked_add(len)?)?).ok()?;
    Some((key.to_owned(), bytes[4 + len..].to_vec()))
}

impl Bus for MeshBus {
    fn node(&self) -> usize {
        self.mesh.me()
    }

    fn nodes(&self) -> usize {
        self.mesh.nodes()
    }

    fn all_gather(&self, key: String, data: Vec<u8>) -> Gathered<'_> {
        Box::pin(async move {
            let (me, n) = (self.mesh.me(), self.mesh.nodes());
            let gone = |reason: String| ActorError::Peer { reason };
            let message = encode(&key, &data);
            {
                let mut p = self.pending.0.lock().unwrap_or_else(|e| e.into_inner());
                p.entry(key.clone()).or_insert_with(|| vec![None; n])[me] = Some(data);
            }
            for peer in (0..n).filter(|&p| p != me) {
                self.mesh
                    .send(peer, BUS, message.clone())
                    .await
                    .map_err(gone)?;
            }
            loop {
                let notified = self.pending.1.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let mut p = self.pending.0.lock().unwrap_or_else(|e| e.into_inner());
                    if p.get(&key).is_some_and(|v| v.iter().all(Option::is_some)) {
                        let all = p.remove(&key).unwrap_or_default();
                        return Ok(all.into_iter().flatten().collect());
                    }
                }
                tokio::select! {
                    _ = &mut notified => {}
                    why = self.mesh.failed() => return Err(gone(why)),
                }
            }
        })
    }
}
