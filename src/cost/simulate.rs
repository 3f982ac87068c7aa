//! A layout's step simulated from measured costs: its stages' compute from a
//! [`Profile`] cut at given or refined cuts ([`super::stages`]), on this machine's
//! cores shared by every worker ([`simulate_on`]), with the optimizer step and the
//! data-parallel reduction on the timeline.

use pipetrain_schedules::{
    lower, simulate_on, ActionKind, Hop, LowerOptions, Machine, ScheduleSpec, StageCost,
};

use crate::config::{ScheduleKind, TrainConfig};
use crate::graph::{Partition, Recompute, TrainingGraph};

use super::replicas::{reduce_seconds, update_seconds};
use super::stages::{action_seconds, even_bounds, refine_bounds, stage_costs, Cuttable};
use super::topology::{Link, Nodes};
use super::{Machinery, Profile};

/// One layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor shards of each stage (`horizontal_parallel_size`).
    pub tp: usize,
    /// Pipeline ranks.
    pub pp: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Stages per rank (2 for the interleaved schedule, as ZB-V has).
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Recompute.
    pub recompute: Recompute,
    /// ZeRO stage (`deepspeed_zero_stage`): 0, 1 (the optimizer state sharded over the
    /// replicas) or 2 (the gradients too).
    pub zero: u8,
}

impl Candidate {
    /// The layout `cfg` runs.
    pub fn of(cfg: &TrainConfig) -> Candidate {
        Candidate {
            dp: cfg.data_parallel_size,
            tp: cfg.horizontal_parallel_size,
            pp: cfg.pipeline_parallel_size,
            schedule: cfg.pipeline.schedule,
            virtual_stages: cfg.pipeline.virtual_stages,
            micro_batches: cfg.gradient_accumulation_steps,
            micro_batch: cfg.batch_size,
            recompute: cfg.recompute,
            zero: cfg.deepspeed_zero_stage,
        }
    }

    /// 1F1B over `micro_batches` of `micro_batch` samples in `dp` x `tp` x `pp`, without
    /// virtual stages, recompute or ZeRO: the layout a user writes by default.
    pub fn one_f_one_b(
        (dp, tp, pp): (usize, usize, usize),
        (micro_batches, micro_batch): (usize, usize),
    ) -> Candidate {
        Candidate {
            dp,
            tp,
            pp,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            micro_batches,
            micro_batch,
            recompute: Recompute::None,
            zero: 0,
        }
    }

    /// Pipeline stages.
    pub fn stages(&self) -> usize {
        self.schedule.stages(self.pp, self.virtual_stages)
    }

    /// The schedule to generate.
    pub fn spec(&self) -> ScheduleSpec {
        self.schedule
            .spec(self.pp, self.virtual_stages, self.micro_batches)
    }

    /// `cfg` with this layout (its cuts, the tensors ending each stage, given).
    pub fn apply(&self, cfg: &TrainConfig, cuts: &[String]) -> TrainConfig {
        let mut c = cfg.clone();
        c.data_parallel_size = self.dp;
        c.horizontal_parallel_size = self.tp;
        c.pipeline_parallel_size = self.pp;
        if let Some(w) = c.world_size.as_mut() {
            *w = self.dp * self.tp * self.pp;
        }
        c.batch_size = self.micro_batch;
        // Step counts are in micro-batches: the same optimizer steps.
        let optimizer_steps = cfg.num_train_steps / cfg.gradient_accumulation_steps.max(1);
        c.num_train_steps = optimizer_steps.max(1) * self.micro_batches;
        c.display_loss_steps = self.micro_batches
            * (cfg.display_loss_steps / cfg.gradient_accumulation_steps.max(1)).max(1);
        c.gradient_accumulation_steps = self.micro_batches;
        c.recompute = self.recompute;
        c.deepspeed_zero_stage = self.zero;
        c.pipeline.schedule = self.schedule;
        c.pipeline.virtual_stages = match self.schedule {
            ScheduleKind::Interleaved1f1b => self.virtual_stages,
            _ => 1,
        };
        c.pipeline.partition = match cuts.is_empty() {
            true => None,
            false => Some(Partition::CutAt(cuts.to_vec())),
        };
        c
    }
}

