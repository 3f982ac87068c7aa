//! TensorBoard event files: what ONNX Runtime's `TrainingRunner` users watch (its
//! `log_dir`, `scalar_names`, `histogram_names`), written without TensorFlow.
//!
//! A file is a sequence of TFRecord records (`record`), each a protobuf `Event`
//! (`proto`): first `file_version: "brain.Event:2"`, then one event per scalar or
//! histogram, each with its step and wall time. Scalars are written in the legacy
//! `simple_value` form (an f32), which TensorBoard's scalar dashboard and its
//! `EventAccumulator` read directly; histograms as `HistogramProto` (`histogram` says how
//! they are bucketed).
//!
//! # Why not a crate
//! `tensorboard-rs` (0.5.9, last released 2022) was judged and not used: it depends on
//! the unmaintained rust-protobuf 2 line and `image` 0.23 (pipetrain already has `prost`),
//! writes from a background thread whose I/O errors end in `expect` rather than reaching
//! the caller, leaves `add_histogram` `unimplemented!()` (only pre-bucketed histograms),
//! and panics on some inputs. What it would save is small: the framing is 20 lines over
//! the `crc32c` crate, the messages five `prost` derives.

mod histogram;
mod proto;
mod record;

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

pub use histogram::BUCKETS as HISTOGRAM_BUCKETS;
use proto::{Event, Kind, Summary, Value, What};

use crate::{Error, Result};

/// How many sequence numbers [`TensorBoardWriter::create`] tries when names are taken.
const MAX_SEQUENCE: u32 = 10_000;

/// Writes one TensorBoard event file in a log folder.
///
/// Events go through a buffer: they reach the file on [`TensorBoardWriter::flush`], when
/// the buffer fills, and when the writer is dropped (a failure there is logged with
/// `tracing`, since `drop` cannot return it: call `flush` to see it). TensorBoard reads
/// a file while it grows and waits at a record cut short, so a crash loses at most the
/// events since the last flush.
#[derive(Debug)]
pub struct TensorBoardWriter {
    path: PathBuf,
    file: BufWriter<File>,
    /// The encoded event, reused so that writing allocates nothing once warm.
    encoded: Vec<u8>,
}

impl TensorBoardWriter {
    /// Creates `log_dir` (and its parents) and a new event file in it, named as TensorFlow
    /// and TensorBoard's own writer name theirs,
    /// `events.out.tfevents.<unix seconds, 10 digits>.<host name>.<pid>.<n>`, and writes
    /// the file-version event. `n` is the first number, from 0, whose name is free, so
    /// writers created in the same second never share a file (TensorBoard's writer uses
    /// a per-process counter instead; a free name is the same guarantee without global
    /// state, and holds across processes too).
    ///
    /// # Errors
    /// [`Error::Io`] naming the folder or the file when either cannot be created or
    /// written.
    pub fn create(log_dir: &Path) -> Result<TensorBoardWriter> {
        std::fs::create_dir_all(log_dir).map_err(Error::io(log_dir))?;
        let seconds = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = gethostname::gethostname();
        let host = host.to_string_lossy();
        let host = if host.is_empty() { "localhost" } else { &host };
        let prefix = format!(
            "events.out.tfevents.{seconds:010}.{host}.{}",
            std::process::id()
        );
        let mut n = 0;
        let (path, file) = loop {
            let path = log_dir.join(format!("{prefix}.{n}"));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == ErrorKind::AlreadyExists && n < MAX_SEQUENCE => n += 1,
                Err(e) => return Err(Error::io(path)(e)),
            }
        };
        let mut writer = TensorBoardWriter {
            path,
            file: BufWriter::new(file),
            encoded: Vec::new(),
        };
        writer.write(0, What::FileVersion("brain.Event:2".to_owned()))?;
        // Out at once, so that TensorBoard lists the run as soon as it starts and a folder
        // that accepts no writes fails here rather than at the first flush.
        writer.flush()?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `value` of series `tag` at `step`. TensorBoard stores scalars as f32, so
    /// `value` is rounded to the nearest f32.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when the buffer cannot be written out.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> Result<()> {
        // The rounding TensorBoard itself would do: f32 is the field's type.
        self.summary(tag, step, Kind::SimpleValue(value as f32))
    }

    /// Writes the histogram of `values` for series `tag` at `step`: min, max, count, sum,
    /// sum of squares, and [`HISTOGRAM_BUCKETS`] buckets of equal width over
    /// `[min, max]`, as TensorBoard's own writer buckets them. NaN and infinities are
    /// counted and summed but not bucketed.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when the buffer cannot be written out.
    pub fn histogram(&mut self, tag: &str, step: u64, values: &[f32]) -> Result<()> {
        self.summary(tag, step, Kind::Histo(histogram::histogram(values)))
    }

    /// Hands everything written so far to the operating system.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(Error::io(&self.path))
    }

    fn summary(&mut self, tag: &str, step: u64, kind: Kind) -> Result<()> {
        let value = Value {
            tag: tag.to_owned(),
            kind: Some(kind),
        };
        let summary = Summary { value: vec![value] };
        self.write(step, What::Summary(summary))
    }

    fn write(&mut self, step: u64, what: What) -> Result<()> {
        let wall_time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let event = Event {
            wall_time,
            // The field is an int64; no run gets near 2^63 steps, and saturating keeps the
            // series ordered if one did.
            step: i64::try_from(step).unwrap_or(i64::MAX),
            what: Some(what),
        };
        self.encoded.clear();
        // Encoding into a Vec only fails for lack of capacity, which a Vec grows.
        event
            .encode(&mut self.encoded)
            .map_err(std::io::Error::other)
            .map_err(Error::io(&self.path))?;
        record::write_record(&mut self.file, &self.encoded).map_err(Error::io(&self.path))
    }
}

