//! `pipetrain plan`: the backward's split into input- and weight-gradient work agrees
//! with what the stage builder puts in each stage's `I` graph, and a plan's written
//! configuration is one `train` runs as it is, with the layout the plan ranked first.

use std::collections::HashSet;
use std::process::Command;

use crate::common::{self, PeerModel};
use pipetrain::config::TrainConfig;
use pipetrain::cost::split::BackwardGraph;
use pipetrain::cost::PerFamily;
use pipetrain::graph::{assign_stages, build_stage_graphs, NodeTimes, Partition};

#[test]
fn each_stage_s_input_gradient_part_is_what_the_stage_builder_puts_in_its_i_graph() {
    let rt = common::runtime();
    let tg = PeerModel::load("tiny_gpt").training_graph(&rt);
    let graph = BackwardGraph::of(&tg);
    let live = pipetrain::cost::stages::Cuttable::of(&tg).live;
    let backward = &tg.graph.nodes[tg.forward_len..];
    // Cuts after each of many nodes, some between a product and its bias (where the
    // bias's reshaped gradient crosses): every later stage's `I` graph runs exactly the
    // backward nodes found for it.
    let mut checked = 0;
    for at in 1..live.len() {
        let cut = tg.graph.nodes[live[at - 1]].output[0].clone();
        let a = assign_stages(&tg, &Partition::CutAt(vec![cut.clone()])).unwrap();
        let stages = build_stage_graphs(&tg, &a).unwrap();
        let input = graph.input_part(&|i| a.stage[i]);
        let in_i: HashSet<&str> = stages[1]
            .backward_input
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect();
        for (b, n) in backward.iter().enumerate() {
            // Constants cost nothing and may become initializers of the stage graphs.
            if a.stage[tg.anchors[b]] != Some(1) || n.op_type == "Constant" {
                continue;
            }
            checked += 1;
            assert_eq!(
                input[b],
                in_i.contains(n.name.as_str()),
                "cut at `{cut}`: backward node `{}` ({})",
                n.name,
                n.op_type,
            );
        }
        // The first stage hands nothing back.
        assert!(backward
            .iter()
            .enumerate()
            .all(|(b, _)| a.stage[tg.anchors[b]] != Some(0) || !input[b]));
    }
    assert!(checked > 1000, "{checked} backward nodes compared");
}

/// The peers' tiny GPT's training graph, where it can be cut, and cuts at a third and
/// two thirds of its nodes.
fn tiny_gpt_in_three() -> (
    pipetrain::graph::TrainingGraph,
    pipetrain::cost::stages::Cuttable,
    [usize; 2],
) {
    let rt = common::runtime();
    let tg = PeerModel::load("tiny_gpt").training_graph(&rt);
    let cut = pipetrain::cost::stages::Cuttable::of(&tg);
    let n = cut.live.len();
    (tg, cut, [n / 3, 2 * n / 3])
}

/// Every node of `tg` a millisecond, the one graph running both passes in 60% of their
/// time, each action 0.1 ms beside its nodes and a cut stage's 0.2 ms more.
fn flat_profile(tg: &pipetrain::graph::TrainingGraph) -> pipetrain::cost::Profile {
    let forward = vec![1e-3; tg.forward_len];
    let backward = vec![1e-3; tg.graph.nodes.len() - tg.forward_len];
    let total = 1e-3 * (forward.len() + backward.len()) as f64;
    pipetrain::cost::Profile {
        shards: 1,
        stages: 1,
        threads: 1,
        micro_batch: 1,
        forward,
        backward,
        fused: 0.6 * total,
        action_gap: 1e-4,
        stage_runs: PerFamily::all(2e-4),
        ..Default::default()
    }
}