/// A candidate's simulated step: its seconds, idle share, and its cuts (positions in the
/// live nodes).
#[derive(Debug, Clone)]
pub struct Simulated {
    /// Seconds per optimizer step.
    pub step: f64,
    /// Idle share of the ranks' time.
    pub bubble: f64,
    /// Cut positions.
    pub bounds: Vec<usize>,
}

/// Simulates `c` with `profile`'s costs (measured at `c`'s micro-batch and threads);
/// `values[i]` are forward node `i`'s parameter values (for the update and reduction).
/// Its cuts are `fixed` where given, else balanced by time. `None` where the schedule
/// does not apply (too few micro-batches, say).
pub fn simulate_candidate(
    c: &Candidate,
    profile: &Profile,
    costs: (&Cuttable, &[f64]),
    m: &Machinery,
    fixed: Option<Vec<usize>>,
) -> Option<Simulated> {
    simulate_on_nodes(c, profile, costs, (m, None), Cuts::from(fixed))
}

/// How a simulated layout's stages are cut.
#[derive(Debug, Clone)]
pub enum Cuts {
    /// At these positions.
    Fixed(Vec<usize>),
    /// Balanced by time, and from each of these positions too, each moved while the
    /// simulated step falls: the shortest found.
    Refined(Vec<Vec<usize>>),
}

impl From<Option<Vec<usize>>> for Cuts {
    fn from(fixed: Option<Vec<usize>>) -> Cuts {
        match fixed {
            Some(b) => Cuts::Fixed(b),
            None => Cuts::Refined(Vec::new()),
        }
    }
}

/// [`simulate_candidate`] with the ranks spread over `nodes` (one process each, joined
/// by `m.link`): values and reductions that leave a node cross the link.
pub fn simulate_on_nodes(
    c: &Candidate,
    profile: &Profile,
    (cut, values): (&Cuttable, &[f64]),
    (m, nodes): (&Machinery, Option<&Nodes>),
    cuts: Cuts,
) -> Option<Simulated> {
    let stages = c.stages();
    let live = &cut.live;
    if stages > live.len() {
        return None;
    }
    let schedule = c.spec().generate().ok()?;
    let placement = schedule.placement().to_vec();
    let lowered = lower(
        &schedule,
        LowerOptions {
            all_reduce: c.dp > 1,
            optimizer_step: true,
        },
    )
    .ok()?;
    let family = super::Family::of(c.schedule);
    let machine = Machine {
        slots: (m.cores as f64 / m.threads as f64).max(1.0),
        // Every shard of every replica runs each action at once.
        copies: c.dp * c.tp,
        contention: m.contention_of(c),
    };
    // A split model's profile ran its shards at once: its times are each shard's slowed
    // by the others, which the simulator adds again for the shards it runs at once.
    let alone = machine.rate(profile.shards);
    // Its update too: each shard's, slowed by the others' updating at once (what
    // `update_factor` and the simulator would charge again).
    let update_paid = m.update_factor_of(profile.shards) / alone;
    let cluster = nodes.zip(m.link);
    let step = |bounds: &[usize]| -> Option<(f64, f64)> {
        if !cut.hands_on(bounds) {
            return None;
        }
        let costs: Vec<StageCost> = stage_costs(profile, cut, bounds, (c.recompute, family))
            .into_iter()
            .map(|k| scaled(k, alone))
            .collect();
        let held = stage_values(live, bounds, values);
        let on_link = |s: usize| cluster.filter(|(n, _)| n.ring_crosses(c, placement[s]));
        let update: Vec<f64> = held
            .iter()
            .enumerate()
            .map(|(s, &v)| {
                let whole = v * profile.step_per_value * m.update_factor(c) / update_paid;
                update_seconds(c, m, whole, (v, on_link(s)))
            })
            .collect();
        let reduce: Vec<f64> = held
            .iter()
            .enumerate()
            .map(|(s, &v)| reduce_seconds(c, m, v, on_link(s)))
            .collect();
        // Which hand-offs leave their node, and the bytes each carries: forward from
        // stage s to s + 1 (cut s), gradients from s to s - 1 (cut s - 1).
        let crossing = |from: usize, forward: bool| -> Option<(Link, f64)> {
            let to = if forward {
                from + 1
            } else {
                from.checked_sub(1)?
            };
            let (nodes, link) = cluster?;
            let ranks = (placement[from], *placement.get(to)?);
            if !nodes.hop_crosses(c, ranks.0, ranks.1) {
                return None;
            }
            let bound = bounds[from.min(to)];
            Some((link, cut.crossing_bytes(bound, !forward, c.micro_batch)))
        };
        let sends = |s: usize, forward: bool| {
            crossing(s, forward).map_or(0.0, |(link, bytes)| bytes * link.message_work)
        };
        let duration = |a: pipetrain_schedules::Action| {
            let work = action_seconds(a, &costs, &reduce, &update);
            work + match a.kind() {
                ActionKind::Forward => sends(a.stage(), true),
                ActionKind::Backward | ActionKind::BackwardInput => sends(a.stage(), false),
                _ => 0.0,
            }
        };
        let in_memory = |forward: bool| match forward {
            true => m.hop,
            false => m.gradient_hop(),
        };
        let hop = |h: Hop| match crossing(h.stage, h.forward) {
            // The actors' hand-over, as within a node, and the link's own wait.
            Some((link, bytes)) => {
                let wake = if h.waiting { link.wake } else { 0.0 };
                in_memory(h.forward) + link.message.message(bytes) + wake
            }
            None => in_memory(h.forward),
        };
        let t = simulate_on(&lowered, &duration, &hop, machine).ok()?;
        Some((t.makespan() + m.step_overhead, t.bubble_fraction()))
    };
    let bounds = match cuts {
        Cuts::Fixed(b) => b,
        Cuts::Refined(others) => {
            let starts = std::iter::once(even_bounds(profile, cut, stages))
                .chain(others.into_iter().filter(|b| b.len() + 1 == stages));
            let refined = starts.map(|b| refine_bounds(b, live.len(), &|b| step(b).map(|s| s.0)));
            let timed = refined.filter_map(|b| Some((step(&b)?.0, b)));
            timed.min_by(|a, b| a.0.total_cmp(&b.0))?.1
        }
    };
    let (time, bubble) = step(&bounds)?;
    tracing::debug!(
        "simulated {c:?}, cuts {bounds:?}: {:.3} ms; per stage F/I/W ms {}",
        time * 1e3,
        super::stages::passes_text(&stage_costs(profile, cut, &bounds, (c.recompute, family))),
    );
    Some(Simulated {
        step: time,
        bubble,
        bounds,
    })
}

