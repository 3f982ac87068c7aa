//! TensorBoard event files read back by TensorBoard itself: the `tensorboard` package's
//! `EventAccumulator` (what its dashboards load runs with) and its record reader's own
//! masked CRC-32C, from the project's venv (`bash scripts/setup.sh` installs it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use pipetrain::telemetry::{TensorBoardWriter, HISTOGRAM_BUCKETS};
use serde::Deserialize;

/// The venv's Python, with `tensorboard` importable; fails saying how to install it.
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `bash scripts/setup.sh`",
        python.display()
    );
    let ok = Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "the `tensorboard` package is missing from {}: run `bash scripts/setup.sh` ({})",
        python.display(),
        String::from_utf8_lossy(&ok.stderr).trim()
    );
    python
}

/// Reads the folder with `EventAccumulator`, checks every record's framing with
/// TensorBoard's `masked_crc32c`, and buckets each histogram's values (argv[2], f32 bit
/// patterns) with TensorBoard's own `histogram_pb`. Floats go out as bit patterns, so the
/// comparison is exact.
const READER: &str = r#"
import glob, json, struct, sys
import numpy as np
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.plugins.histogram.summary_v2 import histogram_pb
from tensorboard.util import tensor_util

logdir, values_path = sys.argv[1], sys.argv[2]
f32 = lambda x: struct.unpack("<I", struct.pack("<f", x))[0]
f64 = lambda x: struct.unpack("<Q", struct.pack("<d", x))[0]

(path,) = glob.glob(logdir + "/events.out.tfevents.*")
data, records, at = open(path, "rb").read(), 0, 0
while at < len(data):
    header = data[at:at + 8]
    assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header), "length crc"
    (n,) = struct.unpack("<Q", header)
    body = data[at + 12:at + 12 + n]
    assert struct.unpack("<I", data[at + 12 + n:at + 16 + n])[0] == masked_crc32c(body), "data crc"
    at, records = at + 16 + n, records + 1

acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
acc.Reload()
tags = acc.Tags()
out = {"file_version": acc.file_version, "records": records, "scalars": {}, "histograms": {}}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, f32(e.value), e.wall_time] for e in acc.Scalars(tag)]
for tag in tags["histograms"]:
    out["histograms"][tag] = [
        {"step": e.step, "min": f64(h.min), "max": f64(h.max), "num": h.num, "sum": f64(h.sum),
         "sum_squares": f64(h.sum_squares), "limits": [f64(x) for x in h.bucket_limit],
         "counts": list(h.bucket)}
        for e in acc.Histograms(tag) for h in [e.histogram_value]]
reference = {}
for key, bits in json.load(open(values_path)).items():
    values = np.array(bits, dtype=np.uint32).view(np.float32)
    b = tensor_util.make_ndarray(histogram_pb("t", values).value[0].tensor)
    reference[key] = {"limits": [f64(x) for x in b[:, 1]], "counts": [float(c) for c in b[:, 2]]}
out["reference"] = reference
print(json.dumps(out))
"#;

#[derive(Deserialize)]
struct Read {
    file_version: f64,
    records: usize,
    /// tag -> [step, f32 bits, wall time]
    scalars: BTreeMap<String, Vec<(u64, u32, f64)>>,
    histograms: BTreeMap<String, Vec<Histo>>,
    /// "tag@step" -> TensorBoard's own bucketing of the same values.
    reference: BTreeMap<String, Buckets>,
}

#[derive(Deserialize)]
struct Histo {
    step: u64,
    min: u64,
    max: u64,
    num: f64,
    sum: u64,
    sum_squares: u64,
    limits: Vec<u64>,
    counts: Vec<f64>,
}

#[derive(Deserialize)]
struct Buckets {
    limits: Vec<u64>,
    counts: Vec<f64>,
}

/// Deterministic values with a bell-ish shape (a sum of uniforms) at `scale`.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n).map(|_| (next() + next() + next()) * scale).collect()
}

