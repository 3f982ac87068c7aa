//! Grids of generated schedules shared by the integration tests.
#![allow(dead_code)] // each test binary uses part of this module

use pipetrain_schedules::{
    dualpipe_v, gpipe, interleaved_1f1b, one_f_one_b, v_half, v_min, zb_h1, zb_v, Schedule,
    ScheduleError,
};

/// Largest pipeline the grids cover.
pub const MAX_STAGES: usize = 8;
/// Largest micro-batch count the grids cover.
pub const MAX_MICRO_BATCHES: usize = 32;
/// Largest virtual-stage count the interleaved grid covers.
pub const MAX_VIRTUAL: usize = 4;

/// A generated schedule and what made it.
pub struct Case {
    pub name: String,
    pub ranks: usize,
    pub virtual_stages: usize,
    pub micro_batches: usize,
    pub schedule: Schedule,
}

/// Every generator over stages 1..=8 x micro-batches 1..=32 (x virtual stages 1..=4 for
/// interleaved), skipping the combinations a generator refuses by its documented rule.
pub fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for p in 1..=MAX_STAGES {
        for m in 1..=MAX_MICRO_BATCHES {
            let mut push = |name: &str, v: usize, made: Result<Schedule, ScheduleError>| match made
            {
                Ok(schedule) => cases.push(Case {
                    name: format!("{name}(p={p}, v={v}, m={m})"),
                    ranks: p,
                    virtual_stages: v,
                    micro_batches: m,
                    schedule,
                }),
                Err(ScheduleError::MicroBatchesNotMultipleOfRounds { .. })
                | Err(ScheduleError::TooFewMicroBatches { .. }) => {}
                Err(e) => panic!("{name}(p={p}, v={v}, m={m}): {e}"),
            };
            push("gpipe", 1, gpipe(p, m));
            push("1f1b", 1, one_f_one_b(p, m));
            push("zb_h1", 1, zb_h1(p, m));
            push("zb_v", 2, zb_v(p, m));
            push("dualpipe_v", 2, dualpipe_v(p, m));
            push("v_half", 2, v_half(p, m));
            push("v_min", 2, v_min(p, m));
            for v in 1..=MAX_VIRTUAL {
                push("interleaved_1f1b", v, interleaved_1f1b(p, v, m));
            }
        }
    }
    cases
}

/// `a` and `b` equal up to rounding.
pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}
