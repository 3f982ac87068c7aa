//! `pipetrain plan`: a plan's written configuration is one `train` runs as it is, with
//! the layout the plan ranked first; cuts balanced by time follow the saved times. (The
//! sizes a plan profiles: `plan_sizes`; over a manifest: `plan_cluster`; the stage
//! costs themselves: `plan_costs`.)

use std::process::Command;

use pipetrain::config::TrainConfig;
use pipetrain::graph::{NodeTimes, Partition};

/// A small built-in GPT with a vocabulary head larger than its blocks.
pub(crate) const CONFIG: &str = r#"
batch_size = 8
num_train_steps = 4
display_loss_steps = 4
[model]
kind = "gpt2"
layers = 2
d_model = 32
heads = 2
vocab = 512
seq = 16
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = { kind = "language", samples = 256, seq = 16, vocab = 512, seed = 3 }
layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 1e-2
"#;

#[test]
fn a_plan_is_written_as_a_configuration_train_runs_as_it_is() {
    let (dir, config) = config_in("plan-writes");
    let best = dir.join("out").join("best.toml");
    std::fs::create_dir_all(best.parent().unwrap()).unwrap();
    let times = dir.join("times.json");
    let cache = dir.join("profile.json");
    let cache = cache.to_str().unwrap();
    // Profiled in two rounds: the profiles the plan is built on are their medians.
    let stdout = plan(
        &config,
        &[
            "--measure",
            "1",
            "--measure-steps",
            "4",
            "--profile-rounds",
            "2",
            "--profile-cache",
            cache,
        ],
        (&best, Some(&times)),
    );
    // Planned again from the cache: nothing measured, the same plan; its second row
    // written (`--pick 2`).
    let second = dir.join("out").join("second.toml");
    let again = plan(
        &config,
        &[
            "--profile-rounds",
            "2",
            "--profile-cache",
            cache,
            "--pick",
            "2",
        ],
        (&second, None),
    );
    let table = |out: &str| -> Vec<String> {
        let rows = out.lines().skip_while(|l| !l.starts_with("rank"));
        let rows = rows.take_while(|l| !l.starts_with("measured"));
        rows.filter(|l| !l.is_empty() && !l.starts_with("wrote"))
            .map(str::to_string)
            .collect()
    };
    assert!(again.contains("the profile read from"), "{again}");
    assert_eq!(table(&stdout), table(&again));
    // Measured, the layout written is the fastest measured run's (of those that fit);
    // not measured, the table's first row.
    let cfg = TrainConfig::load(&best).unwrap();
    fastest_measured_is_written(&stdout, &cfg);
    // Each file's first line says how the plan chose it.
    let header = |path: &std::path::Path| {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().next().unwrap_or_default().to_string()
    };
    let measured = header(&best);
    assert!(
        measured.starts_with("# Written by `pipetrain plan`: the fastest of the layouts it ran ("),
        "{measured}"
    );
    let ranked = header(&second);
    assert!(
        ranked.ends_with("the layout it ranked 2 by predicted step."),
        "{ranked}"
    );
    let top = dir.join("out").join("top.toml");
    let cached = ["--profile-rounds", "2", "--profile-cache", cache];
    assert!(plan(&config, &cached, (&top, None)).contains("wrote"));
    let predicted = header(&top);
    assert!(
        predicted.ends_with("the layout it predicted fastest."),
        "{predicted}"
    );
    let top = TrainConfig::load(&top).unwrap();
    let first = stdout
        .lines()
        .skip_while(|l| !l.starts_with("rank"))
        .nth(1)
        .unwrap_or_else(|| panic!("no table:\n{stdout}"));
    let cols: Vec<&str> = first.split_whitespace().collect();
    let layout =
        |cols: &[&str]| -> Vec<usize> { cols[1..4].iter().map(|c| c.parse().unwrap()).collect() };
    let hp = top.horizontal_parallel_size;
    assert_eq!(
        layout(&cols),
        [top.data_parallel_size, hp, top.pipeline_parallel_size],
        "{first}"
    );
    assert_eq!(top.data_parallel_size * hp * top.pipeline_parallel_size, 2);
    // Its ZeRO stage too (the column after recompute), none without replicas.
    assert_eq!(
        cols[9].parse::<u8>().unwrap(),
        top.deepspeed_zero_stage,
        "{first}"
    );
    assert!(top.data_parallel_size > 1 || top.deepspeed_zero_stage == 0);
    // `--pick 2` wrote the second row: its layout, schedule, micro-batches, recompute and
    // ZeRO stage.
    let row = |cols: &[&str], c: &TrainConfig| -> bool {
        let schedule = c.pipeline.schedule.name();
        layout(cols)
            == [
                c.data_parallel_size,
                c.horizontal_parallel_size,
                c.pipeline_parallel_size,
            ]
            && schedule.starts_with(cols[4].split('(').next().unwrap())
            && cols[5..8]
                == [
                    c.gradient_accumulation_steps.to_string().as_str(),
                    "x",
                    c.batch_size.to_string().as_str(),
                ]
            && format!("{:?}", c.recompute).eq_ignore_ascii_case(cols[8])
            && cols[9] == c.deepspeed_zero_stage.to_string()
    };
    let rank = |n: usize| -> Vec<&str> {
        let line = stdout.lines().skip_while(|l| !l.starts_with("rank")).nth(n);
        line.unwrap_or_else(|| panic!("no row {n}:\n{stdout}"))
            .split_whitespace()
            .collect()
    };
    let picked = TrainConfig::load(&second).unwrap();
    assert!(row(&rank(2), &picked), "{:?}\n{stdout}", rank(2));
    assert!(row(&rank(1), &top), "{:?}\n{stdout}", rank(1));
    assert!(
        !row(&rank(1), &picked),
        "rows 1 and 2 alike: the test shows nothing\n{stdout}"
    );
    // A rank past the table's end is refused, saying how many fit; nothing is written.
    let past = dir.join("out").join("past.toml");
    let stderr = plan_refused(
        &config,
        &[
            "--max-micro-batches",
            "2",
            "--profile-steps",
            "3",
            "--profile-rounds",
            "2",
            "--profile-cache",
            cache,
            "--pick",
            "999",
        ],
        &past,
    );
    assert!(
        stderr.contains("--pick") && stderr.contains("rank 999 asked for"),
        "{stderr}"
    );
    assert!(!past.exists());
    // The GPT splits across two tensor shards: those layouts are searched, and the
    // fastest of them, written and run for real, trains.
    let table = stdout
        .lines()
        .skip_while(|l| !l.starts_with("rank"))
        .skip(1);
    let rows: Vec<Vec<&str>> = table
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(rows.iter().any(|r| layout(r) == [1, 2, 1]), "{stdout}");
    // (Under its own label, or a rank's where it is among the best.)
    let measured = stdout.lines().skip_while(|l| !l.starts_with("measured"));
    let split_runs = measured.filter(|l| l.contains("dp 1 x tp 2 x pp 1,"));
    assert!(split_runs.count() >= 1, "{stdout}");
    assert!(!stdout.contains("failed"), "{stdout}");
    assert_eq!(cfg.global_batch(), 8, "the global batch is kept");
    assert_eq!(
        cfg.num_train_steps / cfg.gradient_accumulation_steps,
        4,
        "the optimizer steps are kept"
    );
    if cfg.pipeline_parallel_size > 1 {
        let Some(Partition::CutAt(cuts)) = &cfg.pipeline.partition else {
            panic!(
                "a pipeline plan names its cuts: {:?}",
                cfg.pipeline.partition
            );
        };
        assert_eq!(cuts.len(), cfg.stages() - 1);
    }
    // Read from another folder than the user's, it trains.
    trains(&best);
    balanced_by_time_cuts_where_the_saved_times_say(&dir, &config);
    // Nothing of the planner's is left beside the user's file.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(".pipetrain-plan"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `partition = { balanced = { by = "time" } }` with the profile the plan saved: the
/// configuration reads exactly its times (by node name); with the passes saved apart,
/// `train` cuts on the schedule's critical path, and with the times alone (a profile of
/// an earlier version) balances them; without a profile, an error names the field and
/// how to write one.
fn balanced_by_time_cuts_where_the_saved_times_say(
    dir: &std::path::Path,
    config: &std::path::Path,
) {
    let times: NodeTimes =
        serde_json::from_slice(&std::fs::read(dir.join("times.json")).unwrap()).unwrap();
    assert_eq!(times.micro_batch, 8);
    assert!(times.times.values().all(|t| t.is_finite() && *t >= 0.0));
    assert!(times.times.values().sum::<f64>() > 0.0);
    let text = std::fs::read_to_string(config).unwrap();
    let by_time = format!(
        "pipeline_parallel_size = 2\ngradient_accumulation_steps = 2\nbatch_size = 4\n\
         num_train_steps = 4\n{}\n[pipeline]\nprofile = \"times.json\"\n\
         partition = {{ balanced = {{ stages = 2, by = \"time\" }} }}\n",
        text.replace("batch_size = 8\n", "")
            .replace("num_train_steps = 4\n", "")
    );
    let path = dir.join("by_time.toml");
    std::fs::write(&path, &by_time).unwrap();
    let cfg = TrainConfig::load(&path).unwrap();
    let Some(Partition::Weighted {
        stages: 2,
        times: read,
    }) = &cfg.pipeline.partition
    else {
        panic!("{:?}", cfg.pipeline.partition);
    };
    assert_eq!(read, &times.times);
    // The plan saved the passes apart too: `train` cuts on the schedule's critical path.
    let saved: pipetrain::cost::SavedProfile =
        serde_json::from_slice(&std::fs::read(dir.join("times.json")).unwrap()).unwrap();
    let costs = saved.costs.expect("the passes apart");
    assert_eq!(costs.forward.len(), times.times.len());
    assert!(costs.backward.values().sum::<f64>() > 0.0);
    let log = trains_logging(&path);
    assert!(log.contains("on the schedule's critical path"), "{log}");
    // A profile of the times alone (an earlier version's) balances them linearly.
    let mut bare: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("times.json")).unwrap()).unwrap();
    bare.as_object_mut().unwrap().remove("costs");
    std::fs::write(dir.join("times.json"), bare.to_string()).unwrap();
    let log = trains_logging(&path);
    assert!(log.contains("no costs by pass"), "{log}");
    let missing = dir.join("no_profile.toml");
    std::fs::write(&missing, by_time.replace("profile = \"times.json\"\n", "")).unwrap();
    let err = TrainConfig::load(&missing).unwrap_err().to_string();
    assert!(
        err.contains("pipeline.profile") && err.contains("--save-profile"),
        "{err}"
    );
}

