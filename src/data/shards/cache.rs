//! Decoded shard files: a least-recently-used cache, and a read-ahead thread that decodes
//! the files the coming steps will read while the current ones train.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::read::{check_like, read_shard, Sample};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One decoded shard: per sample, the fed tensors in `feeds` order.
pub(super) type Decoded = Arc<Vec<Vec<Tensor>>>;

/// The shard files of a data set and those of them kept decoded.
pub(super) struct FileCache {
    files: Vec<PathBuf>,
    /// The fed features, in the order of a decoded sample's tensors.
    features: Vec<String>,
    /// The first sample: what every sample must look like.
    first: Sample,
    state: Mutex<State>,
    /// Signalled when a file finishes loading (or fails to).
    loaded: Condvar,
}

struct State {
    capacity: usize,
    tick: u64,
    /// (file index, last use, samples).
    entries: Vec<(usize, u64, Decoded)>,
    /// Files being read now, by a step or by the read-ahead.
    loading: HashSet<usize>,
}

impl FileCache {
    pub(super) fn new(
        files: Vec<PathBuf>,
        features: Vec<String>,
        first: Sample,
        capacity: usize,
    ) -> FileCache {
        FileCache {
            files,
            features,
            first,
            state: Mutex::new(State {
                capacity: capacity.max(1),
                tick: 0,
                entries: Vec::new(),
                loading: HashSet::new(),
            }),
            loaded: Condvar::new(),
        }
    }

    pub(super) fn files(&self) -> &[PathBuf] {
        &self.files
    }

    pub(super) fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Keeps at most `files` decoded (at least one), dropping what is kept now.
    pub(super) fn set_capacity(&self, files: usize) {
        let mut s = self.lock();
        s.capacity = files.max(1);
        s.entries.clear();
    }

    /// Whether every file is decoded and kept now.
    pub(super) fn holds_all(&self) -> bool {
        self.lock().entries.len() == self.files.len()
    }

    /// Whether `file` is decoded and kept now.
    pub(super) fn is_cached(&self, file: usize) -> bool {
        self.lock().entries.iter().any(|e| e.0 == file)
    }

    /// Whether `file` is decoded or being read.
    fn is_cached_or_loading(&self, file: usize) -> bool {
        let s = self.lock();
        s.loading.contains(&file) || s.entries.iter().any(|e| e.0 == file)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A reader that panicked left the cache consistent (entries are replaced whole).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// File `file`'s samples: kept, or read by the read-ahead now (waited for), or read
    /// here.
    ///
    /// # Errors
    /// `Io`/`BadShard` when the file cannot be read or differs from the first sample.
    pub(super) fn get(&self, file: usize) -> Result<Decoded> {
        let mut s = self.lock();
        loop {
            s.tick += 1;
            let tick = s.tick;
            if let Some(entry) = s.entries.iter_mut().find(|e| e.0 == file) {
                entry.1 = tick;
                return Ok(entry.2.clone());
            }
            if !s.loading.contains(&file) {
                break;
            }
            s = self.loaded.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.loading.insert(file);
        drop(s);
        // Read without the lock: other steps' readers need not wait for this file.
        let read = self.read(file).map(Arc::new);
        let mut s = self.lock();
        s.loading.remove(&file);
        if let Ok(fed) = &read {
            let tick = s.tick;
            s.entries.push((file, tick, fed.clone()));
            if s.entries.len() > s.capacity {
                if let Some(oldest) = (0..s.entries.len()).min_by_key(|&i| s.entries[i].1) {
                    s.entries.remove(oldest);
                }
            }
        }
        drop(s);
        self.loaded.notify_all();
        read
    }

    /// Reads and checks file `file`, keeping the fed features of each sample.
    fn read(&self, file: usize) -> Result<Vec<Vec<Tensor>>> {
        let path = &self.files[file];
        let samples = read_shard(path)?;
        if let Some(s) = samples.first() {
            check_like(path, 0, s, &self.first)?;
        }
        let mut fed = Vec::with_capacity(samples.len());
        for (i, mut s) in samples.into_iter().enumerate() {
            // `read_shard` checked every sample against the file's first, and that one
            // was checked against the data set's: each fed feature is there.
            let row = self.features.iter().map(|f| {
                s.remove(f).ok_or_else(|| Error::BadShard {
                    path: path.clone(),
                    sample: i,
                    feature: f.clone(),
                    reason: "missing".into(),
                })
            });
            fed.push(row.collect::<Result<Vec<Tensor>>>()?);
        }
        Ok(fed)
    }
}

/// Files asked for ahead and not yet taken by the read-ahead thread, at most.
const QUEUE: usize = 16;

/// A thread that decodes the files asked for ahead of their steps into the cache. A file
/// it cannot read is left alone: the step that needs it reads it again and reports why.
pub(super) struct ReadAhead {
    tx: Option<flume::Sender<usize>>,
    thread: Option<JoinHandle<()>>,
    cache: Arc<FileCache>,
}

impl ReadAhead {
    pub(super) fn start(cache: Arc<FileCache>) -> ReadAhead {
        let (tx, rx) = flume::bounded::<usize>(QUEUE);
        let reader = cache.clone();
        let thread = std::thread::Builder::new()
            .name("shard-read-ahead".into())
            .spawn(move || {
                while let Ok(file) = rx.recv() {
                    if !reader.is_cached_or_loading(file) {
                        let _ = reader.get(file);
                    }
                }
            })
            .ok();
        ReadAhead {
            tx: thread.is_some().then_some(tx),
            thread,
            cache,
        }
    }

    /// Asks for `files` (in the order the steps will read them) to be decoded ahead: as
    /// many as the cache can keep beside the files of the step being read (`now`), so
    /// that reading ahead never evicts what a step is about to take.
    pub(super) fn ask(&self, now: usize, files: impl IntoIterator<Item = usize>) {
        let Some(tx) = &self.tx else { return };
        let room = self.cache.capacity().saturating_sub(now);
        for file in files.into_iter().take(room) {
            if !self.cache.is_cached_or_loading(file) && tx.try_send(file).is_err() {
                return;
            }
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