#[test]
fn scaling_a_stage_s_passes_scales_that_stage_s_forward_input_and_weight_parts_alone() {
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let mut profile = flat_profile(&tg);
    let before = cut.passes(&profile, &bounds);
    let factors = [[2.0, 1.0, 0.5], [1.0, 3.0, 1.0], [0.25, 1.0, 4.0]];
    cut.scale_passes(&mut profile, &bounds, &factors);
    let after = cut.passes(&profile, &bounds);
    for (s, ((b, a), k)) in before.iter().zip(&after).zip(&factors).enumerate() {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs().max(1.0);
        assert!(
            b.0 > 0.0 && b.2 > 0.0,
            "stage {s} has forward and weight nodes"
        );
        assert!(
            close(a.0, b.0 * k[0]),
            "stage {s} forward {} -> {}",
            b.0,
            a.0
        );
        assert!(
            close(a.1, b.1 * k[1]),
            "stage {s} input part {} -> {}",
            b.1,
            a.1
        );
        assert!(
            close(a.2, b.2 * k[2]),
            "stage {s} weight part {} -> {}",
            b.2,
            a.2
        );
    }
}

#[test]
fn each_schedule_family_pays_the_stage_cost_calibrated_on_a_run_of_its_family() {
    use pipetrain::cost::stages::stage_costs;
    use pipetrain::cost::Family;
    use pipetrain::graph::Recompute;
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let profile = pipetrain::cost::Profile {
        stage_runs: PerFamily([5e-4, 2e-4, 7e-4, 1e-4]),
        ..flat_profile(&tg)
    };
    let costs = |f| stage_costs(&profile, &cut, &bounds, (Recompute::None, f));
    let split = costs(Family::Split);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    // The same nodes, each action dearer or cheaper by its family's cost.
    for (family, more) in [
        (Family::Unsplit, 3e-4),
        (Family::Interleaved, 5e-4),
        (Family::V, -1e-4),
    ] {
        let other = costs(family);
        for s in 0..2 {
            let what = format!("{family:?}, stage {s}");
            assert!(close(other[s].forward - split[s].forward, more), "{what}");
            assert!(close(other[s].backward - split[s].backward, more), "{what}");
        }
        // The last stage of an unsplit schedule runs one graph: its `B` only hands on
        // the gradient, paying the action's gap and no stage run.
        if !family.splits_backward() {
            assert!(close(other[2].backward, 1e-4));
        }
    }
}

#[test]
fn a_stage_that_recomputes_runs_its_forward_again_in_its_input_gradient_pass() {
    use pipetrain::cost::stages::stage_costs;
    use pipetrain::graph::Recompute;
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let profile = flat_profile(&tg);
    let total = profile.forward.iter().chain(&profile.backward).sum::<f64>();
    let gap = 3e-4;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * total;
    for family in pipetrain::cost::Family::ALL {
        let none = stage_costs(&profile, &cut, &bounds, (Recompute::None, family));
        let again = stage_costs(&profile, &cut, &bounds, (Recompute::Stage, family));
        let f = none[1].forward - gap;
        // A middle stage: its input-gradient pass (and its whole backward) runs the
        // forward again in one graph; its weight-gradient pass is unchanged.
        assert!(close(
            again[1].backward_input - gap,
            0.6 * (f + none[1].backward_input - gap)
        ));
        assert!(close(again[1].backward_weight, none[1].backward_weight));
        assert!(close(
            again[1].backward - gap,
            0.6 * (f + none[1].backward - gap)
        ));
        // The first stage: its input-gradient pass, which has no gradient to hand back,
        // only runs the forward again (at the forward's speed, keeping what the
        // weight-gradient pass reads); its weight-gradient pass is unchanged. Unsplit,
        // its backward runs the forward again in one graph.
        let f0 = none[0].forward - gap;
        assert!(close(none[0].backward_input, gap));
        assert!(close(again[0].backward_input - gap, f0));
        assert!(close(again[0].backward_weight, none[0].backward_weight));
        assert!(close(
            again[0].backward - gap,
            0.6 * (f0 + none[0].backward - gap)
        ));
        // Its forward keeps no stash: at the one graph's speed too.
        assert!(close(again[1].forward - gap, 0.6 * f));
    }
}

