//! A layout's stage costs from a [`Profile`], and stage cuts balanced by measured time.
//!
//! A stage's `F` is its forward nodes' time; its `I` the input-gradient part of their
//! backward (and their forward again under recompute), its `W` the weight-gradient part;
//! `B` both. The first stage hands no gradient back, so its `I` has nothing to do and its
//! `W` does all of its backward, as the runtime's first stage does; under recompute its
//! `I` runs the forward again (at the forward's speed: it keeps what `W` reads) and
//! nothing else, as the runtime's does (charged to `W` at the one graph's speed instead,
//! on 16 bench runs of the fixtures the V-shaped schedules' recomputing layouts measured
//! 14% slower than without recompute on average, 4-25%, where the simulator said 5%). The
//! last stage of a schedule that does not split the backward runs both passes as one
//! graph, at the one-graph speed measured on the whole model, and so does a pass that
//! recomputes the forward (the forward again runs in one graph with the backward that
//! reads it: on the sub-millisecond fixtures this is why recompute costs a pipeline
//! almost nothing, where the forward's full time again predicted it 10-24% slow); that
//! stage's forward, which keeps nothing but what it sends, runs at the one graph's speed
//! too (at the forward's full speed, the fixtures' recomputing layouts came out up to 6
//! points slower, on the same measured runs). The unsplit last stage's `B` only hands on
//! the gradient its one graph made: it pays no stage run (charged one, the calibration
//! spread it over the other actions, and the fixtures' 1F1B layouts of two micro-batches
//! came out up to 3 points slower). Cut, each action's nodes cost a share more, what a
//! stage's action was measured to pay beside them, calibrated against a two-rank run of
//! its schedule's [`Family`] ([`Profile::stage_overheads`]): a share of the action's
//! work, not a fixed cost an action (a fixed cost calibrated where the run cut the model
//! by FLOPs charged the Llama fixture's cut by time, whose first stage holds the
//! embedding alone, 79 us an action where its forward and backward took 11 and 21 us).
//! Where the backward is not split, the last stage's one graph pays its own share,
//! a factor on the other actions' ([`Profile::last_stage_factors`], from the balance of
//! the family's run's stages in its trace): on the Llama fixture at micro-batches of 4
//! the one graph paid +10% where the other actions paid +25%, and with one share for
//! both, GPipe cut by time (its last stage all but the embedding) came out 7% slow.
//! A pipeline of one stage runs forward and backward as one graph: its measured
//! [`Profile::fused`]. Each action also costs the measured [`Profile::action_gap`].
//!
//! Cuts come from the linear partition of the nodes' whole-step costs (the largest stage
//! as small as it can be), then each cut moves while the simulated step gets shorter:
//! the schedule's critical path, not the largest stage, decides, so a first or last stage
//! carrying an embedding or a vocabulary head comes out lighter or heavier than the rest
//! as the schedule prefers.

use pipetrain_schedules::{Action, ActionKind, StageCost};

use crate::graph::partition::{balanced_boundaries, constant_nodes};
use crate::graph::{Recompute, TrainingGraph};

use super::crossing::Crossings;
use super::split::BackwardGraph;
use super::{Family, Profile};

/// What cutting needs of the training graph: the forward nodes that compute (not
/// constants), in order, which the cuts fall between; each forward node's place among
/// them; and the backward as a graph.
#[derive(Debug, Clone)]
pub struct Cuttable {
    /// Forward nodes that compute.
    pub live: Vec<usize>,
    /// Each forward node's position in `live`.
    position: Vec<Option<usize>>,
    /// Per position in `live`, the earliest position whose output a node at or after it
    /// reads (`usize::MAX` for none): a cut at `b` hands something on where
    /// `read_from[b] < b`.
    read_from: Vec<usize>,
    /// The values that cross each cut, forward and back.
    crossings: Crossings,
    /// The backward.
    backward: BackwardGraph,
}

