//! ONNX Runtime's `.pb` training shards, on real files: packing an `.npz` and reading it
//! back bit for bit; the `onnx` Python package reading our shards and writing shards we
//! read; damaged files refused naming file, sample and feature; the shuffled sample order;
//! batches across epochs and per-rank parts; `[data.shards]` in a configuration, whose
//! batches train the built-in MLP to the same weights as the `.npz` they were packed from.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use pipetrain::api::Trainer;
use pipetrain::config::TrainConfig;
use pipetrain::data::shards::{pack, read_shard, write_shard, Sample, ShardDataset};
use pipetrain::data::{open_step_batches, read_npz, write_npz, BatchSource, Batches, StepBatches};
use pipetrain::tensor::{Tensor, TensorData, TensorMap};

const ROWS: usize = 10;

/// Arrays of every element type, `ROWS` rows each, values that tell rows apart
/// (including -0.0 and a subnormal, which only a bit-exact path keeps).
fn arrays() -> Vec<(String, Tensor)> {
    let x: Vec<f32> = (0..ROWS * 3)
        .map(|i| match i {
            4 => -0.0,
            5 => f32::from_bits(1),
            _ => i as f32 * 0.37 - 2.0,
        })
        .collect();
    let t = |shape: Vec<usize>, data| Tensor::new(shape, data).unwrap();
    vec![
        ("x".into(), t(vec![ROWS, 3], TensorData::F32(x))),
        (
            "w".into(),
            t(
                vec![ROWS, 2],
                TensorData::F64((0..ROWS * 2).map(|i| i as f64 / 7.0).collect()),
            ),
        ),
        (
            "y".into(),
            t(
                vec![ROWS],
                TensorData::I64((0..ROWS as i64).map(|i| i * 1001 - 3).collect()),
            ),
        ),
        (
            "k".into(),
            t(
                vec![ROWS, 1],
                TensorData::I32((0..ROWS as i32).map(|i| -i).collect()),
            ),
        ),
        (
            "m".into(),
            t(
                vec![ROWS, 2, 2],
                TensorData::Bool((0..ROWS * 4).map(|i| i % 3 == 0).collect()),
            ),
        ),
    ]
}

fn write_arrays(dir: &Path) -> PathBuf {
    let path = dir.join("data.npz");
    let a = arrays();
    let refs: Vec<(&str, &Tensor)> = a.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_npz(&path, &refs).unwrap();
    path
}

/// Packs the arrays 4 samples to a shard: files of 4, 4 and 2 samples.
fn packed(dir: &Path) -> (PathBuf, Vec<PathBuf>) {
    let npz = write_arrays(dir);
    let out = dir.join("shards");
    let files = pack(&npz, &out, 4, "train").unwrap();
    (out, files)
}

/// The elements' bits, so that -0.0 and NaN payloads count.
/// A tensor's shape and its elements' bits.
type Bits = (Vec<usize>, Vec<u64>);

fn bits(t: &Tensor) -> Bits {
    let v = match &t.data {
        TensorData::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        TensorData::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::I64(v) => v.iter().map(|&x| x as u64).collect(),
        TensorData::I32(v) => v.iter().map(|&x| x as u32 as u64).collect(),
        TensorData::Bool(v) => v.iter().map(|&x| u64::from(x)).collect(),
    };
    (t.shape.clone(), v)
}

fn row(t: &Tensor, i: usize) -> Tensor {
    let mut r = t.gather_rows(&[i]).unwrap();
    r.shape.remove(0);
    r
}

fn no_map() -> BTreeMap<String, String> {
    BTreeMap::new()
}