#[test]
fn the_bytes_crossing_a_cut_are_what_the_stages_send_each_other() {
    let rt = common::runtime();
    let tg = PeerModel::load("tiny_gpt").training_graph(&rt);
    // Unit ratio: the bytes at the graph's own batch.
    let cut = pipetrain::cost::stages::Cuttable::of(&tg).measured_at(1);
    let bytes = |names: &[String], leave: &[String]| -> f64 {
        let sent = names.iter().filter(|n| !leave.contains(n));
        sent.map(|n| &tg.metas[n.as_str()])
            .map(|m| (m.numel() * m.dtype.size()) as f64)
            .sum()
    };
    let mut checked = 0;
    for at in 1..cut.live.len() {
        if !cut.hands_on(&[at]) {
            continue;
        }
        let name = tg.graph.nodes[cut.live[at - 1]].output[0].clone();
        let a = assign_stages(&tg, &Partition::CutAt(vec![name.clone()])).unwrap();
        let stages = build_stage_graphs(&tg, &a).unwrap();
        // The tied weight crosses once a step, not per micro-batch: not a hop's.
        let tied = &stages[0].io.tied;
        let forward = bytes(&stages[0].io.fwd_send, tied);
        let backward = bytes(&stages[1].io.bwd_send, &[]);
        assert_eq!(cut.crossing_bytes(at, false, 1), forward, "at `{name}`");
        assert_eq!(
            cut.crossing_bytes(at, true, 1),
            backward,
            "at `{name}`: {:?} {:?} {:?}",
            stages[1].io.bwd_send,
            stages[0].io.fwd_send,
            stages[0].io.tied
        );
        // Twice the micro-batch, twice the bytes.
        assert_eq!(cut.crossing_bytes(at, false, 2), 2.0 * forward);
        checked += 1;
    }
    assert!(checked > 20, "{checked} cuts compared");
    // After the loss come only the accuracy's nodes, which the training step does not run:
    // a cut there hands nothing on, and is never taken.
    let loss = cut.live.iter().position(|&i| {
        let outputs = &tg.graph.nodes[i].output;
        outputs.iter().any(|o| o == pipetrain::graph::LOSS)
    });
    let after = loss.unwrap() + 1;
    assert!(after < cut.live.len(), "no node after the loss");
    assert!(!cut.hands_on(&[after]));
    assert_eq!(cut.crossing_bytes(after, false, 1), 0.0);
}

