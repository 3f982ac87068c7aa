//! What a run's stages keep between forward and backward: the bytes the schedule
//! predicts from the stage graphs' value sizes, next to what the stages measured.

use std::collections::BTreeSet;
use std::path::Path;

use pipetrain_schedules::{simulate, ActionKind, CostModel, Schedule, StageCost};

use crate::compute::Runtime;
use crate::config::{ScheduleKind, TrainConfig};
use crate::data::open_step_batches;
use crate::graph::{
    assign_stages, build_stage_graphs_with, with_tied_shared, Partition, Recompute, StageGraphs,
    TrainingGraph,
};
use crate::{Error, Result};

use super::cap;
use super::peak::{gb, stage_memory, ProcessMemory};

/// One stage's peak stash: the most bytes it kept at once for its in-flight
/// micro-batches (activations, data, and under a split backward the hand-off from the
/// input-gradient half to the weight-gradient half).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StashPeak {
    /// The stage.
    pub stage: usize,
    /// What the stage held at its peak (replica 0's), counted as it ran.
    pub measured: u64,
    /// What the schedule's order predicts from the stage graphs' value sizes.
    pub predicted: u64,
}

/// Per stage, the bytes the schedule predicts it keeps at its peak: each forward keeps
/// the values the stage's backward reads and its data; an input-gradient pass adds what
/// it hands the weight-gradient pass and the gradients that arrived. The last stage of
/// an unsplit schedule runs forward and backward in one graph and keeps nothing.
pub(super) fn predicted_stash(
    tg: &TrainingGraph,
    stages: &[StageGraphs],
    schedule: &Schedule,
) -> Vec<u64> {
    let (kept, handoff) = stash_sizes(tg, stages, schedule);
    let costs = CostModel::uniform(stages.len(), StageCost::default());
    match simulate(schedule, &costs) {
        Ok(t) => t.peak_stash_bytes(&kept, &handoff),
        Err(_) => vec![0; stages.len()],
    }
}

/// Per stage: the bytes a forward keeps, and the bytes an input-gradient pass adds.
fn stash_sizes(
    tg: &TrainingGraph,
    stages: &[StageGraphs],
    schedule: &Schedule,
) -> (Vec<u64>, Vec<u64>) {
    let split = schedule
        .ranks()
        .iter()
        .flatten()
        .any(|a| a.kind() == ActionKind::BackwardInput);
    let bytes = |names: &BTreeSet<&String>| -> u64 {
        names
            .iter()
            .filter_map(|n| tg.metas.get(n.as_str()))
            .map(|m| (m.numel() * m.dtype.size()) as u64)
            .sum()
    };
    let mut kept = Vec::with_capacity(stages.len());
    let mut handoff = Vec::with_capacity(stages.len());
    for g in stages {
        if g.fused.is_some() && !split {
            kept.push(0);
            handoff.push(0);
            continue;
        }
        let k: BTreeSet<&String> = g.io.stash.iter().chain(&g.io.data).collect();
        let h: BTreeSet<&String> = match split {
            true => g.io.i_to_w.iter().chain(&g.io.bwd_recv).collect(),
            false => BTreeSet::new(),
        };
        kept.push(bytes(&k));
        handoff.push(bytes(&h.difference(&k).copied().collect()));
    }
    (kept, handoff)
}

/// One line of [`memory_table`]: a schedule with or without recompute.
#[derive(Debug, Clone)]
pub struct MemoryRow {
    /// The schedule's configuration name.
    pub schedule: &'static str,
    /// Whether stages recompute.
    pub recompute: Recompute,
    /// Idle share of the step with unit costs (F = I = W = 1).
    pub bubble: f64,
    /// Per pipeline rank, the peak stash bytes; or why this schedule does not apply.
    pub per_rank: std::result::Result<Vec<u64>, String>,
}

/// `pipetrain schedule memory`: for `cfg`'s model, data, pipeline size and
/// micro-batches, each schedule's bubble and each rank's peak stash, with and without
/// recompute, from the stage graphs' value sizes (no training step runs).
///
/// # Errors
/// The model, data or training graph cannot be built.
pub fn memory_table(rt: &Runtime, cfg: &TrainConfig, config_path: &Path) -> Result<Vec<MemoryRow>> {
    let tg = graph_of(rt, cfg, config_path)?;
    let kinds = ScheduleKind::ALL
        .into_iter()
        .filter(|&k| k != ScheduleKind::Interleaved1f1b || cfg.pipeline.virtual_stages > 1);
    let mut rows = Vec::new();
    for kind in kinds {
        let name = kind.name();
        let mut c = cfg.clone();
        c.pipeline.schedule = kind;
        // Balanced partitions follow each schedule's stage count.
        c.pipeline.partition = match c.pipeline.partition.take() {
            Some(Partition::Balanced { .. }) => None,
            Some(Partition::Weighted { times, .. }) => Some(Partition::Weighted {
                stages: c.stages(),
                times,
            }),
            other => other,
        };
        for recompute in [Recompute::None, Recompute::Stage] {
            let (bubble, per_rank) = match rank_peaks(&tg, &c, recompute) {
                Ok((b, p)) => (b, Ok(p)),
                Err(e) => (f64::NAN, Err(e.to_string())),
            };
            rows.push(MemoryRow {
                schedule: name,
                recompute,
                bubble,
                per_rank,
            });
        }
    }
    Ok(rows)
}