impl Drop for TensorBoardWriter {
    fn drop(&mut self) {
        if let Err(e) = self.file.flush() {
            tracing::warn!(path = %self.path.display(), error = %e, "TensorBoard events lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(path: &Path) -> Vec<Event> {
        let bytes = std::fs::read(path).unwrap();
        record::read_records(&bytes)
            .unwrap()
            .into_iter()
            .map(|r| Event::decode(r).unwrap())
            .collect()
    }

    /// The file opens with the version event, each scalar is one event with its step,
    /// tag, f32 value and a current wall time, and dropping the writer flushes it.
    #[test]
    fn records_read_back_and_drop_flushes() {
        let dir = tempfile::tempdir().unwrap();
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let mut w = TensorBoardWriter::create(&dir.path().join("a/b")).unwrap();
        let path = w.path().to_owned();
        w.scalar("loss", 3, 0.1).unwrap();
        w.histogram("w", 4, &[1.0, 2.0]).unwrap();
        assert_eq!(
            events(&path).len(),
            1,
            "only the version event is flushed yet"
        );
        drop(w);
        let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let ev = events(&path);
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0].what, Some(What::FileVersion("brain.Event:2".into())));
        assert_eq!(ev[1].step, 3);
        let Some(What::Summary(s)) = &ev[1].what else {
            panic!("{:?}", ev[1])
        };
        assert_eq!(s.value[0].tag, "loss");
        assert_eq!(s.value[0].kind, Some(Kind::SimpleValue(0.1f32)));
        assert_eq!(ev[2].step, 4);
        for e in &ev {
            assert!(
                before.as_secs_f64() - 1e-3 <= e.wall_time,
                "{}",
                e.wall_time
            );
            assert!(e.wall_time <= after.as_secs_f64() + 1e-3, "{}", e.wall_time);
        }
    }

    /// Two writers in one folder within the same second get different files.
    #[test]
    fn names_follow_tensorflow_and_never_collide() {
        let dir = tempfile::tempdir().unwrap();
        let a = TensorBoardWriter::create(dir.path()).unwrap();
        let b = TensorBoardWriter::create(dir.path()).unwrap();
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_str().unwrap();
        let parts: Vec<&str> = name.split('.').collect();
        assert_eq!(parts[..3], ["events", "out", "tfevents"], "{name}");
        assert_eq!(parts[3].len(), 10, "{name}");
        assert!(parts[3].bytes().all(|b| b.is_ascii_digit()), "{name}");
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        let pid = std::process::id().to_string();
        let tail = format!(".{host}.{pid}.");
        assert!(name.contains(&tail), "{name} lacks {tail}");
        assert!(
            name.ends_with(".0"),
            "{name}: the first file of a fresh folder"
        );
    }

    /// A log folder that cannot be made (a file is in the way) is named in the error.
    #[test]
    fn io_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"").unwrap();
        let err = TensorBoardWriter::create(&blocker.join("logs")).unwrap_err();
        let Error::Io { path, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(path, &blocker.join("logs"));
        assert!(err
            .to_string()
            .starts_with(&blocker.join("logs").display().to_string()));
    }
}