/// A small built-in GPT with a vocabulary head larger than its blocks.
const CONFIG: &str = r#"
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
    let dir = tempfile_dir("plan-writes");
    let config = dir.join("gpt.toml");
    std::fs::write(&config, CONFIG).unwrap();
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
    // Planned again from the cache: nothing measured, the same plan.
    let again = plan(
        &config,
        &["--profile-rounds", "2", "--profile-cache", cache],
        (&dir.join("again.toml"), None),
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
    // The table's first row is the layout written.
    let first = stdout
        .lines()
        .skip_while(|l| !l.starts_with("rank"))
        .nth(1)
        .unwrap_or_else(|| panic!("no table:\n{stdout}"));
    let cols: Vec<&str> = first.split_whitespace().collect();
    let cfg = TrainConfig::load(&best).unwrap();
    let layout =
        |cols: &[&str]| -> Vec<usize> { cols[1..4].iter().map(|c| c.parse().unwrap()).collect() };
    let hp = cfg.horizontal_parallel_size;
    assert_eq!(
        layout(&cols),
        [cfg.data_parallel_size, hp, cfg.pipeline_parallel_size],
        "{first}"
    );
    assert_eq!(cfg.data_parallel_size * hp * cfg.pipeline_parallel_size, 2);
    // Its ZeRO stage too (the column after recompute), none without replicas.
    assert_eq!(
        cols[9].parse::<u8>().unwrap(),
        cfg.deepspeed_zero_stage,
        "{first}"
    );
    assert!(cfg.data_parallel_size > 1 || cfg.deepspeed_zero_stage == 0);
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

/// Under a cap one worker cannot train the model within (its profile run, one stage,
/// ZB-H1, is predicted over it), the profile runs it in two pipeline stages, reads both
/// stages' ONNX Runtime profiles, and plans layouts that fit; the best is written and
/// trains.
#[test]
fn a_model_no_worker_holds_whole_under_the_cap_is_profiled_in_stages() {
    let dir = tempfile_dir("plan-stages");
    let config = dir.join("gpt.toml");
    std::fs::write(&config, CONFIG).unwrap();
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
fn plan(
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
fn trains(config: &std::path::Path) {
    let run = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}: {stderr}", config.display());
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("plan-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Over a cluster manifest of two nodes on this machine's loopback: the plan weighs the
/// link between them (measured, and calibrated against a launched job), measures its
/// best layout as a launched job, writes the configuration with the manifest beside it
/// holding the chosen layout, and the two nodes launched with those files train.
#[test]
fn a_plan_over_a_manifest_is_written_with_its_manifest_and_the_nodes_train_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile_dir("plan-manifest");
    let config = dir.join("gpt.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let secret = dir.join("job.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let rendezvous = common::launch::free_port();
    let port = std::iter::repeat_with(common::launch::free_port)
        .find(|&p| p.abs_diff(rendezvous) > 1)
        .unwrap();
    let manifest = dir.join("cluster.toml");
    std::fs::write(
        &manifest,
        format!(
            "[job]\nname = \"plan\"\nrendezvous = \"127.0.0.1:{rendezvous}\"\n\
             secret_file = \"job.secret\"\n[layout]\ndata_parallel = 2\npipeline_parallel = 1\n\
             [[nodes]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = {port}\ncpu_slots = 1\n\
             [[nodes]]\nname = \"b\"\naddress = \"127.0.0.2\"\nport = {port}\ncpu_slots = 1\n"
        ),
    )
    .unwrap();
    let best = dir.join("out").join("best.toml");
    std::fs::create_dir_all(best.parent().unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["plan", "--max-micro-batches", "2", "--profile-steps", "3"])
        .args(["--measure", "1", "--measure-steps", "4", "--manifest"])
        .arg(&manifest)
        .arg(&config)
        .arg("--out")
        .arg(&best)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("cluster: 2 nodes of 1 + 1 slots on this machine"),
        "{stdout}"
    );
    // Tensor shards split over the two nodes are not searched.
    assert!(
        stdout.contains("layouts whose tensor shards would span nodes"),
        "{stdout}"
    );
    let measured: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("measured"))
        .collect();
    assert!(
        measured[0].contains("`pipetrain launch` process"),
        "{stdout}"
    );
    assert!(measured.iter().any(|l| l.starts_with("1 ")), "{stdout}");
    assert!(!stdout.contains("failed"), "{stdout}");
    // The manifest beside the configuration holds its layout, and the sessions' threads
    // are set (each process would take every core).
    let cfg = TrainConfig::load(&best).unwrap();
    let written =
        pipetrain::cluster::ClusterManifest::load(&dir.join("out").join("best.cluster.toml"))
            .unwrap();
    let layout = written.layout();
    assert_eq!(
        (
            layout.data_parallel,
            layout.pipeline_parallel,
            layout.tensor_parallel
        ),
        (
            cfg.data_parallel_size,
            cfg.pipeline_parallel_size,
            cfg.horizontal_parallel_size
        )
    );
    assert!(cfg.runtime.intra_op_threads.is_some());
    // Its nodes launched with the written files train.
    let nodes: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| {
            Command::new(env!("CARGO_BIN_EXE_pipetrain"))
                .args(["launch", "--manifest"])
                .arg(written.path())
                .args(["--node", n])
                .arg(&best)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (n, node) in ["a", "b"].iter().zip(nodes) {
        let run = node.wait_with_output().unwrap();
        assert!(
            run.status.success(),
            "node {n}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
}