#[test]
fn packed_npz_reads_back_bit_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, files) = packed(tmp.path());
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["train_00000.pb", "train_00001.pb", "train_00002.pb"]
    );
    let samples: Vec<Sample> = files.iter().flat_map(|f| read_shard(f).unwrap()).collect();
    assert_eq!(samples.len(), ROWS);
    for (name, t) in arrays() {
        for (i, s) in samples.iter().enumerate() {
            assert_eq!(bits(&s[&name]), bits(&row(&t, i)), "{name} row {i}");
        }
    }
    // And as one batch of the whole set, in file order.
    let set = ShardDataset::open(&tmp.path().join("shards"), &no_map(), ROWS, None).unwrap();
    let batch = set.batch(0).unwrap();
    for (name, t) in arrays() {
        assert_eq!(bits(&batch[&name]), bits(&t), "{name}");
    }
    // Packing twice into one folder would mix the shards.
    let npz = tmp.path().join("data.npz");
    let err = pack(&npz, &tmp.path().join("shards"), 4, "b").unwrap_err();
    assert!(err.to_string().contains("already holds .pb files"), "{err}");
}

/// The onnx package reads our shards exactly as `DataLoader::LoadOneSample` does, and
/// writes a shard (by the same layout) that we read.
#[test]
fn the_onnx_package_agrees_on_the_layout() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import onnx, numpy"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import onnx and numpy (run `bash scripts/setup.sh`)",
        python.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = packed(tmp.path());
    let theirs = tmp.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    let script = r#"
import os, struct, sys
import numpy as np
from onnx import TensorProto, numpy_helper

npz, shards, out = sys.argv[1:4]
want = np.load(npz)
i = 0
for name in sorted(os.listdir(shards)):
    data = open(os.path.join(shards, name), "rb").read()
    pos = 0
    while pos < len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        read = 0
        seen = set()
        while read < size:
            (fsize,) = struct.unpack_from("<I", data, pos + read)
            t = TensorProto()
            t.ParseFromString(data[pos + read + 4 : pos + read + 4 + fsize])
            a = numpy_helper.to_array(t)
            w = want[t.name][i]
            assert a.dtype == w.dtype and a.shape == w.shape, (t.name, a.dtype, a.shape)
            assert a.tobytes() == w.tobytes(), (t.name, i)
            seen.add(t.name)
            read += 4 + fsize
        assert read == size and seen == set(want.files), (read, size, seen)
        pos += size
        i += 1
assert i == len(want["y"]), i

with open(os.path.join(out, "part_0.pb"), "wb") as f:
    for s in range(3):
        feats = [numpy_helper.from_array(np.arange(4, dtype=np.float32).reshape(2, 2) * s, "a"),
                 numpy_helper.from_array(np.array(s, dtype=np.int64), "b")]
        body = b"".join(struct.pack("<I", len(b)) + b for b in (t.SerializeToString() for t in feats))
        f.write(struct.pack("<I", len(body)) + body)
print("ok", i)
"#;
    let out = Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(tmp.path().join("data.npz"))
        .arg(&dir)
        .arg(&theirs)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.starts_with(&format!("ok {ROWS}")), "{text}");
    let samples = read_shard(&theirs.join("part_0.pb")).unwrap();
    assert_eq!(samples.len(), 3);
    let a = &samples[2]["a"];
    assert_eq!(a.shape, [2, 2]);
    assert_eq!(a.as_f32().unwrap(), &[0.0, 2.0, 4.0, 6.0]);
    assert_eq!(samples[2]["b"].as_i64().unwrap(), &[2]);
    assert!(samples[2]["b"].shape.is_empty());
}

/// A shard's samples written by hand: `x` f32 [2] and `y` i64, with `bad` at sample `k`.
fn shard_with(path: &Path, k: usize, bad: Option<Tensor>) {
    let samples: Vec<Sample> = (0..5)
        .map(|i| {
            let mut s = Sample::new();
            s.insert("x".into(), Tensor::f32(vec![2], vec![i as f32; 2]).unwrap());
            s.insert("y".into(), Tensor::i64(vec![], vec![i as i64]).unwrap());
            if i == k {
                if let Some(b) = &bad {
                    s.insert("x".into(), b.clone());
                }
            }
            s
        })
        .collect();
    write_shard(path, &samples).unwrap();
}

