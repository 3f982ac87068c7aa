//! A layout's stage costs from a [`Profile`], and stage cuts balanced by measured time.
//!
//! A stage's `F` is its forward nodes' time; its `I` the input-gradient part of their
//! backward (and their forward again under recompute), its `W` the weight-gradient part;
//! `B` both. The first stage hands no gradient back, so its `I` has nothing to do and its
//! `W` does all of its backward, as the runtime's first stage does. The last stage of a
//! schedule that does not split the backward runs both passes as one graph, at the
//! one-graph speed measured on the whole model. A pipeline of one
//! stage runs forward and backward as one graph: its measured [`Profile::fused`]. Each
//! action also costs the measured [`Profile::action_gap`].
//!
//! Cuts come from the linear partition of the nodes' whole-step costs (the largest stage
//! as small as it can be), then each cut moves while the simulated step gets shorter:
//! the schedule's critical path, not the largest stage, decides, so a first or last stage
//! carrying an embedding or a vocabulary head comes out lighter or heavier than the rest
//! as the schedule prefers.

use pipetrain_schedules::{Action, ActionKind, StageCost};

use crate::graph::partition::{balanced_boundaries, constant_nodes};
use crate::graph::{Recompute, TrainingGraph};

use super::profile::Profile;

/// The forward nodes that compute (not constants), in order: the positions cuts fall
/// between.
pub fn live_nodes(tg: &TrainingGraph) -> Vec<usize> {
    let constant = constant_nodes(tg);
    (0..tg.forward_len).filter(|&i| !constant[i]).collect()
}

/// Per stage (cut at `bounds`, positions in `live`), its `F`, `B`, `I` and `W`.
pub fn stage_costs(
    profile: &Profile,
    live: &[usize],
    bounds: &[usize],
    (recompute, split): (Recompute, bool),
) -> Vec<StageCost> {
    let edges: Vec<usize> = std::iter::once(0)
        .chain(bounds.iter().copied())
        .chain(std::iter::once(live.len()))
        .collect();
    let gap = profile.action_gap;
    if bounds.is_empty() {
        return vec![StageCost::split(profile.fused + gap, gap, 0.0)];
    }
    // The one graph runs faster than its two halves (no stash between them).
    let whole = profile.total();
    let one_graph = if whole > 0.0 {
        profile.fused / whole
    } else {
        1.0
    };
    let last = edges.len() - 2;
    edges
        .windows(2)
        .enumerate()
        .map(|(s, w)| {
            let sum = |v: &[f64]| live[w[0]..w[1]].iter().map(|&i| v[i]).sum::<f64>();
            let (f, ig, wg) = (
                sum(&profile.forward),
                sum(&profile.input_grad),
                sum(&profile.weight_grad),
            );
            let again = match recompute {
                Recompute::Stage => f,
                Recompute::None => 0.0,
            };
            let (i, w) = match s {
                0 => (0.0, again + ig + wg),
                _ => (again + ig, wg),
            };
            if s == last && !split {
                // The last stage of an unsplit schedule: forward and backward as one graph.
                return StageCost::split((f + ig + wg) * one_graph + gap, gap, 0.0);
            }
            StageCost {
                forward: f + gap,
                backward: i + w + gap,
                backward_input: i + gap,
                backward_weight: w + gap,
            }
        })
        .collect()
}

/// The cut positions (in `live`) of `stages` stages whose whole-step costs are as even
/// as they can be.
pub fn even_bounds(profile: &Profile, live: &[usize], stages: usize) -> Vec<usize> {
    let costs: Vec<f64> = live
        .iter()
        .map(|&i| profile.forward[i] + profile.input_grad[i] + profile.weight_grad[i])
        .collect();
    balanced_boundaries(&costs, stages)
}

/// Moves each cut in `bounds` while `step` (a simulated step time for given cuts) falls:
/// steps of a sixteenth of the mean stage's nodes, halved down to one node.
pub fn refine_bounds(
    mut bounds: Vec<usize>,
    nodes: usize,
    step: &dyn Fn(&[usize]) -> Option<f64>,
) -> Vec<usize> {
    let Some(mut best) = step(&bounds) else {
        return bounds;
    };
    let mut stride = (nodes / (bounds.len() + 1) / 16).max(1);
    loop {
        let mut moved = false;
        for k in 0..bounds.len() {
            let low = if k == 0 { 1 } else { bounds[k - 1] + 1 };
            let high = bounds.get(k + 1).map_or(nodes - 1, |&b| b - 1);
            for delta in [-(stride as isize), stride as isize] {
                let at = bounds[k] as isize + delta;
                if at < low as isize || at > high as isize {
                    continue;
                }
                let mut tried = bounds.clone();
                tried[k] = at as usize;
                if let Some(t) = step(&tried).filter(|&t| t < best * (1.0 - 1e-9)) {
                    best = t;
                    bounds = tried;
                    moved = true;
                }
            }
        }
        if !moved {
            if stride == 1 {
                return bounds;
            }
            stride /= 2;
        }
    }
}

/// The seconds an action of a layout takes at full speed: its stage's cost for compute;
/// `all_reduce[s]` and `step[s]` for the stage's reduction and update.
pub fn action_seconds(a: Action, costs: &[StageCost], all_reduce: &[f64], step: &[f64]) -> f64 {
    let s = a.stage();
    match a.kind() {
        ActionKind::Forward => costs[s].forward,
        ActionKind::Backward => costs[s].backward,
        ActionKind::BackwardInput => costs[s].backward_input,
        ActionKind::BackwardWeight => costs[s].backward_weight,
        ActionKind::AllReduce => all_reduce[s],
        ActionKind::OptimizerStep => step[s],
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(forward: Vec<f64>) -> Profile {
        Profile {
            threads: 1,
            micro_batch: 1,
            input_grad: forward.clone(),
            weight_grad: forward.clone(),
            forward,
            fused: 0.0,
            action_gap: 0.0,
            step_per_value: 0.0,
            unmatched: 0.0,
        }
    }

    #[test]
    fn the_first_stage_does_its_whole_backward_in_w_and_recompute_adds_the_forward() {
        let p = profile(vec![1.0, 2.0, 3.0, 4.0]);
        let live = [0, 1, 2, 3];
        let c = stage_costs(&p, &live, &[2], (Recompute::None, true));
        assert_eq!(c[0].forward, 3.0);
        assert_eq!((c[0].backward_input, c[0].backward_weight), (0.0, 6.0));
        assert_eq!((c[1].backward_input, c[1].backward_weight), (7.0, 7.0));
        let r = stage_costs(&p, &live, &[2], (Recompute::Stage, true));
        assert_eq!(r[1].backward_input, 14.0);
        assert_eq!(r[1].backward, 21.0);
    }

    #[test]
    fn refining_moves_a_cut_to_where_the_simulated_step_is_shortest() {
        // A step time with its minimum at a cut after node 7 of 10.
        let step = |b: &[usize]| Some((b[0] as f64 - 7.0).abs() + 1.0);
        assert_eq!(refine_bounds(vec![2], 10, &step), vec![7]);
        // Where it cannot simulate, the cuts stay.
        assert_eq!(refine_bounds(vec![2], 10, &|_| None), vec![2]);
    }
}
