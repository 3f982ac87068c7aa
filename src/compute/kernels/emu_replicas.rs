//! Data-parallel replicas summing their gradients in device memory
//! (`compute/replicas.rs`), run on the CPU: the group's protocol with `sum_replicas`
//! under the emulator, against the host's in-process all-reduce.

use pipetrain_actors::{Collective, LocalCollective};

use super::emu::Emulator;
use super::emu_tests::{at, bits, wave};
use super::{sum_replicas, UPDATE_SOURCE};
use crate::compute::{DeviceSpan, GradBuffer, ReplicaGroup};
use crate::{Error, Result};

/// A replica's gradients in host memory, summed by the emulated kernel.
struct EmuGrads<'a> {
    emu: &'a Emulator,
    ptr: *mut f32,
    len: usize,
    table: Vec<u64>,
}

// SAFETY: the test drives every replica from one thread; the pointers are only used
// while the buffers they point into live.
unsafe impl Send for EmuGrads<'_> {}

fn addr(span: &DeviceSpan, offset: usize) -> u64 {
    (span.addr + offset * size_of::<f32>()) as u64
}

impl GradBuffer for EmuGrads<'_> {
    fn grads(&self) -> DeviceSpan {
        DeviceSpan {
            device: crate::compute::Device::Cuda(0),
            addr: self.ptr as usize,
            len: self.len,
        }
    }

    fn sum_grads(&mut self, sources: &[DeviceSpan], range: std::ops::Range<usize>) -> Result<()> {
        self.table = sources.iter().map(|s| addr(s, range.start)).collect();
        let dst = addr(&self.grads(), range.start);
        let plan = [sum_replicas(
            dst,
            at(&self.table),
            sources.len(),
            range.len(),
        )];
        // SAFETY: every source and the destination hold `range` (the group checked the
        // lengths), and the table holds `sources.len()` addresses.
        unsafe { self.emu.run(&plan) }.map_err(|reason| Error::Device {
            device: "emulator".into(),
            reason,
        })
    }

    fn copy_grads(&mut self, source: DeviceSpan, range: std::ops::Range<usize>) -> Result<()> {
        // SAFETY: both hold `range`; the source's owner does not write it in this phase.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (source.addr as *const f32).add(range.start),
                self.ptr.add(range.start),
                range.len(),
            )
        };
        Ok(())
    }
}

/// Three replicas' gradients, of magnitudes far enough apart that the order of their
/// sum shows in its bits.
fn replicas(n: usize) -> Vec<Vec<f32>> {
    (0..3)
        .map(|r| {
            let scale = 10f32.powi(r - 1);
            wave(n, 40 + r as u32).iter().map(|x| x * scale).collect()
        })
        .collect()
}

/// Every replica ends with the sum, bitwise the host all-reduce's (which adds in replica
/// order); a sum in another order would differ, so the check has teeth. 10,007 values
/// cut into three uneven chunks.
#[test]
fn replicas_on_one_device_sum_as_the_host_all_reduce_bitwise() {
    let emu = Emulator::compile(UPDATE_SOURCE, "update.cu");
    let n = 10_007;
    let mut bufs = replicas(n);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let host = rt.block_on(async {
        let host = LocalCollective::spawn(1, 3, &mut tokio::task::JoinSet::new());
        let (a, b, c) = tokio::join!(
            host.all_reduce_sum(0, 0, bufs[0].clone()),
            host.all_reduce_sum(0, 1, bufs[1].clone()),
            host.all_reduce_sum(0, 2, bufs[2].clone()),
        );
        [a.unwrap(), b.unwrap(), c.unwrap()]
    });
    let reversed: Vec<f32> = (0..n)
        .map(|i| bufs[2][i] + bufs[1][i] + bufs[0][i])
        .collect();
    assert!(
        bits(&reversed) != bits(&host[0]),
        "the order shows in the bits"
    );

    let group = ReplicaGroup::new(3);
    let mut grads: Vec<EmuGrads<'_>> = bufs
        .iter_mut()
        .map(|b| EmuGrads {
            emu: &emu,
            ptr: b.as_mut_ptr(),
            len: n,
            table: Vec::new(),
        })
        .collect();
    let [g0, g1, g2] = &mut grads[..] else {
        unreachable!()
    };
    let (l0, l1, l2) = (group.link(0), group.link(1), group.link(2));
    let done = rt
        .block_on(async { tokio::join!(l0.all_reduce(g0), l1.all_reduce(g1), l2.all_reduce(g2)) });
    for (r, d) in [done.0, done.1, done.2].into_iter().enumerate() {
        d.unwrap_or_else(|e| panic!("replica {r}: {e}"));
    }
    drop(grads);
    for (r, (got, want)) in bufs.iter().zip(&host).enumerate() {
        let differ = (bits(got).iter().zip(bits(want)))
            .filter(|(a, b)| *a != b)
            .count();
        assert_eq!(differ, 0, "replica {r}: {differ} of {n} sums differ");
    }
}

/// A replica whose gradients are of another length fails the round for every replica,
/// naming it, and no one waits for ever.
#[test]
fn replicas_of_other_lengths_fail_the_round_saying_which() {
    let emu = Emulator::compile(UPDATE_SOURCE, "update.cu");
    let (mut a, mut b) = (wave(100, 1), wave(90, 2));
    let group = ReplicaGroup::new(2);
    let mut ga = EmuGrads {
        emu: &emu,
        ptr: a.as_mut_ptr(),
        len: a.len(),
        table: Vec::new(),
    };
    let mut gb = EmuGrads {
        emu: &emu,
        ptr: b.as_mut_ptr(),
        len: b.len(),
        table: Vec::new(),
    };
    let (l0, l1) = (group.link(0), group.link(1));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (ra, rb) =
        rt.block_on(async { tokio::join!(l0.all_reduce(&mut ga), l1.all_reduce(&mut gb)) });
    let (ea, eb) = (ra.unwrap_err().to_string(), rb.unwrap_err().to_string());
    assert!(ea.contains("replica 1's gradients are 90 values"), "{ea}");
    assert!(eb.contains("replica 0's gradients are 100 values"), "{eb}");
}