fn scaled(k: StageCost, by: f64) -> StageCost {
    StageCost {
        forward: k.forward * by,
        backward: k.backward * by,
        backward_input: k.backward_input * by,
        backward_weight: k.backward_weight * by,
    }
}

/// Per stage, the parameter values its nodes hold.
fn stage_values(live: &[usize], bounds: &[usize], values: &[f64]) -> Vec<f64> {
    let edges: Vec<usize> = std::iter::once(0)
        .chain(bounds.iter().copied())
        .chain(std::iter::once(live.len()))
        .collect();
    edges
        .windows(2)
        .map(|w| live[w[0]..w[1]].iter().map(|&i| values[i]).sum())
        .collect()
}

/// Per forward node, the parameter values it reads first (each parameter counted once,
/// at the first node that reads it: the stage that owns it).
pub fn node_values(tg: &TrainingGraph) -> Vec<f64> {
    let sizes: std::collections::HashMap<&str, usize> = tg
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.meta.numel()))
        .collect();
    let mut seen = std::collections::HashSet::new();
    tg.graph.nodes[..tg.forward_len]
        .iter()
        .map(|n| {
            n.input
                .iter()
                .filter(|i| seen.insert(i.as_str()))
                .filter_map(|i| sizes.get(i.as_str()))
                .sum::<usize>() as f64
        })
        .collect()
}

/// The tensors ending each stage but the last, for `bounds` in `live`: what a
/// configuration's `partition = { cut_at = [...] }` names.
pub fn cut_names(tg: &TrainingGraph, live: &[usize], bounds: &[usize]) -> Vec<String> {
    bounds
        .iter()
        .map(|&b| tg.graph.nodes[live[b - 1]].output[0].clone())
        .collect()
}