/// `cfg`'s training graph, its shapes measured on the first micro-batch of its data.
///
/// # Errors
/// The model, data or training graph cannot be built.
pub(crate) fn graph_of(
    rt: &Runtime,
    cfg: &TrainConfig,
    config_path: &Path,
) -> Result<TrainingGraph> {
    let model = cfg.load_model()?;
    let (batches, _, _) = open_step_batches(
        &cfg.data,
        cfg.global_batch(),
        cfg.data_parallel_size,
        config_path,
    )?;
    super::settings::training_graph(rt, cfg, &model, batches.as_ref(), 0, 0)
}

/// [`memory_table`]'s rows as text: a header, then a line per schedule and recompute.
pub fn memory_report(cfg: &TrainConfig, rows: &[MemoryRow]) -> String {
    let mut out = format!(
        "pp = {}, {} micro-batches of {}; peak stash per rank in MiB (bubble with F = I = W = 1)\n",
        cfg.pipeline_parallel_size, cfg.gradient_accumulation_steps, cfg.batch_size
    );
    for r in rows {
        let recompute = match r.recompute {
            Recompute::None => "none",
            Recompute::Stage => "stage",
        };
        let what = match &r.per_rank {
            Ok(ranks) => {
                let mib: Vec<String> = ranks
                    .iter()
                    .map(|b| format!("{:.2}", *b as f64 / (1u64 << 20) as f64))
                    .collect();
                format!("bubble {:.3}  ranks {}", r.bubble, mib.join(" "))
            }
            Err(why) => format!("n/a: {why}"),
        };
        out += &format!("{:<17} recompute {recompute:<5}  {what}\n", r.schedule);
    }
    out
}

/// The bubble and per-rank peak stash of `cfg`'s schedule.
fn rank_peaks(
    tg: &TrainingGraph,
    cfg: &TrainConfig,
    recompute: Recompute,
) -> Result<(f64, Vec<u64>)> {
    let schedule = cfg.schedule().generate().map_err(|e| Error::Partition {
        reason: e.to_string(),
    })?;
    let (tg, a) = with_tied_shared(tg, assign_stages(tg, &crate::cost::partition(tg, cfg)?)?);
    let stages = build_stage_graphs_with(&tg, &a, recompute)?;
    let (kept, handoff) = stash_sizes(&tg, &stages, &schedule);
    let costs = CostModel::uniform(stages.len(), StageCost::default());
    let t = simulate(&schedule, &costs).map_err(|e| Error::Partition {
        reason: e.to_string(),
    })?;
    Ok((
        t.bubble_fraction(),
        t.peak_stash_bytes_per_rank(&kept, &handoff),
    ))
}

/// Predicts this process's peak (it holds the `owned` (replica, stage) pairs of `built`)
/// and refuses the run where it exceeds the process's memory cap, naming layouts that
/// would fit. Called once the graphs are built, before any session opens.
///
/// # Errors
/// `MemoryCap` when the prediction exceeds the cap.
pub(super) fn check_fits(
    cfg: &TrainConfig,
    built: &super::phases::Built,
    owned: &[(usize, usize)],
    building_peak: Option<u64>,
) -> Result<ProcessMemory> {
    let per_stage = stage_memory(cfg, &built.tg, &built.stages, &built.predicted);
    // The initial values the graph holds move into the stages' buffers and are freed
    // once the sessions exist: counted in the stages' state, not twice.
    let initial = built.tg.initial_value_bytes();
    let need = ProcessMemory {
        stages: owned.iter().map(|&(_, s)| per_stage[s]).collect(),
        fixed: cap::resident_now().saturating_sub(initial),
        // What graph building allocated at its peak: the pages of memory-mapped weights
        // are the page cache's, not this process's (see `telemetry::AnonPeak`).
        so_far: building_peak
            .or_else(crate::telemetry::peak_resident_bytes)
            .unwrap_or(0),
    };
    tracing::info!("predicted peak memory: {}", need.describe());
    let Some(cap) = cap::memory_cap(cfg.runtime.memory_limit_gb) else {
        return Ok(need);
    };
    // An address-space cap also counts what is reserved and never touched.
    let counted = match cap.address_space {
        true => need.total() + cap::reserved_not_resident(),
        false => need.total(),
    };
    if counted <= cap.bytes {
        return Ok(need);
    }
    let over = Error::MemoryCap {
        predicted: match cap.address_space {
            true => format!(
                "{} resident and {} of address space reserved beside it",
                need.describe(),
                gb(cap::reserved_not_resident())
            ),
            false => need.describe(),
        },
        cap: gb(cap.bytes),
        from: cap.source.clone(),
        fits: what_fits(
            cfg,
            &built.tg,
            cap.bytes.saturating_sub(counted - need.total()),
            &need,
        ),
    };
    match cfg.runtime.refuse_over_memory_cap {
        true => Err(over),
        false => {
            tracing::warn!("{over} (going on: runtime.refuse_over_memory_cap is off)");
            Ok(need)
        }
    }
}

