//! `pipetrain plan`: the sizes it profiles. A model no worker holds whole is profiled in
//! pipeline stages; a model exported with a fixed batch only at that micro-batch.

use pipetrain::config::TrainConfig;

use super::plan::{config_in, plan, tempfile_dir, trains, CONFIG};

/// Under a cap one worker cannot train the model within (its profile run, one stage,
/// ZB-H1, is predicted over it), the profile runs it in two pipeline stages, reads both
/// stages' ONNX Runtime profiles, and plans layouts that fit; the best is written and
/// trains.
#[test]
fn a_model_no_worker_holds_whole_under_the_cap_is_profiled_in_stages() {
    let (dir, config) = config_in("plan-stages");
    let best = dir.join("best.toml");
    let cap_gib = 0.001.to_string();
    let stdout = plan(&config, &["--memory-per-device", &cap_gib], (&best, None));
    let staged = stdout
        .lines()
        .filter(|l| l.starts_with("profile:") && l.contains("as 2 pipeline stages"));
    assert!(staged.count() >= 1, "{stdout}");
    let cfg = TrainConfig::load(&best).unwrap();
    assert_eq!(cfg.global_batch(), 8, "the global batch is kept");
    trains(&best);
}

#[test]
fn a_model_exported_with_a_fixed_batch_is_planned_at_that_micro_batch_alone() {
    let dir = tempfile_dir("plan-fixed-batch");
    let config = dir.join("gpt.toml");
    // The built-in GPT with its batch axis a number, as an export without dynamic_axes.
    let fixed = CONFIG.replace("seq = 16\n[loss]", "seq = 16\nbatch = 8\n[loss]");
    assert_ne!(fixed, CONFIG);
    std::fs::write(&config, fixed).unwrap();
    let best = dir.join("best.toml");
    let stdout = plan(&config, &[], (&best, None));
    assert!(
        stdout
            .contains("micro-batches of 8 only: the model's input `tokens` has a fixed batch of 8"),
        "{stdout}"
    );
    // No run at another size was tried and failed.
    assert!(!stdout.contains("left out: micro-batches"), "{stdout}");
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("rank"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|r| r.parse::<u32>().is_ok())
        })
        .collect();
    assert!(rows.len() > 1, "{stdout}");
    assert!(rows.iter().all(|r| r.contains(" x 8 ")), "{stdout}");
    assert_eq!(TrainConfig::load(&best).unwrap().batch_size, 8);
}
