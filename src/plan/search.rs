//! The layouts `pipetrain plan` weighs, and each one's predicted step and memory.
//!
//! A candidate is a data-parallel, a tensor-parallel and a pipeline size whose product is
//! the workers (tensor parallelism where the model splits), a schedule, a micro-batch count (the configuration's global batch kept),
//! recompute on or off, and with replicas the ZeRO stage (the optimizer state, and on
//! the host without tensor shards the gradients too, sharded over them; stage 2 where
//! the profile measured its cost). Its cuts are balanced by measured time and moved to shorten its
//! simulated step, and the step is simulated on this machine's cores shared by every
//! worker, with the optimizer step and the data-parallel reduction on the timeline
//! ([`crate::cost`]); its memory per rank comes from the memory model that refuses runs
//! over a cap (`train::memory`).

use std::path::Path;

use crate::config::{ScheduleKind, TrainConfig};
use crate::cost::Nodes;
use crate::graph::{BalanceBy, Recompute};

use super::{PlanRow, Profiles, Sharded};

pub use crate::cost::{
    cut_names, node_values, simulate_candidate, simulate_on_nodes, Candidate, Machinery, Simulated,
};

/// Each candidate simulated on `on` at its profiled size, its cuts refined from those
/// by time, parameters and FLOPs, with its peak memory per rank; fastest first.
/// Candidates `train` would refuse (1F1B with fewer micro-batches than stages, say) or
/// without a profile are left out.
pub(super) fn simulated_rows(
    candidates: Vec<Candidate>,
    (cfg, config_path): (&TrainConfig, &Path),
    models: &[Sharded],
    profiles: &Profiles,
    on: (&Machinery, Option<&Nodes>),
    base: &super::process::ProcessBase,
) -> Vec<PlanRow> {
    let scale_of = |mb: usize| mb as f64 / cfg.batch_size as f64;
    let mut rows = Vec::new();
    for c in candidates {
        let (Some(model), Some(p)) = (
            models.iter().find(|m| m.tp == c.tp),
            profiles.get(&(c.tp, c.micro_batch)),
        ) else {
            continue;
        };
        // Refined from the cuts by time, by parameters and by FLOPs: the moves are local.
        let starts = [BalanceBy::Params, BalanceBy::Flops]
            .into_iter()
            .filter_map(|by| model.balanced_bounds(c.stages(), by))
            .collect();
        let cuts = crate::cost::Cuts::Refined(starts);
        let Some(sim) = simulate_on_nodes(&c, p, model.costs(), on, cuts) else {
            continue;
        };
        let cuts = cut_names(&model.tg, &model.cut.live, &sim.bounds);
        let applied = c.apply(cfg, &cuts);
        if applied.validate(config_path).is_err() {
            continue;
        }
        let peak = crate::train::rank_bytes(&model.tg, &applied, scale_of(c.micro_batch))
            .unwrap_or_default();
        let processes = super::process::process_peaks(&c, &peak, base, on.1);
        rows.push(PlanRow {
            candidate: c,
            cuts,
            simulated: sim,
            peak,
            processes,
        });
    }
    super::rank::rank(rows)
}

/// Every layout of `workers` workers for `cfg`'s global batch: tensor shards of `tps`
/// (1 and those the model splits into), micro-batch counts up to `max_micro_batches`, the
/// schedules that apply, recompute off and on, and each ZeRO stage the layout allows.
pub fn candidates(
    cfg: &TrainConfig,
    workers: usize,
    tps: &[usize],
    max_micro_batches: usize,
) -> Vec<Candidate> {
    let global = cfg.global_batch();
    let mut out = Vec::new();
    let divides = |n: usize| move |d: &usize| n % d == 0;
    let layouts = (1..=workers).filter(divides(workers)).flat_map(|dp| {
        let rest = workers / dp;
        let tps = tps.iter().copied().filter(divides(rest));
        tps.map(move |tp| (dp, tp, rest / tp)).collect::<Vec<_>>()
    });
    for (dp, tp, pp) in layouts {
        let schedules: &[(ScheduleKind, usize)] = match pp {
            1 => &[(ScheduleKind::OneFOneB, 1)],
            _ => &[
                (ScheduleKind::Gpipe, 1),
                (ScheduleKind::OneFOneB, 1),
                (ScheduleKind::Interleaved1f1b, 2),
                (ScheduleKind::ZbH1, 1),
                (ScheduleKind::ZbV, 1),
                (ScheduleKind::DualPipeV, 1),
                (ScheduleKind::VHalf, 1),
                (ScheduleKind::VMin, 1),
            ],
        };
        for m in 1..=max_micro_batches {
            if global % (dp * m) != 0 {
                continue;
            }
            for &(schedule, virtual_stages) in schedules {
                // One stage runs forward and backward as one graph: nothing to recompute.
                let recomputes: &[Recompute] = match pp {
                    1 => &[Recompute::None],
                    _ => &[Recompute::None, Recompute::Stage],
                };
                for &recompute in recomputes {
                    for zero in zero_stages(cfg, dp, tp) {
                        out.push(Candidate {
                            dp,
                            tp,
                            pp,
                            schedule,
                            virtual_stages,
                            micro_batches: m,
                            micro_batch: global / (dp * m),
                            recompute,
                            zero,
                        });
                    }
                }
            }
        }
    }
    out
}