fn refused(path: &Path, sample: usize, feature: &str, reason: &str) {
    let err = read_shard(path).unwrap_err().to_string();
    let file = path.file_name().unwrap().to_string_lossy();
    assert!(err.contains(&*file), "{err}");
    assert!(err.contains(&format!("sample {sample}:")), "{err}");
    assert!(err.contains(&format!("feature `{feature}`")), "{err}");
    assert!(err.contains(reason), "{err}");
}

#[test]
fn damaged_shards_are_refused_naming_file_sample_and_feature() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("s_0.pb");
    shard_with(&path, 0, None);
    let good = std::fs::read(&path).unwrap();
    assert_eq!(read_shard(&path).unwrap().len(), 5);
    let record = good.len() / 5;

    // Cut inside the last sample's last feature (`y`, its data after its name).
    std::fs::write(&path, &good[..good.len() - 2]).unwrap();
    refused(&path, 4, "y", "the file ends inside this feature");
    // A data set says the same when it opens the folder (it counts samples by seeking).
    let err = ShardDataset::open(tmp.path(), &no_map(), 1, None)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("s_0.pb: sample 4: feature `y`: the file ends"),
        "{err}"
    );
    // Stray bytes after the last sample.
    std::fs::write(&path, [&good[..], &[1, 2]].concat()).unwrap();
    refused(&path, 5, "(whole sample)", "2 stray bytes");
    // The last sample's length says more than the file holds.
    let mut long = good.clone();
    let last = 4 * record;
    long[last..last + 4].copy_from_slice(&(record as u32 + 96).to_le_bytes());
    std::fs::write(&path, &long).unwrap();
    refused(&path, 4, "(whole sample)", "the file ends after");
    // Sample 1's length ends inside its `y`.
    let mut short = good.clone();
    short[record..record + 4].copy_from_slice(&(record as u32 - 7).to_le_bytes());
    std::fs::write(&path, &short).unwrap();
    refused(&path, 1, "y", "runs past the end of its");
    // Sample 2's first feature is not a TensorProto (a wire type protobuf lacks).
    let mut garbage = good.clone();
    garbage[2 * record + 8] = 0xff;
    std::fs::write(&path, &garbage).unwrap();
    refused(&path, 2, "#0", "not a valid TensorProto");
    // Sample 3's `x` of another element type, then of another shape.
    shard_with(&path, 3, Some(Tensor::f64(vec![2], vec![0.0; 2]).unwrap()));
    refused(&path, 3, "x", "F64 [2], but the first sample's is F32 [2]");
    shard_with(&path, 3, Some(Tensor::f32(vec![3], vec![0.0; 3]).unwrap()));
    refused(&path, 3, "x", "F32 [3], but the first sample's is F32 [2]");

    // A data set refuses a file that disagrees with its first file.
    let dir = tmp.path().join("set");
    std::fs::create_dir(&dir).unwrap();
    shard_with(&dir.join("a.pb"), 9, None);
    let mut odd = Sample::new();
    odd.insert("x".into(), Tensor::i64(vec![2], vec![0; 2]).unwrap());
    odd.insert("y".into(), Tensor::i64(vec![], vec![0]).unwrap());
    write_shard(&dir.join("b.pb"), &[odd]).unwrap();
    let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    let err = ShardDataset::open(&dir, &map(&[("z", "x")]), 1, None)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("a.pb: sample 0: feature `z`: named in input_name_map"),
        "{err}"
    );
    let err = ShardDataset::open(&dir, &map(&[("x", "in"), ("y", "in")]), 1, None)
        .err()
        .unwrap();
    assert!(err.to_string().contains("two features feed `in`"), "{err}");
    let set = ShardDataset::open(&dir, &no_map(), 6, None).unwrap();
    let err = set.batch(0).unwrap_err().to_string();
    assert!(err.contains("b.pb: sample 0: feature `x`: I64"), "{err}");
}

