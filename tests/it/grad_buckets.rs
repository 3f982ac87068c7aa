//! Gradient buckets (`gradient_bucket_mb`): with data parallelism, a stage's step's last
//! backward runs as a chain of pieces and each piece's gradients are all-reduced while
//! the next pieces run. On the peers' models, splitting the backward and reducing in
//! pieces moves no float: the mlp at dp = 2 trains the same bits with buckets as without
//! under 1F1B (pp = 1 and 2), ZB-H1 and ZB-V, and the tiny GPT's buckets are exactly its
//! step's gradients.

use crate::common;

use std::sync::Arc;

use crate::common::mlp::{Mlp, ADAMW_COSINE};
use pipetrain::compute::Runtime;

fn trained(rt: &Runtime, m: &Mlp) -> (Vec<(String, Vec<u32>)>, f64) {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, path) = m.config(dir.path());
    let s = pipetrain::train::train(rt, &cfg, &path, false, |_| {}).unwrap();
    assert_eq!(s.steps, m.steps);
    let mut p: Vec<(String, Vec<u32>)> = s
        .parameters
        .iter()
        .map(|(n, t)| {
            let bits = t
                .to_f64_vec()
                .iter()
                .map(|&x| (x as f32).to_bits())
                .collect();
            (n.clone(), bits)
        })
        .collect();
    p.sort();
    (p, s.final_loss)
}

#[test]
fn buckets_train_the_same_bits_under_each_schedule() {
    let rt = Runtime::from_env().unwrap();
    for (pp, schedule) in [(1, "1f1b"), (2, "1f1b"), (2, "zb_h1"), (2, "zb_v")] {
        let run = |bucket_mb: &str| {
            let m = Mlp {
                dp: 2,
                pp,
                accum: 4,
                steps: 6,
                schedule,
                optimizer: ADAMW_COSINE,
                extra: format!("gradient_bucket_mb = {bucket_mb}"),
                ..Mlp::default()
            };
            trained(&rt, &m)
        };
        let (whole, whole_loss) = run("0");
        // 16 KiB: the mlp's stages split into several buckets each.
        let (bucketed, bucketed_loss) = run("0.015625");
        assert_eq!(bucketed_loss, whole_loss, "pp = {pp} {schedule}");
        for ((n, a), (_, b)) in whole.iter().zip(&bucketed) {
            assert!(a == b, "pp = {pp} {schedule}: `{n}` differs with buckets");
        }
    }
}

/// The peers' tiny GPT as one stage (its forward and backward in one graph), built with
/// `bucket_bytes` (0: no buckets) for steps of two micro-batches.
fn tiny_gpt_stage(
    rt: &Runtime,
    model: &common::PeerModel,
    bucket_bytes: usize,
) -> pipetrain::pipeline::OrtStage {
    tiny_gpt_stage_of(rt, model, bucket_bytes, None)
}

/// [`tiny_gpt_stage`] as data-parallel replica `zero` of a sharded stage.
fn tiny_gpt_stage_of(
    rt: &Runtime,
    model: &common::PeerModel,
    bucket_bytes: usize,
    zero: Option<pipetrain::pipeline::ZeroSlot>,
) -> pipetrain::pipeline::OrtStage {
    use pipetrain::graph::{assign_stages, build_stage_graphs, BalanceBy, Partition};
    let tg = model.training_graph(rt);
    let one = Partition::Balanced {
        stages: 1,
        by: BalanceBy::Flops,
    };
    let graphs = build_stage_graphs(&tg, &assign_stages(&tg, &one).unwrap()).unwrap();
    let session = pipetrain::compute::SessionOptions {
        intra_threads: 1,
        inter_threads: 1,
        optimize: true,
        spin: false,
        profile: false,
        device: pipetrain::compute::Device::Cpu,
        deterministic: true,
        mixed_precision: None,
        state_on_device: true,
        device_path_on_host: false,
        cuda_kernels: true,
        cuda_graph: false,
    };
    let settings = pipetrain::pipeline::StageSettings {
        bucket_bytes,
        micro_batches: 2,
        zero,
        ..pipetrain::pipeline::StageSettings::new(Default::default(), 0.5)
    };
    pipetrain::pipeline::OrtStage::new(rt, &tg, &graphs[0], &session, &settings).unwrap()
}

