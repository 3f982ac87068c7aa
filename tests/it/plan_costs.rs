//! The planner's stage costs on a real graph (the peers' tiny GPT): the backward's split
//! into input- and weight-gradient work agrees with what the stage builder puts in each
//! stage's `I` graph; a stage's passes scale alone; each schedule family pays its own
//! calibrated stage cost; recompute runs the forward again where the runtime does; and
//! the bytes crossing a cut are what the stages send each other; a gradient's hand-off
//! costs its own measured time; a split model's update is charged once; the profile's
//! pipeline runs are cut where the nodes' times balance.

use std::collections::HashSet;

use crate::common::{self, PeerModel};
use pipetrain::cost::split::BackwardGraph;
use pipetrain::cost::PerFamily;
use pipetrain::graph::{assign_stages, build_stage_graphs, Partition};

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
/// time, each action 0.1 ms beside its nodes and a cut stage's nodes a fifth dearer.
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
        stage_overheads: PerFamily::all(0.2),
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
fn each_schedule_family_pays_the_stage_overhead_calibrated_on_a_run_of_its_family() {
    use pipetrain::cost::stages::stage_costs;
    use pipetrain::cost::Family;
    use pipetrain::graph::Recompute;
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let profile = pipetrain::cost::Profile {
        stage_overheads: PerFamily([0.5, 0.2, 0.7, 0.1]),
        ..flat_profile(&tg)
    };
    let costs = |f| stage_costs(&profile, &cut, &bounds, (Recompute::None, f));
    let split = costs(Family::Split);
    let gap = 1e-4;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    // The same nodes, each action's dearer or cheaper by its family's share.
    for (family, ratio) in [
        (Family::Unsplit, 1.5 / 1.2),
        (Family::Interleaved, 1.7 / 1.2),
        (Family::V, 1.1 / 1.2),
    ] {
        let other = costs(family);
        for s in 0..2 {
            let what = format!("{family:?}, stage {s}");
            let (f, b) = (split[s].forward - gap, split[s].backward - gap);
            assert!(f > 0.0 && b > 0.0, "{what}");
            assert!(close(other[s].forward - gap, f * ratio), "{what}");
            assert!(close(other[s].backward - gap, b * ratio), "{what}");
        }
        // The last stage of an unsplit schedule runs one graph: its `B` only hands on
        // the gradient, paying the action's gap and no stage run.
        if !family.splits_backward() {
            assert!(close(other[2].backward, 1e-4));
        }
    }
}