fn order_of(set: &ShardDataset, epoch: usize) -> Vec<usize> {
    set.order(epoch).unwrap().to_vec()
}

#[test]
fn shuffles_are_seeded_permutations_that_change_per_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = packed(tmp.path());
    let open = |seed| ShardDataset::open(&dir, &no_map(), 4, seed).unwrap();
    let (a, a2, b) = (open(Some(7)), open(Some(7)), open(Some(8)));
    for e in 0..3 {
        let mut sorted = order_of(&a, e);
        assert_eq!(order_of(&a, e), order_of(&a2, e), "same seed, epoch {e}");
        sorted.sort();
        assert_eq!(
            sorted,
            (0..ROWS).collect::<Vec<_>>(),
            "epoch {e} is a permutation"
        );
    }
    assert_ne!(order_of(&a, 0), order_of(&b, 0));
    assert_ne!(order_of(&a, 0), order_of(&a, 1));
    assert_eq!(order_of(&open(None), 1), (0..ROWS).collect::<Vec<_>>());
    // Every batch of an epoch together: each sample once.
    let y = |set: &ShardDataset, s| set.batch(s).unwrap()["y"].as_i64().unwrap().to_vec();
    let mut seen: Vec<i64> = (0..2).flat_map(|s| y(&a, s)).collect();
    seen.extend(&y(&a, 2)[..2]);
    seen.sort();
    let all: Vec<i64> = (0..ROWS as i64).map(|i| i * 1001 - 3).collect();
    assert_eq!(seen, all);
    assert_eq!(y(&a, 5), y(&a2, 5));
}

#[test]
fn batches_run_on_across_epochs_and_parts_are_their_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = packed(tmp.path());
    let y_of = |i: usize| i as i64 * 1001 - 3;
    // In file order, step 2 of 4-sample batches is samples 8, 9, then 0, 1.
    let plain = ShardDataset::open(&dir, &no_map(), 4, None).unwrap();
    assert_eq!(plain.position(2), (0, 8));
    assert_eq!(plain.position(3), (1, 2));
    let want: Vec<i64> = [8, 9, 0, 1].map(y_of).to_vec();
    assert_eq!(plain.batch(2).unwrap()["y"].as_i64().unwrap(), want);
    // Shuffled, it is the end of epoch 0's order then the start of epoch 1's.
    let shuffled = ShardDataset::open(&dir, &no_map(), 4, Some(3)).unwrap();
    let (e0, e1) = (order_of(&shuffled, 0), order_of(&shuffled, 1));
    let want: Vec<i64> = [e0[8], e0[9], e1[0], e1[1]].map(y_of).to_vec();
    assert_eq!(shuffled.batch(2).unwrap()["y"].as_i64().unwrap(), want);
    // A cache of one shard, evicting on almost every sample, gives the same batches.
    let small = ShardDataset::open(&dir, &no_map(), 4, Some(3))
        .unwrap()
        .with_cache_files(1);
    for step in [0, 2, 1, 7, 2] {
        let (a, b) = (small.batch(step).unwrap(), shuffled.batch(step).unwrap());
        for (name, t) in &a {
            assert_eq!(bits(t), bits(&b[name]), "step {step} {name}");
        }
    }
    // Each rank's part is its rows of the global batch.
    for step in 0..6 {
        let whole = shuffled.batch(step).unwrap();
        for part in 0..2 {
            let p = shuffled.part(step, part, 2).unwrap();
            for (name, t) in &whole {
                let rows = t.gather_rows(&[2 * part, 2 * part + 1]).unwrap();
                assert_eq!(
                    bits(&p[name]),
                    bits(&rows),
                    "step {step} part {part} {name}"
                );
            }
        }
    }
}

