//! `pipetrain plan`: the sizes it profiles. A model no worker holds whole is profiled in
//! pipeline stages; a model exported with a fixed batch only at that micro-batch.

use pipetrain::config::TrainConfig;

use super::plan::{config_in, plan, plan_refused, tempfile_dir, trains, CONFIG};

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

/// The table's rows: each one's process column and unit (bytes per unit), from a plan's
/// stdout.
fn process_column(stdout: &str) -> Vec<f64> {
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with("rank"));
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("no table:\n{stdout}"));
    assert!(
        header.contains("bubble  process  peak per rank"),
        "{header}"
    );
    lines
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|r| r.parse::<u32>().is_ok())
        })
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // rank dp tp pp schedule M x B recompute zero step bubble process ranks...
            cols[12].parse().unwrap()
        })
        .collect()
}

/// Under a process cap, a layout whose process (its ranks, and ONNX Runtime, the
/// libraries and the training graph beside them, measured) is predicted over it is
/// dropped; under one below what a process holds beside its ranks nothing fits, the
/// plan says which cap is short and by how much, and writes nothing. The cap defaults
/// to the one `train` refuses a run over (`[runtime] memory_limit_gb`).
#[test]
fn a_layout_whose_process_is_over_the_process_cap_is_dropped() {
    let (dir, config) = config_in("plan-process-cap");
    let cache = dir.join("cache.json");
    let cache = cache.to_str().unwrap();
    let best = dir.join("best.toml");
    let free = plan(&config, &["--profile-cache", cache], (&best, None));
    assert!(
        free.contains("memory: beside its ranks a process holds"),
        "{free}"
    );
    assert!(
        free.contains("MB)\n"),
        "the tiny GPT's table in MB:\n{free}"
    );
    let processes = process_column(&free);
    let (least, most) = processes
        .iter()
        .fold((f64::MAX, 0f64), |(l, m), &p| (l.min(p), m.max(p)));
    assert!(
        most - least > 1.0,
        "the processes differ too little to show anything:\n{free}"
    );
    // A cap halfway: the rows over it go, those under it stay.
    let cap_mb = (least + most) / 2.0;
    let cap_gib = (cap_mb * 1e6 / (1u64 << 30) as f64).to_string();
    let capped_best = dir.join("capped.toml");
    let capped = plan(
        &config,
        &["--profile-cache", cache, "--memory-per-process", &cap_gib],
        (&capped_best, None),
    );
    let kept = process_column(&capped);
    assert!(kept.iter().all(|&p| p <= cap_mb), "{capped}");
    assert!(
        !kept.is_empty() && kept.len() < processes.len(),
        "{free}\n{capped}"
    );
    assert!(capped.contains("(--memory-per-process)"), "{capped}");
    trains(&capped_best);
    // Below what a process holds beside its ranks: nothing fits, and nothing is written.
    let (dir, config) = config_in("plan-process-cap-config");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}[runtime]\nmemory_limit_gb = 0.01\n"),
    )
    .unwrap();
    let none = dir.join("none.toml");
    let stderr = plan_refused(&config, &[], &none);
    assert!(
        stderr.contains("nothing fits: every process holds at least")
            && stderr.contains("over the process cap of 0.01 GB ([runtime] memory_limit_gb)"),
        "{stderr}"
    );
    assert!(!none.exists());
}
