//! Shards split among data-parallel replicas by files (`[data.shards] split = "files"`,
//! ONNX Runtime's assignment: file `i` to replica `i % D`), and the read-ahead thread.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pipetrain::config::TrainConfig;
use pipetrain::data::shards::{pack, ShardDataset};
use pipetrain::data::{open_step_batches, write_npz};
use pipetrain::tensor::{Tensor, TensorData};

/// `rows` samples: `x` = three floats, `y` = the class `i % 4`, and `id` = the sample's
/// index, so a batch tells which samples (and so which files) it came from.
fn write_data(dir: &Path, rows: usize) -> PathBuf {
    let x = Tensor::new(
        vec![rows, 3],
        TensorData::F32((0..rows * 3).map(|i| (i as f32 * 0.37).sin()).collect()),
    )
    .unwrap();
    let y = Tensor::i64(vec![rows], (0..rows as i64).map(|i| i % 4).collect()).unwrap();
    let id = Tensor::i64(vec![rows], (0..rows as i64).collect()).unwrap();
    let npz = dir.join("data.npz");
    write_npz(&npz, &[("features", &x), ("y", &y), ("id", &id)]).unwrap();
    npz
}

/// `rows` samples packed `per_file` to a shard into `dir/train`.
fn shards(dir: &Path, rows: usize, per_file: usize) -> PathBuf {
    let npz = write_data(dir, rows);
    let out = dir.join("train");
    pack(&npz, &out, per_file, "part").unwrap();
    out
}

fn ids(set: &ShardDataset, step: usize, part: usize, parts: usize) -> Vec<i64> {
    set.part(step, part, parts).unwrap()["id"]
        .as_i64()
        .unwrap()
        .to_vec()
}

fn all_ids() -> BTreeMap<String, String> {
    BTreeMap::new()
}

/// Waits (up to 20 s) until `cond` holds.
fn eventually(cond: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// Each replica's micro-batches hold only samples of its own files; over one of its
/// epochs it reads each of them once; shuffling keeps a file's samples together (ORT's
/// within-file shuffle) and changes per epoch; the global batch is the replicas' parts.
#[test]
fn each_replica_reads_its_own_files_once_per_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    // 5 files of 2 samples: replica 0 owns files 0, 2, 4 (samples 0-1, 4-5, 8-9),
    // replica 1 owns files 1, 3 (samples 2-3, 6-7).
    let dir = shards(tmp.path(), 10, 2);
    let file_of = |id: i64| id as usize / 2;
    for seed in [None, Some(11)] {
        let set = ShardDataset::open(&dir, &all_ids(), 4, seed)
            .unwrap()
            .split_files(2)
            .unwrap();
        assert_eq!(set.files_of(0), Some(&[0, 2, 4][..]));
        assert_eq!(set.files_of(1), Some(&[1, 3][..]));
        // 2 micro-batches of 1 per replica: parts 0, 1 are replica 0's, 2, 3 replica 1's.
        let mut streams = [Vec::new(), Vec::new()];
        for step in 0..12 {
            let mut whole = Vec::new();
            for part in 0..4 {
                let got = ids(&set, step, part, 4);
                for &id in &got {
                    assert_eq!(
                        file_of(id) % 2,
                        part / 2,
                        "seed {seed:?} step {step}: sample {id} in part {part}"
                    );
                }
                streams[part / 2].extend(&got);
                whole.extend(got);
            }
            let batch = set.batch(step).unwrap();
            assert_eq!(batch["id"].as_i64().unwrap(), whole.as_slice());
        }
        // Replica 0 reads 6 samples an epoch, replica 1 four: each one once per epoch.
        for (r, epoch_len) in [(0, 6), (1, 4)] {
            for (e, epoch) in streams[r].chunks(epoch_len).enumerate() {
                let mut sorted = epoch.to_vec();
                sorted.sort();
                let want: Vec<i64> = (0..10).filter(|&id| file_of(id) % 2 == r).collect();
                assert_eq!(sorted, want, "seed {seed:?} replica {r} epoch {e}");
                // A file's two samples come one after the other.
                for pair in epoch.chunks(2) {
                    assert_eq!(file_of(pair[0]), file_of(pair[1]), "{epoch:?}");
                }
            }
        }
        let epochs: Vec<&[i64]> = streams[0].chunks(6).collect();
        let in_order = |r, e| set.replica_order(r, e).unwrap().to_vec();
        assert_eq!(in_order(1, 1).len(), 4);
        assert!(set.replica_order(2, 0).is_err(), "a third replica of two");
        match seed {
            None => {
                assert!(epochs.iter().all(|e| *e == [0, 1, 4, 5, 8, 9]));
                assert_eq!(in_order(1, 0), [2, 3, 6, 7]);
            }
            Some(_) => {
                assert!(epochs.iter().any(|e| *e != epochs[0]), "{epochs:?}");
                // The same seed gives the same streams (a resumed run reads on where it
                // stopped).
                let again = ShardDataset::open(&dir, &all_ids(), 4, seed)
                    .unwrap()
                    .split_files(2)
                    .unwrap();
                assert_eq!(ids(&again, 7, 3, 4), ids(&set, 7, 3, 4));
            }
        }
    }
}

