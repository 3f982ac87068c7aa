//! Activation recompute (`recompute = "stage"`): a stage keeps only what it received
//! and its backward runs the stage's forward again. With deterministic settings (one
//! thread, no graph optimizations) that changes nothing but memory: the built-in GPT-2
//! trains to bitwise the same losses and weights as without recompute, at pp = 1, 2 and
//! 4, under 1F1B and under ZB-H1's split backward (where the input-gradient part
//! recomputes once and hands the weight-gradient part what it reads), at pp = 2 under
//! GPipe, interleaved 1F1B, ZB-V, DualPipeV, V-Half and V-Min, and at pp = 4 under V-Half. The peak stash each stage measures equals
//! what the schedule predicts from the stage graphs' value sizes, and recompute shrinks
//! the stages' total.

use crate::common;

use std::path::Path;

use crate::common::PeerModel;

use pipetrain::compute::Runtime;
use pipetrain::config::TrainConfig;
use pipetrain::graph::{assign_stages, build_stage_graphs_with, BalanceBy, Partition, Recompute};
use pipetrain::train::StashPeak;

fn config(pp: usize, schedule: &str, recompute: &str) -> TrainConfig {
    let text = format!(
        r#"
batch_size = 4
gradient_accumulation_steps = 4
num_train_steps = 16
pipeline_parallel_size = {pp}
recompute = "{recompute}"
[model]
kind = "gpt2"
layers = 4
d_model = 32
heads = 4
vocab = 32
seq = 16
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = {{ kind = "language", samples = 256, seq = 16, vocab = 32, seed = 3 }}
layout = {{ kind = "next_token", array = "tokens", input = "tokens", label = "targets" }}
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-3
[pipeline]
schedule = "{schedule}"
{virtual}
[runtime]
intra_op_threads = 1
disable_optimizations = true
"#,
        virtual = match schedule {
            "interleaved_1f1b" => "virtual_stages = 2",
            _ => "",
        }
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/recompute.toml");
    TrainConfig::parse(&text, &path).unwrap()
}

/// Every step's loss (as bits), the final weights (as bits) by name, and each stage's
/// peak stash.
type Run = (Vec<u64>, Vec<(String, Vec<u32>)>, Vec<StashPeak>);

fn run(rt: &Runtime, pp: usize, schedule: &str, recompute: &str) -> Run {
    let cfg = config(pp, schedule, recompute);
    let mut losses = Vec::new();
    let s = pipetrain::train::train(rt, &cfg, Path::new("recompute.toml"), false, |r| {
        losses.push(r.loss.to_bits())
    })
    .unwrap();
    assert_eq!(s.steps, 4);
    let mut weights: Vec<(String, Vec<u32>)> = s
        .parameters
        .into_iter()
        .map(|(n, t)| (n, t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect()))
        .collect();
    weights.sort();
    (losses, weights, s.stash)
}

#[test]
fn recompute_trains_bitwise_as_keeping_every_activation() {
    let rt = Runtime::from_env().unwrap();
    let cases = [1, 2, 4]
        .into_iter()
        .flat_map(|pp| [(pp, "1f1b"), (pp, "zb_h1")])
        .chain([
            (2, "gpipe"),
            (2, "interleaved_1f1b"),
            (2, "zb_v"),
            (2, "dualpipe_v"),
            (2, "v_half"),
            (4, "v_half"),
            (2, "v_min"),
        ]);
    for (pp, schedule) in cases {
        let kept = run(&rt, pp, schedule, "none");
        let recomputed = run(&rt, pp, schedule, "stage");
        assert_eq!(kept.0, recomputed.0, "pp={pp} {schedule}: losses differ");
        assert_eq!(kept.1, recomputed.1, "pp={pp} {schedule}: weights differ");
        // The stash the stages measured is the schedule's prediction from the graphs'
        // value sizes, and recompute shrinks it on the stages that keep anything.
        for p in kept.2.iter().chain(&recomputed.2) {
            assert_eq!(p.measured, p.predicted, "pp={pp} {schedule}: {p:?}");
        }
        // (A stage whose micro-batches go F, I, W back to back, as a lone ZB-H1 stage,
        // holds the same at its peak either way: recompute saves between F and I.)
        for (k, r) in kept.2.iter().zip(&recomputed.2) {
            assert!(
                r.measured <= k.measured,
                "pp={pp} {schedule}: {k:?} vs {r:?}"
            );
        }
        // Some stage holds less. (Not always the first: where weight gradients wait long,
        // as V-Half's first stage's, the peak falls between I and W, where the stage
        // keeps what W reads either way.)
        if pp > 1 {
            let total = |run: &[StashPeak]| run.iter().map(|p| p.measured).sum::<u64>();
            assert!(
                total(&recomputed.2) < total(&kept.2),
                "pp={pp} {schedule}: {:?} vs {:?}",
                kept.2,
                recomputed.2
            );
        }
    }
}

/// What recompute changes in the stage graphs (the peers' tiny GPT cut in two): the
/// forward outputs only what it sends (and the loss), the stash holds only what arrived,
/// and the backward graphs run the forward's nodes again; the last stage's fused graph
/// is the same either way.
#[test]
fn recomputing_stages_keep_only_what_they_received() {
    let rt = common::runtime();
    let tg = PeerModel::load("tiny_gpt").training_graph(&rt);
    let a = assign_stages(
        &tg,
        &Partition::Balanced {
            stages: 2,
            by: BalanceBy::Flops,
        },
    )
    .unwrap();
    let kept = build_stage_graphs_with(&tg, &a, Recompute::None).unwrap();
    let redo = build_stage_graphs_with(&tg, &a, Recompute::Stage).unwrap();
    for (k, r) in kept.iter().zip(&redo) {
        let s = k.stage;
        let outputs = |g: &pipetrain::graph::Graph| -> Vec<String> {
            g.outputs.iter().map(|v| v.name.clone()).collect()
        };
        let mut sends = r.io.fwd_send.clone();
        if r.io.has_loss {
            sends.push(pipetrain::graph::LOSS.into());
        }
        assert!(
            outputs(&r.forward).iter().all(|v| sends.contains(v)),
            "stage {s}"
        );
        assert!(
            r.io.stash.iter().all(|v| r.io.fwd_recv.contains(v)),
            "stage {s}"
        );
        assert!(
            k.io.stash.len() > r.io.stash.len(),
            "stage {s}: {:?}",
            k.io.stash
        );
        assert!(r.backward.nodes.len() > k.backward.nodes.len(), "stage {s}");
        assert!(
            r.backward_input.nodes.len() > k.backward_input.nodes.len(),
            "stage {s}"
        );
        assert_eq!(outputs(&r.backward), outputs(&k.backward), "stage {s}");
        assert_eq!(
            r.fused.as_ref().map(|g| g.nodes.len()),
            k.fused.as_ref().map(|g| g.nodes.len())
        );
    }
}

/// `pipetrain schedule memory` predicts, without training, the per-rank peak stash that
/// training then measures (one stage per rank at pp = 2), with and without recompute.
#[test]
fn the_memory_table_predicts_what_training_measures() {
    let rt = Runtime::from_env().unwrap();
    let cfg = config(2, "1f1b", "none");
    let rows = pipetrain::train::memory_table(&rt, &cfg, Path::new("recompute.toml")).unwrap();
    for (schedule, recompute) in [
        ("1f1b", "none"),
        ("1f1b", "stage"),
        ("zb_h1", "none"),
        ("zb_h1", "stage"),
    ] {
        let row = rows
            .iter()
            .find(|r| {
                r.schedule == schedule
                    && (r.recompute == Recompute::Stage) == (recompute == "stage")
            })
            .unwrap();
        let measured: Vec<u64> = run(&rt, 2, schedule, recompute)
            .2
            .iter()
            .map(|p| p.measured)
            .collect();
        assert_eq!(
            row.per_rank.as_ref().unwrap(),
            &measured,
            "{schedule} {recompute}"
        );
    }
    // ZB-V spreads what ZB-H1 piles on one rank: its larger rank holds less.
    let peak = |name: &str| -> u64 {
        let r = rows
            .iter()
            .find(|r| r.schedule == name && r.recompute == Recompute::None)
            .unwrap();
        *r.per_rank.as_ref().unwrap().iter().max().unwrap()
    };
    assert!(peak("zb_v") < peak("zb_h1"));
}