/// The built-in MLP's configuration text over `data` (a `[data]` table's body).
fn mlp_text(data: &str) -> String {
    format!(
        r#"
batch_size = 4
gradient_accumulation_steps = 2
num_train_steps = 8
[model]
kind = "mlp"
inputs = 3
hidden = [5]
classes = 4
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.1
[runtime]
intra_op_threads = 1
[data]
{data}
"#
    )
}

fn mlp_config(dir: &Path, name: &str, data: &str) -> (TrainConfig, PathBuf) {
    let path = dir.join(name);
    std::fs::write(&path, mlp_text(data)).unwrap();
    (TrainConfig::load(&path).unwrap(), path)
}

/// The `.npz` with `y` as class labels (0..4) and only the MLP's arrays.
fn mlp_npz(dir: &Path) -> PathBuf {
    let a = arrays();
    let x = a[0].1.clone();
    let y = Tensor::i64(vec![ROWS], (0..ROWS as i64).map(|i| i % 4).collect()).unwrap();
    let path = dir.join("mlp.npz");
    write_npz(&path, &[("features", &x), ("y", &y)]).unwrap();
    path
}

#[test]
fn data_shards_in_a_config_give_the_npz_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let npz = mlp_npz(tmp.path());
    pack(&npz, &tmp.path().join("train"), 3, "part").unwrap();
    let layout = r#"path = "mlp.npz"
layout = { kind = "arrays", feeds = { x = "features", y = "y" } }"#;
    let (file_cfg, file_path) = mlp_config(tmp.path(), "file.toml", layout);
    let shards = r#"[data.shards]
train_data_dir = "train"
input_name_map = { features = "x", y = "y" }"#;
    let (cfg, path) = mlp_config(tmp.path(), "shards.toml", shards);
    let spec = cfg.data.shards.as_ref().unwrap();
    assert_eq!(spec.train_data_dir, tmp.path().join("train"));
    let global = cfg.global_batch();
    let (set, order_len, rows) = open_step_batches(&cfg.data, global, 1, &path).unwrap();
    assert_eq!((order_len, rows), (None, ROWS));
    let file = Batches::open(&file_cfg.data, global, &file_path).unwrap();
    for step in 0..5 {
        let (a, b) = (set.batch(step).unwrap(), file.batch(step).unwrap());
        let keys = |m: &TensorMap| {
            let mut k: Vec<String> = m.keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&a), ["x", "y"]);
        assert_eq!(keys(&a), keys(&b));
        for (name, t) in &a {
            assert_eq!(bits(t), bits(&b[name]), "step {step} {name}");
        }
    }
    // Without shards the same call is `Batches::open`.
    let (_, order_len, rows) = open_step_batches(&file_cfg.data, global, 1, &file_path).unwrap();
    assert_eq!((order_len, rows), (None, ROWS));
    // Rules: shards exclude a file and a layout; unknown keys and oversized batches fail.
    let both = format!("{layout}\n{shards}");
    let err = TrainConfig::parse(&mlp_text(&both), &path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("field `data.path`: does not apply to `shards`"),
        "{err}"
    );
    let typo = format!("{shards}\nshufle_seed = 3");
    let err = TrainConfig::parse(&mlp_text(&typo), &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shufle_seed"), "{err}");
    let (no_layout, _) = mlp_config(tmp.path(), "bare.toml", "path = \"mlp.npz\"");
    let Err(err) = open_step_batches(&no_layout.data, global, 1, &path) else {
        panic!("a data file without a layout was accepted");
    };
    assert!(
        err.to_string().contains("field `data.layout`: missing"),
        "{err}"
    );
    // Evaluation reads `test_data_dir` in file order.
    let eval = format!("{shards}\ntest_data_dir = \"test\"\nshuffle_seed = 4");
    let (with_test, _) = mlp_config(tmp.path(), "eval.toml", &eval);
    let e = with_test.eval_data().shards.unwrap();
    assert_eq!(e.train_data_dir, tmp.path().join("test"));
    assert_eq!(e.shuffle_seed, None);
    let Err(err) = open_step_batches(&cfg.data, ROWS + 1, 1, &path) else {
        panic!("a batch larger than the data set was accepted");
    };
    assert!(err.to_string().contains("field `batch_size`"), "{err}");
}