/// A replica asked for its micro-batches reads only its own files (a node hosting it
/// reads nothing else), and the read-ahead decodes the file of its next step before that
/// step asks.
#[test]
fn a_replica_touches_only_its_files_and_the_next_one_is_read_ahead() {
    let tmp = tempfile::tempdir().unwrap();
    // 8 files of 2 samples; a replica's part of a batch is 2 samples: one file a step.
    let dir = shards(tmp.path(), 16, 2);
    let set = ShardDataset::open(&dir, &all_ids(), 4, None)
        .unwrap()
        .split_files(2)
        .unwrap();
    // Replica 1 (files 1, 3, 5, 7), step 0: file 1; the read-ahead takes files 3 and 5.
    assert_eq!(ids(&set, 0, 1, 2), [2, 3]);
    assert!(
        eventually(|| set.is_cached(3) && set.is_cached(5)),
        "the files of the next two steps were not read ahead"
    );
    assert!(!set.is_cached(7), "read further ahead than two steps");
    assert_eq!(ids(&set, 1, 1, 2), [6, 7]);
    assert_eq!(ids(&set, 2, 1, 2), [10, 11]);
    assert!(eventually(|| set.is_cached(7)));
    for other in [0, 2, 4, 6] {
        assert!(
            !set.is_cached(other),
            "replica 1 read replica 0's file {other}"
        );
    }
    // By samples, the same data set reads rows of one order over all files.
    let by_samples = ShardDataset::open(&dir, &all_ids(), 4, None).unwrap();
    assert_eq!(ids(&by_samples, 1, 1, 2), [6, 7]);
    assert_eq!(ids(&by_samples, 1, 0, 2), [4, 5]);
}

/// A read-ahead never evicts what a step takes: with a cache of one file, batches are
/// still those of a cache holding every file.
#[test]
fn a_small_cache_gives_the_same_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = shards(tmp.path(), 20, 3);
    let open = || {
        ShardDataset::open(&dir, &all_ids(), 6, Some(3))
            .unwrap()
            .split_files(3)
            .unwrap()
    };
    let (small, big) = (open().with_cache_files(1), open());
    for step in [0, 1, 5, 2, 9, 9, 3] {
        for part in 0..3 {
            assert_eq!(ids(&small, step, part, 3), ids(&big, step, part, 3));
        }
    }
}

/// The built-in MLP's configuration over the shards in `train`, at dp = 2.
fn mlp_config(
    dir: &Path,
    name: &str,
    steps: usize,
    dp: usize,
    extra: &str,
) -> (TrainConfig, PathBuf) {
    let text = format!(
        r#"
batch_size = 2
gradient_accumulation_steps = 2
data_parallel_size = {dp}
num_train_steps = {steps}
{extra}
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
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 0.01
[runtime]
intra_op_threads = 1
[data.shards]
train_data_dir = "train"
input_name_map = {{ features = "x", y = "y" }}
shuffle_seed = 5
split = "files"
"#
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    (TrainConfig::load(&path).unwrap(), path)
}

fn weight_bits(p: &[(String, Tensor)]) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = p
        .iter()
        .map(|(n, t)| {
            let bits = t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect();
            (n.clone(), bits)
        })
        .collect();
    v.sort();
    v
}

