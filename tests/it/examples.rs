//! The examples work from a clone of the repository alone: every built-in-model example
//! and every example on the peers' files (in `peers/`) trains (shortened here), and the
//! embedding example starts a run, takes a checkpoint on request and stops it.

use crate::common;

use std::path::Path;

#[allow(dead_code, clippy::duplicated_attributes)]
#[path = "../../examples/embed.rs"]
mod embed;

/// The examples that need nothing but this repository, and how long they run here.
const SELF_CONTAINED: [&str; 4] = ["gpt2_tiny", "gpt2_pipeline", "mlp", "squeezenet"];

#[test]
fn built_in_examples_train_from_the_repository_alone() {
    let rt = common::runtime();
    for name in SELF_CONTAINED {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.toml"));
        let mut cfg = pipetrain::config::TrainConfig::load(&path).unwrap();
        // Four optimizer steps, with an evaluation; nothing written into the repository.
        cfg.num_train_steps = 4 * cfg.gradient_accumulation_steps;
        cfg.evaluation_period = Some(2);
        cfg.output_path = None;
        cfg.checkpoints_dir = None;
        cfg.checkpoint_period = None;
        let mut evals = 0;
        let s = pipetrain::train::train(&rt, &cfg, &path, false, |r| {
            evals += r.eval_accuracy.is_some() as usize;
            assert!(
                r.loss.is_finite(),
                "{name}: step {} loss {}",
                r.step,
                r.loss
            );
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.steps, 4, "{name}");
        assert_eq!(
            evals, 2,
            "{name}: evaluation with accuracy after steps 2 and 4"
        );
    }
}

/// The peers' examples, read as they are (their paths into `peers/`): the first four
/// steps of each; those that are the peers' runs give the peers' PyTorch float64 losses.
#[test]
fn the_peers_examples_train_from_the_repository_alone() {
    let rt = common::runtime();
    let runs = [
        ("mlp_sgd", Some(("mlp", "sgd"))),
        ("mlp_adamw", Some(("mlp", "adamw"))),
        ("tiny_gpt_sgd", Some(("tiny_gpt", "sgd"))),
        ("tiny_gpt_adamw", Some(("tiny_gpt", "adamw"))),
        ("mlp_pipeline", Some(("mlp", "sgd"))),
        ("tiny_gpt_zero_bubble", None),
    ];
    for (name, peer) in runs {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.toml"));
        let mut cfg = pipetrain::config::TrainConfig::load(&path).unwrap();
        cfg.num_train_steps = 4 * cfg.gradient_accumulation_steps;
        cfg.output_path = None;
        cfg.evaluation_period = None;
        let mut losses = Vec::new();
        pipetrain::train::train(&rt, &cfg, &path, false, |r| losses.push(r.loss))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(losses.len(), 4, "{name}");
        assert!(losses.iter().all(|l| l.is_finite()), "{name}: {losses:?}");
        if let Some((model, opt)) = peer {
            let want = common::reference_curve(model, opt, "torch_f64");
            for (step, (ours, theirs)) in losses.iter().zip(&want).enumerate() {
                assert!(
                    (ours - theirs).abs() < 1e-5,
                    "{name} step {step}: {ours} against PyTorch's {theirs}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedding_example_checkpoints_on_request_and_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoints = embed::run(tmp.path().to_path_buf()).await.unwrap();
    let steps: Vec<u64> = pipetrain::checkpoint::list(&checkpoints)
        .unwrap()
        .into_iter()
        .filter_map(|l| l.manifest.ok().map(|m| m.steps_done))
        .collect();
    assert_eq!(steps.len(), 2, "{steps:?}");
    // Asked for when the service reads step 30's event: training has gone on meanwhile.
    assert!((30..60).contains(&steps[0]), "the requested one: {steps:?}");
    assert!(steps[1] >= 60, "the stop's: {steps:?}");
}