/// A configuration's step batches handed to a run as a service's data.
struct Fed(Box<dyn StepBatches>);

impl BatchSource for Fed {
    fn batch(&self, step: u64) -> Result<TensorMap, pipetrain_actors::BoxError> {
        Ok(self.0.batch(step as usize)?)
    }
}

fn weight_bits(p: &[(String, Tensor)]) -> Vec<(String, Bits)> {
    let mut v: Vec<_> = p.iter().map(|(n, t)| (n.clone(), bits(t))).collect();
    v.sort();
    v
}

/// A configuration's `[data.shards]` trains the weights of the same samples in an `.npz`
/// file, read by the run itself and handed in by a service alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_train_the_mlp_like_the_npz() {
    let tmp = tempfile::tempdir().unwrap();
    let npz = mlp_npz(tmp.path());
    pack(&npz, &tmp.path().join("train"), 4, "part").unwrap();
    let (file_cfg, file_path) = mlp_config(
        tmp.path(),
        "file.toml",
        "path = \"mlp.npz\"\nlayout = { kind = \"arrays\", feeds = { x = \"features\", y = \"y\" } }",
    );
    let (cfg, path) = mlp_config(
        tmp.path(),
        "shards.toml",
        "[data.shards]\ntrain_data_dir = \"train\"\ninput_name_map = { features = \"x\", y = \"y\" }",
    );
    let rt = common::runtime();
    let want = tokio::task::block_in_place(|| {
        pipetrain::train::train(&rt, &file_cfg, &file_path, false, |_| {}).unwrap()
    });
    let from_config = tokio::task::block_in_place(|| {
        pipetrain::train::train(&rt, &cfg, &path, false, |_| {}).unwrap()
    });
    assert_eq!(
        weight_bits(&from_config.parameters),
        weight_bits(&want.parameters)
    );
    let (set, _, _) = open_step_batches(&cfg.data, cfg.global_batch(), 1, &path).unwrap();
    let handle = Trainer::new(cfg.clone())
        .with_data(Fed(set))
        .start(&rt)
        .unwrap();
    let got = handle.wait().await.unwrap();
    assert_eq!(got.steps, want.steps);
    assert!(!want.parameters.is_empty());
    assert_eq!(weight_bits(&got.parameters), weight_bits(&want.parameters));
    // The batches matter: the same shards shuffled train other weights.
    let mut shuffled = cfg.clone();
    shuffled.data.shards.as_mut().unwrap().shuffle_seed = Some(1);
    let (set, _, _) = open_step_batches(&shuffled.data, cfg.global_batch(), 1, &path).unwrap();
    let handle = Trainer::new(shuffled)
        .with_data(Fed(set))
        .start(&rt)
        .unwrap();
    let other = handle.wait().await.unwrap();
    assert_ne!(
        weight_bits(&other.parameters),
        weight_bits(&want.parameters)
    );
}

#[test]
fn the_cli_packs_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let npz = write_arrays(tmp.path());
    let out = tmp.path().join("cli");
    let run = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["data", "pack", "--input"])
        .arg(&npz)
        .arg("--out")
        .arg(&out)
        .args(["--samples-per-shard", "3", "--prefix", "bert"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let files = pipetrain::data::shards::shard_files(&out).unwrap();
    let names: Vec<_> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "bert_00000.pb",
            "bert_00001.pb",
            "bert_00002.pb",
            "bert_00003.pb"
        ]
    );
    let set = ShardDataset::open(&out, &no_map(), ROWS, None).unwrap();
    let want = read_npz(&npz).unwrap();
    for (name, t) in set.batch(0).unwrap() {
        assert_eq!(bits(&t), bits(&want[&name]), "{name}");
    }
}