/// Training at dp = 2 with `split = "files"` trains on exactly the batches the data set
/// defines (the same weights as those batches written to an `.npz` in step order); it
/// resumes bitwise from a checkpoint, and refuses a checkpoint taken at another dp.
#[test]
fn training_split_by_files_resumes_bitwise_and_keeps_its_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // 40 samples in 10 files: each replica owns 5 files, 20 samples, 5 steps an epoch.
    shards(dir, 40, 4);
    let rt = common::runtime();
    // `num_train_steps` counts micro-batches (ORT's meaning): 12 optimizer steps.
    let steps = 24;
    let (cfg, path) = mlp_config(dir, "straight.toml", steps, 2, "");
    let straight = pipetrain::train::train(&rt, &cfg, &path, false, |_| {}).unwrap();

    // The reference: the data set's global batches, in step order, as an .npz read
    // without shuffling at the same layout.
    let (set, _, _) = open_step_batches(&cfg.data, cfg.global_batch(), 2, &path).unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for step in 0..cfg.optimizer_steps() {
        let b = set.batch(step).unwrap();
        x.extend_from_slice(b["x"].as_f32().unwrap());
        y.extend_from_slice(b["y"].as_i64().unwrap());
    }
    let rows = y.len();
    let x = Tensor::new(vec![rows, 3], TensorData::F32(x)).unwrap();
    let y = Tensor::i64(vec![rows], y).unwrap();
    write_npz(&dir.join("flat.npz"), &[("x", &x), ("y", &y)]).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let flat = text.replace(
        &text[text.find("[data.shards]").unwrap()..],
        "[data]\npath = \"flat.npz\"\nlayout = { kind = \"arrays\", feeds = { x = \"x\", y = \"y\" } }\n",
    );
    std::fs::write(dir.join("flat.toml"), flat).unwrap();
    let flat_cfg = TrainConfig::load(&dir.join("flat.toml")).unwrap();
    let reference =
        pipetrain::train::train(&rt, &flat_cfg, &dir.join("flat.toml"), false, |_| {}).unwrap();
    assert_eq!(
        weight_bits(&straight.parameters),
        weight_bits(&reference.parameters),
        "training did not read the batches split by files"
    );

    // Split by samples, the same folder and seed give other batches, and other weights.
    let by_samples = text.replace("split = \"files\"", "split = \"samples\"");
    std::fs::write(dir.join("samples.toml"), by_samples).unwrap();
    let samples_cfg = TrainConfig::load(&dir.join("samples.toml")).unwrap();
    let other =
        pipetrain::train::train(&rt, &samples_cfg, &dir.join("samples.toml"), false, |_| {})
            .unwrap();
    assert_ne!(
        weight_bits(&other.parameters),
        weight_bits(&straight.parameters)
    );

    // Half, a checkpoint, then the rest from it.
    let ckpts = dir.join("ckpts");
    let saving = format!(
        "checkpoints_dir = \"{}\"\ncheckpoint_period = 6",
        ckpts.display()
    );
    let (half, half_path) = mlp_config(dir, "half.toml", steps / 2, 2, &saving);
    pipetrain::train::train(&rt, &half, &half_path, false, |_| {}).unwrap();
    let ckpt = ckpts.join("step-00000006");
    let loading = format!("checkpoint_to_load_path = \"{}\"", ckpt.display());
    let (rest, rest_path) = mlp_config(dir, "rest.toml", steps, 2, &loading);
    let resumed = pipetrain::train::train(&rt, &rest, &rest_path, false, |_| {}).unwrap();
    assert_eq!(
        weight_bits(&resumed.parameters),
        weight_bits(&straight.parameters),
        "6 + resume + 6 differs from 12 straight"
    );

    // At dp = 1 the replicas would read other samples: refused, naming the setting.
    let (other, other_path) = mlp_config(dir, "dp1.toml", steps, 1, &loading);
    let Err(err) = pipetrain::train::train(&rt, &other, &other_path, false, |_| {}) else {
        panic!("a checkpoint split by files at dp = 2 resumed at dp = 1");
    };
    let err = err.to_string();
    assert!(err.contains("`data.shards.split`"), "{err}");
    assert!(err.contains("\"data_parallel_size\":2"), "{err}");
}

/// A split the files cannot give is a configuration error naming `data.shards.split`.
#[test]
fn splits_the_files_cannot_give_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // 10 samples in files of 4, 4, 2.
    shards(tmp.path(), 10, 4);
    let (cfg, path) = mlp_config(tmp.path(), "c.toml", 2, 2, "");
    let refused = |global: usize, dp: usize| match open_step_batches(&cfg.data, global, dp, &path) {
        Ok(_) => panic!("global batch {global} at dp {dp} was accepted"),
        Err(e) => e.to_string(),
    };
    // Four replicas for three files.
    let err = refused(4, 4);
    assert!(err.contains("field `data.shards.split`"), "{err}");
    assert!(
        err.contains("3 shard file(s) for 4 data-parallel replicas"),
        "{err}"
    );
    // Replica 1 owns only file 1 (4 samples) but takes 5 of each batch of 10.
    let err = refused(10, 2);
    assert!(
        err.contains("replica 1's files (1) hold 4 samples, fewer than its 5"),
        "{err}"
    );
    // What does fit is accepted.
    assert!(open_step_batches(&cfg.data, 8, 2, &path).is_ok());
}