/// Scalars at several steps and histograms at two, written as training would (steps
/// ascending, tags interleaved), come back from TensorBoard's reader with the same tags,
/// steps and values: scalars exactly as f32, histograms' min, max and count exactly, sum
/// and sum of squares to 1e-6, and buckets equal to TensorBoard's own bucketing of the
/// same values.
#[test]
fn tensorboard_reads_scalars_and_histograms() {
    let python = python();
    let tmp = tempfile::tempdir().unwrap();
    let logdir = tmp.path().join("run");
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let mut w = TensorBoardWriter::create(&logdir).unwrap();
    let mut scalars: BTreeMap<&str, Vec<(u64, f64)>> = BTreeMap::new();
    let mut histos: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let mut events = 1; // the file version
    for step in 0..10u64 {
        // 1/3-like values that f32 cannot hold exactly, so rounding is exercised.
        let loss = 2.0 / (step as f64 + 3.0);
        w.scalar("loss", step, loss).unwrap();
        scalars.entry("loss").or_default().push((step, loss));
        events += 1;
        if step % 3 == 0 {
            let lr = 1e-3 * 0.9f64.powi(step as i32);
            w.scalar("train/lr", step, lr).unwrap();
            scalars.entry("train/lr").or_default().push((step, lr));
            events += 1;
        }
        if step == 4 || step == 8 {
            for (tag, scale) in [("weights/stage0", 0.2f32), ("grads/stage0", 3e-6)] {
                let v = values(step * 7 + scale.to_bits() as u64, 5000, scale);
                w.histogram(tag, step, &v).unwrap();
                histos.insert(format!("{tag}@{step}"), v);
                events += 1;
            }
        }
        if step == 5 {
            // A flush mid-run: later events append to the same file.
            w.flush().unwrap();
        }
    }
    w.histogram("constant", 9, &[0.5; 7]).unwrap();
    events += 1;
    // No flush: dropping the writer must write the rest.
    drop(w);
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();

    let values_path = tmp.path().join("values.json");
    let bits: BTreeMap<&String, Vec<u32>> = histos
        .iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    std::fs::write(&values_path, serde_json::to_vec(&bits).unwrap()).unwrap();
    let res = Command::new(&python)
        .args(["-c", READER])
        .arg(&logdir)
        .arg(&values_path)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let read: Read = serde_json::from_slice(&res.stdout).unwrap();

    assert_eq!(read.file_version, 2.0, "brain.Event:2");
    assert_eq!(
        read.records, events,
        "every record passes TensorBoard's CRC checks"
    );

    assert_eq!(
        read.scalars.keys().collect::<Vec<_>>(),
        scalars.keys().collect::<Vec<_>>()
    );
    for (tag, want) in &scalars {
        let got = &read.scalars[*tag];
        let got_sv: Vec<(u64, u32)> = got.iter().map(|&(s, v, _)| (s, v)).collect();
        let want_sv: Vec<(u64, u32)> = want
            .iter()
            .map(|&(s, v)| (s, (v as f32).to_bits()))
            .collect();
        assert_eq!(got_sv, want_sv, "{tag}: steps and f32 values");
        for &(_, _, wall) in got {
            assert!(
                start - 1e-3 <= wall && wall <= end + 1e-3,
                "{tag}: wall time {wall}"
            );
        }
    }

    let mut tags: Vec<&str> = histos
        .keys()
        .map(|k| k.split('@').next().unwrap())
        .collect();
    tags.push("constant");
    tags.sort();
    tags.dedup();
    assert_eq!(read.histograms.keys().collect::<Vec<_>>(), tags);
    for (key, v) in &histos {
        let (tag, step) = key.split_once('@').unwrap();
        let step: u64 = step.parse().unwrap();
        let h = read.histograms[tag]
            .iter()
            .find(|h| h.step == step)
            .unwrap_or_else(|| panic!("{key} not read back"));
        let min = v.iter().copied().fold(f32::INFINITY, f32::min);
        let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = v.iter().map(|&x| f64::from(x)).sum();
        let abs: f64 = v.iter().map(|&x| f64::from(x).abs()).sum();
        let sum_squares: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert_eq!(h.min, f64::from(min).to_bits(), "{key}: min");
        assert_eq!(h.max, f64::from(max).to_bits(), "{key}: max");
        assert_eq!(h.num, v.len() as f64, "{key}: num");
        // Summed in f32 blocks: within 1e-6 (see the histogram module).
        let (got_sum, got_squares) = (f64::from_bits(h.sum), f64::from_bits(h.sum_squares));
        assert!(
            (got_sum - sum).abs() <= 1e-6 * abs,
            "{key}: sum {got_sum} vs {sum}"
        );
        assert!(
            (got_squares - sum_squares).abs() <= 1e-6 * sum_squares,
            "{key}: sum of squares {got_squares} vs {sum_squares}"
        );
        assert_eq!(h.counts.len(), HISTOGRAM_BUCKETS, "{key}");
        assert_eq!(h.counts.iter().sum::<f64>(), v.len() as f64, "{key}");
        let reference = &read.reference[key];
        assert_eq!(h.counts, reference.counts, "{key}: TensorBoard's buckets");
        assert_eq!(
            h.limits, reference.limits,
            "{key}: TensorBoard's bucket edges"
        );
    }
    let constant = &read.histograms["constant"];
    assert_eq!(constant.len(), 1);
    let c = &constant[0];
    assert_eq!((c.step, c.num), (9, 7.0));
    assert_eq!((f64::from_bits(c.min), f64::from_bits(c.max)), (0.5, 0.5));
    assert_eq!(f64::from_bits(c.sum), 3.5);
    assert_eq!(c.counts, [7.0]);
}