impl Cuttable {
    /// The cuttable form of `tg`.
    pub fn of(tg: &TrainingGraph) -> Cuttable {
        let constant = constant_nodes(tg);
        let live: Vec<usize> = (0..tg.forward_len).filter(|&i| !constant[i]).collect();
        let mut position = vec![None; tg.forward_len];
        for (p, &i) in live.iter().enumerate() {
            position[i] = Some(p);
        }
        let producer: std::collections::HashMap<&str, usize> = live
            .iter()
            .enumerate()
            .flat_map(|(p, &i)| {
                tg.graph.nodes[i]
                    .output
                    .iter()
                    .map(move |o| (o.as_str(), p))
            })
            .collect();
        // What the training step runs: a node only evaluation reads (the accuracy after
        // the loss) receives nothing in a training step.
        let trained = super::crossing::trained_nodes(tg, &producer, &live);
        let mut read_from: Vec<usize> = live
            .iter()
            .zip(&trained)
            .map(|(&i, &trains)| {
                let inputs = tg.graph.nodes[i].input.iter().filter(|_| trains);
                inputs
                    .filter_map(|v| producer.get(v.as_str()).copied())
                    .min()
                    .unwrap_or(usize::MAX)
            })
            .collect();
        for p in (0..read_from.len().saturating_sub(1)).rev() {
            read_from[p] = read_from[p].min(read_from[p + 1]);
        }
        let crossings = Crossings::of(tg, (&live, &position, &trained), &producer);
        Cuttable {
            live,
            position,
            read_from,
            crossings,
            backward: BackwardGraph::of(tg),
        }
    }

    /// This, with the graph's values measured at micro-batches of `samples`.
    pub fn measured_at(mut self, samples: usize) -> Cuttable {
        self.crossings.samples = samples.max(1);
        self
    }

    /// Bytes crossing a cut at position `bound` (in `live`) for a micro-batch of
    /// `samples` (see [`Crossings::bytes`]).
    pub fn crossing_bytes(&self, bound: usize, gradients: bool, samples: usize) -> f64 {
        self.crossings.bytes(bound, gradients, samples)
    }

    /// The cut positions of `stages` stages of `tg` (this one's graph) balanced by `by`, as
    /// a configuration's `partition = { balanced = ... }` cuts them.
    pub fn balanced_bounds(
        &self,
        tg: &TrainingGraph,
        stages: usize,
        by: crate::graph::BalanceBy,
    ) -> Option<Vec<usize>> {
        let balanced = crate::graph::Partition::Balanced { stages, by };
        let a = crate::graph::assign_stages(tg, &balanced).ok()?;
        let first_of = |s| self.live.iter().position(|&i| a.stage[i] == Some(s));
        Some((1..stages).filter_map(first_of).collect())
    }

    /// Whether every cut in `bounds` hands a value on to the stages after it (a stage
    /// that receives nothing, such as one holding only nodes of the labels after the
    /// loss, cannot run in a pipeline).
    pub fn hands_on(&self, bounds: &[usize]) -> bool {
        bounds
            .iter()
            .all(|&b| self.read_from.get(b).is_some_and(|&r| r < b))
    }

    /// The stage of forward node `i` under `bounds`.
    fn stage_of(&self, bounds: &[usize], i: usize) -> Option<usize> {
        let p = self.position.get(i).copied().flatten()?;
        Some(bounds.iter().filter(|&&b| b <= p).count())
    }

    /// Per stage (cut at `bounds`), its forward, input-gradient and weight-gradient time.
    pub fn passes(&self, profile: &Profile, bounds: &[usize]) -> Vec<(f64, f64, f64)> {
        let mut out = vec![(0.0, 0.0, 0.0); bounds.len() + 1];
        for &i in &self.live {
            if let Some(s) = self.stage_of(bounds, i) {
                out[s].0 += profile.forward[i];
            }
        }
        let stage_of = |i: usize| self.stage_of(bounds, i);
        let input = self.backward.input_part(&stage_of);
        for (b, &t) in profile.backward.iter().enumerate() {
            let s = stage_of(self.backward.anchor(b)).unwrap_or(0);
            match input[b] {
                true => out[s].1 += t,
                false => out[s].2 += t,
            }
        }
        out
    }

    /// Scales `profile`'s node times stage by stage (cut at `bounds`): each stage's
    /// forward nodes by its `factors[s][0]`, the input-gradient part of its backward by
    /// `[1]`, the weight-gradient part by `[2]`.
    pub fn scale_passes(&self, profile: &mut Profile, bounds: &[usize], factors: &[[f64; 3]]) {
        let k =
            |s: Option<usize>, part: usize| s.and_then(|s| factors.get(s)).map_or(1.0, |f| f[part]);
        for &i in &self.live {
            profile.forward[i] *= k(self.stage_of(bounds, i), 0);
        }
        let stage_of = |i: usize| self.stage_of(bounds, i);
        let input = self.backward.input_part(&stage_of);
        for (b, t) in profile.backward.iter_mut().enumerate() {
            let s = stage_of(self.backward.anchor(b)).or(Some(0));
            *t *= k(s, if input[b] { 1 } else { 2 });
        }
    }
}