#[test]
fn a_stage_hands_out_its_steps_gradients_bucket_by_bucket_on_the_last_micro_batch() {
    use pipetrain_actors::{BackwardPart, GradBucket, StageCompute};
    let rt = Runtime::from_env().unwrap();
    let model = common::PeerModel::load("tiny_gpt");
    let data: Vec<pipetrain::pipeline::Payload> = (0..2)
        .map(|step| {
            model
                .batch(step)
                .into_iter()
                .map(|(k, v)| (k, Arc::new(v.into())))
                .collect()
        })
        .collect();
    let tokio = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Two micro-batches through a stage; what its bucket channel carried after each.
    let run = |stage: &mut pipetrain::pipeline::OrtStage| {
        let (tx, rx) = flume::unbounded();
        let takes = stage.reduce_buckets_into(Some(tx));
        let mut arrived = Vec::new();
        for (mb, d) in data.iter().enumerate() {
            tokio.block_on(async {
                stage.forward(mb, None, Some(d.clone())).await.unwrap();
                stage.backward(mb, BackwardPart::Full, None).await.unwrap();
            });
            arrived.push(
                rx.drain()
                    .map(|b: GradBucket| b.values)
                    .collect::<Vec<Vec<f32>>>(),
            );
        }
        stage.reduce_buckets_into(None);
        (takes, arrived)
    };
    let mut whole = tiny_gpt_stage(&rt, &model, 0);
    let (takes, arrived) = run(&mut whole);
    assert!(
        !takes && arrived.iter().all(Vec::is_empty),
        "no buckets asked for"
    );
    let want = whole.take_grads();

    let mut bucketed = tiny_gpt_stage(&rt, &model, 64 << 10);
    let (takes, arrived) = run(&mut bucketed);
    assert!(takes);
    assert!(
        arrived[0].is_empty(),
        "a bucket went out before its gradients were final"
    );
    let buckets = &arrived[1];
    assert!(buckets.len() >= 3, "{} buckets of 64 KiB", buckets.len());
    // Together the buckets are the step's gradients, bit for bit (in the order the
    // backward completes them, not the layout's).
    let mut sent: Vec<u32> = buckets.iter().flatten().map(|x| x.to_bits()).collect();
    let mut expected: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
    assert_eq!(sent.len(), expected.len());
    sent.sort_unstable();
    expected.sort_unstable();
    assert!(sent == expected, "the buckets are not the step's gradients");
    // Sums handed back land where each bucket's values came from: giving back the
    // buckets doubled doubles every gradient.
    let doubled: Vec<Vec<f32>> = buckets
        .iter()
        .map(|b| b.iter().map(|x| x * 2.0).collect())
        .collect();
    bucketed.put_buckets(doubled).unwrap();
    let got = bucketed.take_grads();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), (w * 2.0).to_bits(), "gradient value {i}");
    }
    // Sums for buckets that were never sent are refused.
    assert!(bucketed.put_buckets(vec![vec![0.0]]).is_err());
}

/// ZeRO stage 2: every micro-batch's gradients go out in buckets, each cut into the
/// replicas' parts (one run each, in replica order); the replica adds the sum of its own
/// part that comes back, and never writes the rest of its gradient buffer (so the rest
/// never takes memory). Sums that double each bucket (two replicas with the same data)
/// leave exactly twice the unsharded step's gradients in its part, and zeros elsewhere.
#[test]
fn a_sharded_stage_keeps_and_writes_only_its_part_of_the_gradients() {
    use pipetrain::pipeline::ZeroSlot;
    use pipetrain_actors::{BackwardPart, GradBucket, StageCompute};
    let rt = Runtime::from_env().unwrap();
    let model = common::PeerModel::load("tiny_gpt");
    let tokio = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let step = |stage: &mut pipetrain::pipeline::OrtStage| {
        for mb in 0..2 {
            let d: pipetrain::pipeline::Payload = (model.batch(mb).into_iter())
                .map(|(k, v)| (k, Arc::new(v.into())))
                .collect();
            tokio.block_on(async {
                stage.forward(mb, None, Some(d)).await.unwrap();
                stage.backward(mb, BackwardPart::Full, None).await.unwrap();
            });
        }
    };
    let mut whole = tiny_gpt_stage(&rt, &model, 0);
    step(&mut whole);
    let want = whole.take_grads();

    let slot = ZeroSlot {
        rank: 1,
        ranks: 2,
        gradients: true,
    };
    let mut sharded = tiny_gpt_stage_of(&rt, &model, 64 << 10, Some(slot));
    let (tx, rx) = flume::unbounded::<GradBucket>();
    assert!(sharded.reduce_buckets_into(Some(tx)));
    // The other replica and the reduce-scatter: each bucket's part 1 summed with an
    // equal one, sent straight back.
    let echo = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for b in rx.iter() {
            let parts = b.parts.clone().expect("a bucket to reduce-scatter");
            assert_eq!(parts.len(), 2);
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[0].end, parts[1].start);
            assert_eq!(parts[1].end, b.values.len(), "the parts cover the bucket");
            let mut sum = b.values;
            sum[parts[1].clone()].iter_mut().for_each(|x| *x *= 2.0);
            b.back.expect("a sum to send back").send(sum).unwrap();
            seen.push(parts[1].len());
        }
        seen
    });
    step(&mut sharded);
    sharded.reduce_buckets_into(None);
    let owned_per_bucket = echo.join().unwrap();
    sharded.put_buckets(Vec::new()).unwrap();
    assert!(
        owned_per_bucket.len() >= 6,
        "{} buckets over two micro-batches",
        owned_per_bucket.len()
    );
    let got = sharded.take_grads();
    let layout = sharded.state().0;
    let own = layout.values_of(layout.partition(2)[1].clone());
    assert!(own.start > 0 && own.end == got.len(), "{own:?}");
    assert_eq!(owned_per_bucket.iter().sum::<usize>(), 2 * own.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let expected = if own.contains(&i) { w * 2.0 } else { 0.0 };
        assert_eq!(g.to_bits(), expected.to_bits(), "gradient value {i}");
    }
}
