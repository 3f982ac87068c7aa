//! The checkpoints folder (`checkpoints_dir`): one folder per checkpoint, `step-NNNNNNNN`,
//! made complete atomically. Shards go into a temporary folder, the manifest is written
//! last, then the folder is renamed into place and the parent synced: a crash at any
//! moment leaves either a complete checkpoint or a folder that is never loaded.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pipetrain_actors::{BoxError, Checkpointer, CommitState, ShardFile};

use super::manifest::Manifest;
use crate::{Error, Result};

/// A complete checkpoint's folder name.
pub fn folder_name(steps_done: u64) -> String {
    format!("step-{steps_done:08}")
}

/// The steps of a checkpoint folder's name.
fn parse_folder(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Prefix of folders still being written.
const TEMP: &str = ".tmp-";
/// Prefix of folders being deleted.
const DOOMED: &str = ".del-";

/// Removes the folders a run left unfinished in `root` (checkpoints it was writing when it
/// failed or was cancelled, and folders it was deleting); how many.
///
/// # Errors
/// `Io` naming the folder that could not be read or removed.
pub fn remove_unfinished(root: &Path) -> Result<usize> {
    let mut removed = 0;
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(root)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(Error::io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(TEMP) || name.starts_with(DOOMED) {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(Error::io(&path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// A checkpoint folder found in a checkpoints folder.
#[derive(Debug)]
pub struct Listed {
    /// Steps its name says it holds.
    pub steps_done: u64,
    /// The folder.
    pub path: PathBuf,
    /// Its manifest, or why it is not a complete checkpoint.
    pub manifest: Result<Manifest>,
}

/// Every `step-*` folder of `root`, oldest first, each with its manifest or the reason
/// it cannot be loaded (temporary and half-deleted folders are not listed).
///
/// # Errors
/// `Io` when `root` cannot be read.
pub fn list(root: &Path) -> Result<Vec<Listed>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).map_err(Error::io(root))? {
        let entry = entry.map_err(Error::io(root))?;
        let name = entry.file_name();
        let Some(steps_done) = name.to_str().and_then(parse_folder) else {
            continue;
        };
        let path = entry.path();
        let manifest = Manifest::read(&path).and_then(|m| files_present(&path, m));
        out.push(Listed {
            steps_done,
            path,
            manifest,
        });
    }
    out.sort_by_key(|l| l.steps_done);
    Ok(out)
}

/// The manifest, when every file it names is there with its recorded length (the CRC
/// is checked when the checkpoint is loaded).
fn files_present(dir: &Path, m: Manifest) -> Result<Manifest> {
    for s in &m.shards {
        let path = dir.join(&s.file);
        let len = std::fs::metadata(&path).map_err(Error::io(&path))?.len();
        if len != s.bytes {
            return Err(Error::Checkpoint {
                path,
                reason: format!(
                    "{len} bytes, the manifest says {} (truncated or altered)",
                    s.bytes
                ),
            });
        }
    }
    Ok(m)
}

/// The newest complete checkpoint of `root`, if any: what `--resume` loads. Incomplete
/// ones (no manifest, missing or short files) are skipped with a warning.
///
/// # Errors
/// `Io` when `root` exists but cannot be read.
pub fn latest_complete(root: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    if !root.exists() {
        return Ok(None);
    }
    let mut best = None;
    for l in list(root)? {
        match l.manifest {
            Ok(m) => best = Some((l.path, m)),
            Err(e) => tracing::warn!("skipping {}: {e}", l.path.display()),
        }
    }
    Ok(best)
}

/// Which checkpoints to delete so that the newest `keep` remain (`steps` in any order).
pub fn to_delete(steps: &[u64], keep: usize) -> Vec<u64> {
    let mut sorted = steps.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let excess = sorted.len().saturating_sub(keep);
    sorted.truncate(excess);
    sorted
}

/// Makes the manifest of a checkpoint from the coordinator's state and the shards.
pub type ManifestFn = Arc<dyn Fn(CommitState, Vec<ShardFile>) -> Manifest + Send + Sync>;

/// Checkpoints in a folder of their own, with keep-N retention.
pub struct DirCheckpointer {
    root: PathBuf,
    keep: Option<usize>,
    manifest: ManifestFn,
}

impl DirCheckpointer {
    /// Checkpoints in `root` (made if missing), keeping the newest `keep` (all when
    /// `None`). Leftovers of a crashed run (temporary or half-deleted folders) are
    /// removed.
    ///
    /// # Errors
    /// `Io` when `root` cannot be made or read.
    pub fn new(root: &Path, keep: Option<usize>, manifest: ManifestFn) -> Result<DirCheckpointer> {
        std::fs::create_dir_all(root).map_err(Error::io(root))?;
        let removed = remove_unfinished(root)?;
        if removed > 0 {
            tracing::info!(
                "removed {removed} unfinished folder(s) in {} (left by an interrupted run)",
                root.display()
            );
        }
        Ok(DirCheckpointer {
            root: root.to_path_buf(),
            keep,
            manifest,
        })
    }

    fn commit_checked(
        &self,
        dir: &Path,
        state: CommitState,
        shards: Vec<ShardFile>,
    ) -> Result<PathBuf> {
        let manifest = (self.manifest)(state, shards);
        manifest.write_synced(dir)?;
        sync_dir(dir)?;
        let target = self.root.join(folder_name(state.steps_done));
        if target.exists() {
            // A resumed run saving a step again: the old folder goes first.
            self.remove(&target)?;
        }
        std::fs::rename(dir, &target).map_err(Error::io(&target))?;
        sync_dir(&self.root)?;
        if let Some(keep) = self.keep {
            let complete: Vec<u64> = list(&self.root)?
                .into_iter()
                .filter(|l| l.manifest.is_ok())
                .map(|l| l.steps_done)
                .collect();
            for steps in to_delete(&complete, keep) {
                self.remove(&self.root.join(folder_name(steps)))?;
            }
        }
        Ok(target)
    }

    /// Deletes a checkpoint folder: renamed out of the `step-*` names first (atomic), so
    /// a crash halfway through deleting never leaves a partial folder that looks whole.
    fn remove(&self, dir: &Path) -> Result<()> {
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into());
        let doomed = self
            .root
            .join(format!("{DOOMED}{name}-{}", std::process::id()));
        std::fs::rename(dir, &doomed).map_err(Error::io(dir))?;
        sync_dir(&self.root)?;
        std::fs::remove_dir_all(&doomed).map_err(Error::io(&doomed))
    }
}

impl Checkpointer for DirCheckpointer {
    /// The step's temporary folder, made unless there. It is never emptied here: the
    /// processes of a multi-node job sharing `checkpoints_dir` each prepare the same step,
    /// and one emptying it would delete (or pull from under) the shards another already
    /// writes. A folder left by a crashed run was removed when this one started
    /// ([`DirCheckpointer::new`]); shard files are rewritten whole, by name.
    fn prepare(&self, steps_done: u64) -> Result<PathBuf, BoxError> {
        let dir = self.root.join(format!("{TEMP}{}", folder_name(steps_done)));
        std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
        Ok(dir)
    }

    fn commit(
        &self,
        dir: &Path,
        state: CommitState,
        shards: Vec<ShardFile>,
    ) -> Result<PathBuf, BoxError> {
        Ok(self.commit_checked(dir, state, shards)?)
    }
}

/// Syncs a folder, so that the names in it (a rename, a new file) survive a crash.
fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(Error::io(dir))
}

/// The pause between the pieces of a shard write, for crash tests (see
/// [`super::shard::write_synced`]).
pub fn slow_write(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest() {
        assert_eq!(to_delete(&[30, 10, 20, 40], 2), vec![10, 20]);
        assert_eq!(to_delete(&[10, 20], 2), Vec::<u64>::new());
        assert_eq!(to_delete(&[10, 20], 5), Vec::<u64>::new());
        assert_eq!(to_delete(&[10, 20, 30], 1), vec![10, 20]);
        assert_eq!(to_delete(&[], 0), Vec::<u64>::new());
    }

    /// Two processes of one job sharing the folder prepare the same step: the second
    /// finds the first's shard still there (it once emptied the folder under it).
    #[test]
    fn preparing_a_step_again_keeps_the_shards_written_into_it() {
        let root = tempfile::tempdir().unwrap();
        let make: ManifestFn = Arc::new(|_, _| unreachable!("nothing is committed here"));
        let (a, b) = (
            DirCheckpointer::new(root.path(), None, make.clone()).unwrap(),
            DirCheckpointer::new(root.path(), None, make).unwrap(),
        );
        let dir = a.prepare(7).unwrap();
        std::fs::write(dir.join("stage-000.params.safetensors"), b"shard").unwrap();
        assert_eq!(b.prepare(7).unwrap(), dir);
        assert_eq!(
            std::fs::read(dir.join("stage-000.params.safetensors")).unwrap(),
            b"shard"
        );
    }

    #[test]
    fn folder_names_round_trip() {
        assert_eq!(folder_name(42), "step-00000042");
        assert_eq!(parse_folder(&folder_name(42)), Some(42));
        assert_eq!(parse_folder(".tmp-step-00000042"), None);
        assert_eq!(parse_folder("step-x"), None);
    }
}