/// Each stage's `F`, `I` and `W` in milliseconds, for the log (`F/I/W`, stages apart).
pub fn passes_text(costs: &[StageCost]) -> String {
    let ms = |k: &StageCost| {
        format!(
            "{:.3}/{:.3}/{:.3}",
            k.forward * 1e3,
            k.backward_input * 1e3,
            k.backward_weight * 1e3
        )
    };
    costs.iter().map(ms).collect::<Vec<_>>().join(" ")
}

/// Per stage (cut at `bounds`, positions in `cut.live`) of a schedule of `family`, its
/// `F`, `B`, `I` and `W`.
pub fn stage_costs(
    profile: &Profile,
    cut: &Cuttable,
    bounds: &[usize],
    (recompute, family): (Recompute, Family),
) -> Vec<StageCost> {
    let split = family.splits_backward();
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
    let last = bounds.len();
    // What a cut stage's action pays beside its nodes, in proportion to them; the last
    // stage's one graph, where the backward is not split, pays its own.
    let own = 1.0 + profile.stage_overheads[family];
    let own_last = own * last_stage_factor(profile, family);
    cut.passes(profile, bounds)
        .into_iter()
        .enumerate()
        .map(|(s, (f, ig, wg))| {
            if s == last && !split {
                // The last stage of an unsplit schedule: forward and backward as one graph.
                // Its `B` only hands on the gradient the one graph made: no run of its own.
                return StageCost::split((f + ig + wg) * one_graph * own_last + gap, gap, 0.0);
            }
            let again = match recompute {
                Recompute::Stage => f,
                Recompute::None => 0.0,
            };
            // The input-gradient part runs the forward again and hands the weight-gradient
            // part what it reads; on the first stage that is all it does.
            let (i, w) = match s {
                0 => (again, ig + wg),
                _ => (again + ig, wg),
            };
            // The pass that runs the forward again runs it with its backward as one
            // graph, at the one graph's speed; the first stage's, with no backward of
            // its own, at the forward's.
            let again_in = |t: f64| if again > 0.0 { t * one_graph } else { t };
            let input = match s {
                0 => i,
                _ => again_in(i),
            };
            // A forward that runs again later keeps nothing but what it sends: it writes
            // out no stash, as the one graph does not.
            let forward = match again > 0.0 {
                true => f * one_graph,
                false => f,
            };
            StageCost {
                forward: forward * own + gap,
                backward: again_in(i + w) * own + gap,
                backward_input: input * own + gap,
                backward_weight: w * own + gap,
            }
        })
        .collect()
}

/// What the last stage's one graph of `family` pays against the other actions, a factor
/// on their `1 + overhead` ([`Profile::last_stage_factors`]; 1 where not measured).
pub fn last_stage_factor(profile: &Profile, family: Family) -> f64 {
    match profile.last_stage_factors[family] {
        f if f > 0.0 => f,
        _ => 1.0,
    }
}

/// The cut positions (in `cut.live`) of `stages` stages whose whole-step costs are as
/// even as they can be.
pub fn even_bounds(profile: &Profile, cut: &Cuttable, stages: usize) -> Vec<usize> {
    let mut costs: Vec<f64> = cut.live.iter().map(|&i| profile.forward[i]).collect();
    for (b, &t) in profile.backward.iter().enumerate() {
        let anchor = cut.backward.anchor(b);
        if let Some(p) = cut.position.get(anchor).copied().flatten() {
            costs[p] += t;
        }
    }
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

    #[test]
    fn refining_moves_a_cut_to_where_the_simulated_step_is_shortest() {
        // A step time with its minimum at a cut after node 7 of 10.
        let step = |b: &[usize]| Some((b[0] as f64 - 7.0).abs() + 1.0);
        assert_eq!(refine_bounds(vec![2], 10, &step), vec![7]);
        // Where it cannot simulate, the cuts stay.
        assert_eq!(refine_bounds(vec![2], 10, &|_| None), vec![2]);
    }
}