/// The ZeRO stages `cfg` allows at `dp` replicas of `tp` shards: none without replicas
/// or with Adasum (which combines whole gradients); stage 2 only on the host, without
/// tensor shards, with gradient buckets (`config::validate`'s rules). Stage 2's
/// candidates are kept only where the plan measured its cost
/// (`Machinery::zero2_per_value`).
fn zero_stages(cfg: &TrainConfig, dp: usize, tp: usize) -> Vec<u8> {
    if dp == 1 || cfg.enable_adasum {
        return vec![0];
    }
    let buckets_on_host =
        cfg.gradient_bucket_mb > 0.0 && cfg.runtime.device == crate::compute::Device::Cpu;
    match tp == 1 && buckets_on_host {
        true => vec![0, 1, 2],
        false => vec![0, 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(global: usize) -> TrainConfig {
        let text = format!(
            "batch_size = {global}\nnum_train_steps = 4\n[model]\nkind = \"mlp\"\n\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
             [data]\nsynth = {{ kind = \"teacher\", samples = 64, seed = 5 }}\n\
             layout = {{ kind = \"arrays\", feeds = {{ x = \"x\", y = \"y\" }} }}\n\
             [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.1\n"
        );
        TrainConfig::parse(&text, std::path::Path::new("t.toml")).unwrap()
    }

    #[test]
    fn every_candidate_uses_the_workers_and_keeps_the_global_batch() {
        let cfg = config(12);
        let all = candidates(&cfg, 4, &[1, 2], 8);
        assert!(!all.is_empty());
        for c in &all {
            assert_eq!(c.dp * c.tp * c.pp, 4, "{c:?}");
            assert_eq!(c.dp * c.micro_batches * c.micro_batch, 12, "{c:?}");
            assert!(c.micro_batches <= 8);
            // One stage runs one graph: nothing to recompute, no schedule to choose.
            if c.pp == 1 {
                assert_eq!(c.recompute, Recompute::None);
                assert_eq!(c.schedule, ScheduleKind::OneFOneB);
            }
        }
        let layouts: std::collections::HashSet<(usize, usize, usize)> =
            all.iter().map(|c| (c.dp, c.tp, c.pp)).collect();
        // dp x tp x pp = 1x1x4, 2x1x2, 4x1x1, 1x2x2, 2x2x1.
        assert_eq!(layouts.len(), 5, "{layouts:?}");
        // ZeRO where there are replicas to share the state, stage 2 without shards.
        let zeros = |dp: usize, tp: usize| -> std::collections::BTreeSet<u8> {
            let of = all.iter().filter(|c| (c.dp, c.tp) == (dp, tp));
            of.map(|c| c.zero).collect()
        };
        assert_eq!(zeros(1, 1), [0].into());
        assert_eq!(zeros(2, 1), [0, 1, 2].into());
        assert_eq!(zeros(2, 2), [0, 1].into());
        // (One stage: what the schedule's own rules refuse is the simulator's to drop.)
        for c in all.iter().filter(|c| c.zero > 0 && c.pp == 1) {
            let applied = c.apply(&cfg, &[]);
            assert_eq!(applied.deepspeed_zero_stage, c.zero);
            applied.validate(std::path::Path::new("t.toml")).unwrap();
        }
        // Applied, a candidate is the configuration it describes.
        let c = all
            .iter()
            .find(|c| c.schedule == ScheduleKind::ZbV)
            .unwrap();
        let applied = c.apply(&cfg, &["h".into()]);
        assert_eq!(applied.global_batch(), 12);
        assert_eq!(applied.horizontal_parallel_size, c.tp);
        assert_eq!(applied.stages(), 2 * c.pp);
    }
}
