//! The wall time of the phases of long work (building the graphs, opening the sessions),
//! and the process's peak resident memory at the end of each, for one log line that says
//! where the time and memory before the first step went.

use std::time::{Duration, Instant};

/// Phases timed one after another: each [`Laps::lap`] ends the phase that began at the
/// previous one (or at [`Laps::start`]).
#[derive(Debug)]
pub struct Laps {
    start: Instant,
    last: Instant,
    laps: Vec<(&'static str, Duration)>,
    /// The process's peak resident bytes at the end of each lap, where the system says.
    peaks: Vec<Option<u64>>,
}

impl Laps {
    /// Starts the clock of the first phase.
    pub fn start() -> Laps {
        let now = Instant::now();
        Laps {
            start: now,
            last: now,
            laps: Vec::new(),
            peaks: Vec::new(),
        }
    }

    /// Ends the phase called `what`, which began at the previous lap.
    pub fn lap(&mut self, what: &'static str) {
        let now = Instant::now();
        self.laps.push((what, now - self.last));
        self.peaks.push(peak_resident_bytes());
        self.last = now;
    }

    /// The phases' times so far, in order.
    pub fn laps(&self) -> &[(&'static str, Duration)] {
        &self.laps
    }

    /// `"12.3 s (loading the model 0.6 s, graphs 4.1 s / peak 1.62 GB, ...)"`: the time
    /// since the start and each phase's, with the process's peak resident memory where it
    /// grew in that phase.
    pub fn summary(&self) -> String {
        let mut before = None;
        let parts: Vec<String> = self
            .laps
            .iter()
            .zip(&self.peaks)
            .map(|((what, d), &peak)| {
                let grew = peak.filter(|&p| Some(p) != before);
                before = peak;
                match grew {
                    Some(p) => format!(
                        "{what} {:.1} s / peak {:.2} GB",
                        d.as_secs_f64(),
                        p as f64 / 1e9
                    ),
                    None => format!("{what} {:.1} s", d.as_secs_f64()),
                }
            })
            .collect();
        format!(
            "{:.1} s ({})",
            (self.last - self.start).as_secs_f64(),
            parts.join(", ")
        )
    }
}

/// The process's peak resident memory so far (Linux's `VmHWM`); `None` elsewhere.
pub fn peak_resident_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// A memory line of `/proc/self/status` (`field` with its colon), in bytes; `None` off
/// Linux.
pub(super) fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_each_phase_in_order_and_the_total_is_their_sum() {
        let mut laps = Laps::start();
        std::thread::sleep(Duration::from_millis(20));
        laps.lap("first");
        laps.lap("second");
        let s = laps.summary();
        assert!(s.find("first").unwrap() < s.find("second").unwrap(), "{s}");
        let total: Duration = laps.laps().iter().map(|(_, d)| *d).sum();
        assert!(total >= Duration::from_millis(20));
        assert_eq!(total, laps.last - laps.start);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn the_peak_grows_with_memory_touched() {
        let before = peak_resident_bytes().expect("Linux reports VmHWM");
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        assert!(peak_resident_bytes().unwrap() >= before.max(64 << 20));
    }
}
