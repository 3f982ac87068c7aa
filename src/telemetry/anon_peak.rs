//! The peak of the memory a process allocated (Linux's `RssAnon`), sampled while some
//! work runs.
//!
//! `VmHWM`, the kernel's own peak, also counts the pages of files the process maps. A
//! model whose weights are memory-mapped external data (`onnx::load_model`) has all of
//! them resident while graph building reads them, though they are the page cache's,
//! shared by every process of the machine and given back under memory pressure, not
//! the process's own. The kernel keeps no peak of anonymous memory alone, so this
//! samples it from a thread of its own.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the sampler reads `/proc/self/status`. A probe's peak lasts a few
/// milliseconds of a run that takes seconds; 2 ms costs about 1% of a core.
const EVERY: Duration = Duration::from_millis(2);

/// Samples the process's anonymous resident memory until dropped.
#[derive(Debug)]
pub struct AnonPeak {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AnonPeak {
    /// Starts sampling (on Linux; elsewhere [`AnonPeak::peak`] is `None`).
    pub fn start() -> AnonPeak {
        let peak = Arc::new(AtomicU64::new(anon_resident_bytes().unwrap_or(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = anon_resident_bytes().is_some().then(|| {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(now) = anon_resident_bytes() {
                        peak.fetch_max(now, Ordering::Relaxed);
                    }
                    std::thread::sleep(EVERY);
                }
            })
        });
        AnonPeak { peak, stop, thread }
    }

    /// The highest anonymous resident bytes seen so far; `None` where the system does
    /// not say.
    pub fn peak(&self) -> Option<u64> {
        let now = anon_resident_bytes()?;
        self.thread.as_ref()?;
        Some(self.peak.fetch_max(now, Ordering::Relaxed).max(now))
    }
}

impl Drop for AnonPeak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The process's anonymous resident memory now (Linux's `RssAnon`); `None` elsewhere.
pub fn anon_resident_bytes() -> Option<u64> {
    super::laps::status_bytes("RssAnon:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_allocated_and_freed_while_sampling_is_in_the_peak() {
        let sampler = AnonPeak::start();
        let before = sampler.peak().expect("Linux reports RssAnon");
        let block = vec![1u8; 256 << 20];
        std::hint::black_box(&block);
        std::thread::sleep(EVERY * 20);
        drop(block);
        let peak = sampler.peak().unwrap();
        assert!(peak >= before + (200 << 20), "{before} -> {peak}");
    }
}