/// `pipetrain plan CONFIG` on two devices, micro-batch counts up to 2, short profiles
/// and the whole table, with `extra` arguments, the best written to `best` (and the
/// node times to `times`): what it printed, once it succeeded.
pub(crate) fn plan(
    config: &std::path::Path,
    extra: &[&str],
    (best, times): (&std::path::Path, Option<&std::path::Path>),
) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    command
        .args(["plan", "--devices", "2", "--max-micro-batches", "2"])
        .args(["--profile-steps", "3", "--top", "100"])
        .args(extra)
        .arg(config)
        .arg("--out")
        .arg(best);
    if let Some(t) = times {
        command.arg("--save-profile").arg(t);
    }
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// `pipetrain plan CONFIG` on two devices with `extra`, writing to `out`, fails: its
/// stderr.
pub(crate) fn plan_refused(
    config: &std::path::Path,
    extra: &[&str],
    out: &std::path::Path,
) -> String {
    let refused = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["plan", "--devices", "2"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .arg(config)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    String::from_utf8_lossy(&refused.stderr).to_string()
}

/// `stdout` (a plan with `--measure` and `--out`) says it wrote the fastest measured
/// run that fits, and `written` has that run's layout and micro-batches.
fn fastest_measured_is_written(stdout: &str, written: &TrainConfig) {
    let said = stdout
        .lines()
        .find_map(|l| l.split_once("(the fastest measured: "))
        .unwrap_or_else(|| panic!("no fastest measured written:\n{stdout}"))
        .1;
    let (name, ms) = said.trim_end_matches(" ms)").rsplit_once(", ").unwrap();
    let runs: Vec<(String, f64, &str)> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("measured"))
        .skip(2)
        .take_while(|l| l.contains(" dp "))
        .map(|l| {
            let (head, layout) = l.split_once(" dp ").unwrap();
            let cols: Vec<&str> = head.split_whitespace().collect();
            let name = cols[..cols.len() - 3].join(" ");
            (name, cols[cols.len() - 2].parse().unwrap(), layout)
        })
        .collect();
    let (_, measured, layout) = runs
        .iter()
        .find(|r| r.0 == name)
        .unwrap_or_else(|| panic!("{name} was not measured:\n{stdout}"));
    assert_eq!(format!("{measured:.2}"), ms, "{stdout}");
    // No memory cap: every measured run fits, the default and the cut rivals too.
    assert!(runs.iter().all(|r| r.1 >= *measured), "{stdout}");
    let c = written;
    let cols: Vec<&str> = layout.split(", ").collect();
    let ours = [
        format!(
            "{} x tp {} x pp {}",
            c.data_parallel_size, c.horizontal_parallel_size, c.pipeline_parallel_size
        ),
        format!("{} x {}", c.gradient_accumulation_steps, c.batch_size),
    ];
    assert_eq!([cols[0], cols[2]], ours, "{layout}");
    let schedule = cols[1].split('(').next().unwrap();
    assert!(c.pipeline.schedule.name().starts_with(schedule), "{layout}");
}

/// `pipetrain train CONFIG` succeeds, logging at `info`: what it logged.
fn trains_logging(config: &std::path::Path) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(config)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "{}: {stderr}", config.display());
    stderr
}

/// `pipetrain train CONFIG` succeeds.
pub(crate) fn trains(config: &std::path::Path) {
    let run = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}: {stderr}", config.display());
}

/// A fresh folder `name` holding [`CONFIG`] as `gpt.toml`: the folder and the file.
pub(crate) fn config_in(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile_dir(name);
    let config = dir.join("gpt.toml");
    std::fs::write(&config, CONFIG).unwrap();
    (dir, config)
}

pub(crate) fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("plan-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