#[test]
fn the_last_stage_s_one_graph_pays_its_own_factor_where_the_backward_is_not_split() {
    use pipetrain::cost::stages::stage_costs;
    use pipetrain::cost::Family;
    use pipetrain::graph::Recompute;
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let plain = pipetrain::cost::Profile {
        stage_overheads: PerFamily::all(0.5),
        ..flat_profile(&tg)
    };
    // Unsplit and interleaved measured their last stage's one graph at 0.6 and 0.8 of
    // what their other actions pay; a factor on a split family has no one graph to act on.
    let factored = pipetrain::cost::Profile {
        last_stage_factors: PerFamily([0.6, 0.7, 0.8, 0.9]),
        ..plain.clone()
    };
    let gap = 1e-4;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    for (family, factor) in [
        (Family::Unsplit, 0.6),
        (Family::Split, 1.0),
        (Family::Interleaved, 0.8),
        (Family::V, 1.0),
    ] {
        let costs = |p| stage_costs(p, &cut, &bounds, (Recompute::None, family));
        let (before, after) = (costs(&plain), costs(&factored));
        for s in 0..3 {
            let what = format!("{family:?}, stage {s}");
            let k = if s == 2 { factor } else { 1.0 };
            assert!(before[s].forward > 2.0 * gap, "{what}");
            assert!(
                close(after[s].forward - gap, (before[s].forward - gap) * k),
                "{what}"
            );
            assert!(close(after[s].backward, before[s].backward), "{what}");
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
    // The action's gap; everything else scales with the stage's overhead alike.
    let gap = 1e-4;
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

#[test]
fn a_stage_pays_its_overhead_in_proportion_to_its_nodes_so_a_small_stage_pays_little() {
    use pipetrain::cost::stages::stage_costs;
    use pipetrain::cost::Family;
    use pipetrain::graph::Recompute;
    let (tg, cut, _) = tiny_gpt_in_three();
    let profile = flat_profile(&tg);
    let (gap, n) = (1e-4, cut.live.len());
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    let mut first_forward = Vec::new();
    for bounds in [vec![1], vec![n / 2]] {
        let (f, ig, wg) = cut.passes(&profile, &bounds)[0];
        let costs = stage_costs(&profile, &cut, &bounds, (Recompute::None, Family::Split));
        // The first stage's forward, and its weight-gradient pass doing all its backward,
        // each a fifth dearer than their nodes.
        assert!(close(costs[0].forward - gap, 1.2 * f), "cut at {bounds:?}");
        assert!(close(costs[0].backward_weight - gap, 1.2 * (ig + wg)));
        first_forward.push(costs[0].forward - gap);
    }
    // One node's stage pays a fifth of that node, half the model's a fifth of half.
    assert!(close(first_forward[0], 1.2e-3), "{first_forward:?}");
    assert!(
        first_forward[1] > 10.0 * first_forward[0],
        "{first_forward:?}"
    );
}

#[test]
fn a_gradient_s_hand_off_costs_its_own_measured_time() {
    use pipetrain::config::ScheduleKind;
    use pipetrain::cost::{node_values, simulate_candidate, Candidate, Machinery};
    use pipetrain::graph::Recompute;
    let (tg, cut, bounds) = tiny_gpt_in_three();
    let profile = flat_profile(&tg);
    let values = node_values(&tg);
    // GPipe over three stages, one micro-batch: each step's actions one after another,
    // two activations and two gradients handed over on the way.
    let c = Candidate {
        dp: 1,
        tp: 1,
        pp: 3,
        schedule: ScheduleKind::Gpipe,
        virtual_stages: 1,
        micro_batches: 1,
        micro_batch: 1,
        recompute: Recompute::None,
        zero: 0,
    };
    let machine = |hop_back| Machinery {
        hop: 1e-4,
        hop_back,
        ..Machinery::bare(3, 1)
    };
    let step = |m: &Machinery| {
        simulate_candidate(&c, &profile, (&cut, &values), m, Some(bounds.to_vec()))
            .unwrap()
            .step
    };
    let same = step(&machine(None));
    let apart = step(&machine(Some(4e-4)));
    // Each of the two gradients' hand-offs 0.3 ms dearer; the activations' as they were.
    assert!((apart - same - 6e-4).abs() < 1e-9, "{same} -> {apart}");
}

#[test]
fn a_split_model_s_update_costs_what_its_profile_measured_with_the_shards_updating_at_once() {
    use pipetrain::cost::{node_values, simulate_candidate, Candidate, Machinery};
    let (tg, cut, _) = tiny_gpt_in_three();
    let values = node_values(&tg);
    let held: f64 = values.iter().sum();
    // Two shards on two cores, each action 10% slower for the other and each update 50%
    // slower for the other's: the profile of the two shards ran them so.
    let m = Machinery {
        contention: 0.1,
        update_contention: Some(0.5),
        ..Machinery::bare(2, 1)
    };
    let c = Candidate::one_f_one_b((1, 2, 1), (1, 1));
    let step = |per_value: f64| {
        let profile = pipetrain::cost::Profile {
            shards: 2,
            step_per_value: per_value,
            ..flat_profile(&tg)
        };
        simulate_candidate(&c, &profile, (&cut, &values), &m, Some(vec![]))
            .unwrap()
            .step
    };
    // The update adds what the profile measured of it, its contention not charged again.
    let update = step(2e-9) - step(0.0);
    assert!(
        (update / (held * 2e-9) - 1.0).abs() < 1e-9,
        "{update} s for {held} values"
    );
}

#[test]
fn the_profile_s_pipeline_runs_are_cut_where_the_nodes_times_balance_and_train_cuts_there() {
    use pipetrain::graph::BalanceBy;
    let (tg, cut, _) = tiny_gpt_in_three();
    // Every node a millisecond but one, three quarters in, as dear as half the rest: the
    // FLOPs cut knows nothing of its time.
    let n = cut.live.len();
    let mut forward = vec![1e-3; tg.forward_len];
    forward[cut.live[3 * n / 4]] = 0.5e-3 * n as f64;
    let backward = vec![0.0; tg.graph.nodes.len() - tg.forward_len];
    let seconds = (forward.iter().sum(), 0.0);
    let cuts = pipetrain::cost::run_cuts(&tg, (&forward, &backward), seconds);
    let stages: Vec<usize> = cuts.iter().map(|c| c.stages).collect();
    assert_eq!(stages, [2, 4], "two ranks of one stage and of two");
    let profile = pipetrain::cost::Profile {
        forward,
        backward,
        ..Default::default()
    };
    let slowest = |bounds: &[usize]| {
        let passes = cut.passes(&profile, bounds);
        passes.iter().map(|p| p.0 + p.1 + p.2).fold(0.0, f64::max)
    };
    for c in &cuts {
        let by_flops = cut
            .balanced_bounds(&tg, c.stages, BalanceBy::Flops)
            .unwrap();
        let (time, flops) = (slowest(&c.bounds), slowest(&by_flops));
        assert!(
            time < 0.95 * flops,
            "{} stages: slowest stage {time:.4} s cut by time, {flops:.4} by FLOPs",
            c.stages
        );
        // `train` cuts a configuration's `cut_at` names where the bounds are.
        let a = assign_stages(&tg, &Partition::CutAt(c.names.clone())).unwrap();
        let first_of = |s| cut.live.iter().position(|&i| a.stage[i] == Some(s));
        let read: Vec<usize> = (1..c.stages).filter_map(first_of).collect();
        assert_eq!(read, c.bounds, "{} stages", c.stages);
    }
}