/// Layouts of one replica per process (more pipeline stages, recompute, and with
/// data parallelism the optimizer state sharded) whose every rank is predicted to fit in
/// `room` bytes, as a sentence. Each process builds the whole training graph, so graph
/// building's peak (`need.so_far`) bounds every layout.
fn what_fits(cfg: &TrainConfig, tg: &TrainingGraph, room: u64, need: &ProcessMemory) -> String {
    if need.so_far > room {
        return format!(
            "no layout fits: building the training graph alone peaked at {} in this process, \
             and every process of a pipeline builds the whole graph",
            gb(need.so_far)
        );
    }
    let mut tried = Vec::new();
    // Sharding the optimizer state (and the gradients) is a choice where there are
    // replicas to share it; on the host for the gradients.
    let zeros: &[u8] = match (cfg.data_parallel_size > 1, cfg.runtime.device) {
        (true, crate::compute::Device::Cpu) if cfg.horizontal_parallel_size == 1 => &[0, 1, 2],
        (true, _) => &[0, 1],
        (false, _) => &[0],
    };
    for recompute in [Recompute::None, Recompute::Stage] {
        for pp in [1, 2, 4, 8, 16] {
            for &zero in zeros.iter().filter(|&&z| z >= cfg.deepspeed_zero_stage) {
                let same = pp == cfg.pipeline_parallel_size
                    && recompute == cfg.recompute
                    && zero == cfg.deepspeed_zero_stage;
                if pp < cfg.pipeline_parallel_size || same {
                    continue;
                }
                let mut c = cfg.clone();
                c.pipeline_parallel_size = pp;
                c.recompute = recompute;
                c.deepspeed_zero_stage = zero;
                c.pipeline.partition = None;
                c.pipeline.virtual_stages = 1;
                let Ok(ranks) = rank_totals(tg, &c) else {
                    continue;
                };
                let top = ranks.iter().max().copied().unwrap_or(0);
                let worst = (top + need.fixed).max(need.so_far);
                let layout = format!("{} ({} per rank)", layout_text(&c), gb(worst));
                if worst <= room {
                    return format!("would fit: {layout}");
                }
                tried.push(layout);
            }
        }
    }
    let sharding = match cfg.data_parallel_size {
        1 => {
            "; with data_parallel_size > 1, deepspeed_zero_stage = 1 also shares the \
              optimizer state among the replicas, and 2 the gradients too"
        }
        _ => "",
    };
    format!(
        "no layout of one replica per process is predicted to fit: {}{sharding}",
        tried.join(", ")
    )
}

/// The settings `what_fits` varies, as a configuration would write them.
fn layout_text(c: &TrainConfig) -> String {
    let mut out = format!("pipeline_parallel_size = {}", c.pipeline_parallel_size);
    if c.recompute == Recompute::Stage {
        out.push_str(", recompute = \"stage\"");
    }
    if c.deepspeed_zero_stage > 0 {
        out.push_str(&format!(
            ", deepspeed_zero_stage = {}",
            c.deepspeed_zero_stage
        ));
    }
    out
}

/// Per pipeline rank of `cfg`'s layout, the predicted bytes of its stages (one replica,
/// nothing fixed).
fn rank_totals(tg: &TrainingGraph, cfg: &TrainConfig) -> Result<Vec<u64>> {
    rank_bytes(tg, cfg, 1.0)
}

/// [`rank_totals`] with the activations (stash and workspace) scaled by `activations`:
/// for micro-batches of another size than the one `tg`'s shapes were measured on.
pub(crate) fn rank_bytes(
    tg: &TrainingGraph,
    cfg: &TrainConfig,
    activations: f64,
) -> Result<Vec<u64>> {
    let schedule = cfg.schedule().generate().map_err(|e| Error::Partition {
        reason: e.to_string(),
    })?;
    let (tg, a) = with_tied_shared(tg, assign_stages(tg, &crate::cost::partition(tg, cfg)?)?);
    let stages = build_stage_graphs_with(&tg, &a, cfg.recompute)?;
    let stash = predicted_stash(&tg, &stages, &schedule);
    let per_stage = stage_memory(cfg, &tg, &stages, &stash);
    let placement = schedule.placement();
    let mut ranks = vec![0u64; cfg.pipeline_parallel_size];
    for (s, m) in per_stage.iter().enumerate() {
        if let Some(r) = placement.get(s) {
            let scaled = ((m.stash + m.workspace) as f64 * activations) as u64;
            ranks[*r] += m.state + m.constants + scaled;
        }
    }
    Ok(ranks)
}
