//! A plan as text: the profile and the machine as measured, the best layouts that fit,
//! the default layout and the cuts beside them, and what is short where nothing fits.

use crate::train::peak::gb;

use super::{Candidate, Plan, PlanRow};
use crate::cost::Family;

/// The cluster's nodes and link, where the plan spans several nodes.
fn cluster_text(plan: &Plan) -> String {
    let (Some(nodes), Some(link)) = (&plan.nodes, plan.machinery.link) else {
        return String::new();
    };
    let slots: Vec<String> = nodes.slots.iter().map(usize::to_string).collect();
    let mut out = format!(
        "cluster: {} nodes of {} slots on {}; between nodes a stage's message waits {:.1} us + \
         {:.2} GB/s (+{:.1} us to wake an idle receiver) and its copies work at {:.2} GB/s, a \
         ring segment {:.1} us + {:.2} GB/s\n",
        nodes.slots.len(),
        slots.join(" + "),
        match nodes.hosts {
            1 => "this machine".to_string(),
            h => format!("{h} machines (each taken as this one)"),
        },
        link.message.latency * 1e6,
        gb_per_s(link.message.per_byte),
        link.wake * 1e6,
        gb_per_s(link.message_work),
        link.segment.latency * 1e6,
        gb_per_s(link.segment.per_byte),
    );
    if plan.shards_across_nodes > 0 {
        out += &format!(
            "left out: {} layouts whose tensor shards would span nodes\n",
            plan.shards_across_nodes
        );
    }
    out
}

/// What a process holds beside its ranks, and the process cap.
fn process_text(plan: &Plan) -> String {
    let cap = match &plan.cap.process {
        Some((cap, from)) => format!("the process cap {} ({from})", gb(*cap)),
        None => "no process cap".into(),
    };
    format!(
        "memory: beside its ranks a process holds {} at micro-batches of {} (measured \
         here, scaled to each layout's); {cap}\n",
        plan.process_base.describe(),
        plan.process_base.micro_batch
    )
}

fn gb_per_s(per_byte: f64) -> f64 {
    match per_byte > 0.0 {
        true => 1e-9 / per_byte,
        false => f64::INFINITY,
    }
}

/// A family's stage overhead, with what its last stage's one graph pays instead.
fn with_last_stage(p: &crate::cost::Profile, family: Family) -> String {
    let own = 1.0 + p.stage_overheads[family];
    let last = own * crate::cost::stages::last_stage_factor(p, family);
    format!(
        "{} (the last stage's one graph {})",
        percent(own - 1.0),
        percent(last - 1.0)
    )
}

/// A share as a signed whole percentage, never "-0%".
fn percent(share: f64) -> String {
    format!("{:+}%", (share * 100.0).round() + 0.0)
}

/// The plan as text: the profile, the best `top` candidates that fit, the default
/// layout, and what is short where nothing fits.
pub fn report(plan: &Plan, top: usize) -> String {
    let mut out = String::new();
    for p in &plan.profiles {
        out += &format!(
            "profile: micro-batch {}, {} thread(s){}: {:.3} ms per micro-batch (forward {:.3}, \
             backward {:.3}; as one graph {:.3}; a stage's action {} unsplit, {} split, {} interleaved, \
             {} in a V), {:.0}% \
             of kernel time in nodes ONNX Runtime made\n",
            p.micro_batch,
            p.threads,
            match (p.shards, p.stages) {
                (1, 1) => String::new(),
                (1, k) => format!(", as {k} pipeline stages (one worker holds no more under the cap)"),
                (n, _) => format!(", {n} tensor shards (each shard's)"),
            },
            p.total() * 1e3,
            p.forward.iter().sum::<f64>() * 1e3,
            p.backward.iter().sum::<f64>() * 1e3,
            p.fused * 1e3,
            with_last_stage(p, Family::Unsplit),
            percent(p.stage_overheads[Family::Split]),
            with_last_stage(p, Family::Interleaved),
            percent(p.stage_overheads[Family::V]),
            p.unmatched * 100.0
        );
    }
    if let Some((input, n)) = &plan.fixed_batch {
        out += &format!(
            "micro-batches of {n} only: the model's input `{input}` has a fixed batch of {n} \
             (export with dynamic_axes={{\"{input}\": {{0: \"batch\"}}}} to plan other sizes)\n"
        );
    }
    for (b, why) in &plan.skipped {
        let first = why.lines().next().unwrap_or("");
        out += &format!("left out: micro-batches of {b}: {first}\n");
    }
    for (tp, why) in &plan.tp_skipped {
        let first = why.lines().next().unwrap_or("");
        out += &format!("not split: {tp} tensor shards: {first}\n");
    }
    let m = &plan.machinery;
    let hosts = plan.nodes.as_ref().map_or(1, |n| n.hosts.max(1));
    out += &format!(
        "machine: {} cores, {} thread(s) per session, hand-off {:.1} us ({:.1} a gradient), two actions at once \
         each {:.1}% slower{}, replicas kept in step {:.1} us a step\n{} candidates \
         simulated ({})\n",
        m.cores / hosts,
        m.threads,
        m.hop * 1e6,
        m.gradient_hop() * 1e6,
        m.contention * 100.0,
        m.stage_contention.map_or(String::new(), |c| format!(
            " (two stages' actions {:.1}%)",
            c * 100.0
        )),
        m.replica_sync * 1e6,
        plan.rows.len(),
        match &plan.profile_read {
            Some((path, age)) => format!(
                "the profile read from {}, measured{} in {:.1} s",
                path.display(),
                age.map_or(String::new(), |a| format!(" {} min ago", a / 60)),
                plan.profile_seconds
            ),
            None => format!("profiling took {:.1} s", plan.profile_seconds),
        }
    );
    out += &cluster_text(plan);
    out += &process_text(plan);
    out += "\n";
    let unit = unit_of(plan);
    out += &format!(
        "rank  dp  tp  pp  schedule          micro-batches  recompute  zero  step ms  bubble  process  peak per rank ({})\n",
        unit.1
    );
    let shown: Vec<&PlanRow> = plan.fitting().take(top).collect();
    for (i, r) in shown.iter().enumerate() {
        out += &format!("{:>4}  {}\n", i + 1, row_text(r, unit));
    }
    out += &ties_text(&shown);
    if let Some(d) = &plan.default {
        out += &format!(
            "\ndefault (1F1B, cuts by parameters):\n   -  {}\n",
            row_text(d, unit)
        );
        if let Some(b) = plan.best() {
            out += &format!(
                "predicted speed-up of the plan over the default: {:.2}x\n",
                d.simulated.step / b.simulated.step
            );
        }
    }
    if let Some((_, first)) = plan.cut_rivals.first() {
        let time = plan
            .rows
            .iter()
            .find(|r| r.candidate == first.candidate)
            .map_or(f64::NAN, |r| r.simulated.step);
        out += &format!(
            "cuts of the fastest pipeline layout ({}): by time {:.2} ms",
            layout_text(&first.candidate),
            time * 1e3
        );
        for (by, r) in &plan.cut_rivals {
            out += &format!(", by {by} {:.2} ms", r.simulated.step * 1e3);
        }
        out += "\n";
    }
    if plan.best().is_none() {
        out += &super::fits::nothing_fits(plan);
    }
    out
}

/// `dp 1 x pp 2, zb_h1, 4 x 4, recompute none`.
pub(crate) fn layout_text(c: &Candidate) -> String {
    format!(
        "dp {} x tp {} x pp {}, {}, {} x {}, recompute {}",
        c.dp,
        c.tp,
        c.pp,
        schedule_text(c),
        c.micro_batches,
        c.micro_batch,
        recompute_name(c.recompute)
    ) + &match c.zero {
        0 => String::new(),
        z => format!(", ZeRO {z}"),
    }
}

fn schedule_text(c: &Candidate) -> String {
    match c.schedule {
        crate::config::ScheduleKind::Interleaved1f1b => {
            format!("interleaved(v={})", c.virtual_stages)
        }
        k => k.name().to_string(),
    }
}

fn recompute_name(r: crate::graph::Recompute) -> &'static str {
    match r {
        crate::graph::Recompute::None => "none",
        crate::graph::Recompute::Stage => "stage",
    }
}

/// Gigabytes, or megabytes where no rank of any layout reaches a gigabyte.
fn unit_of(plan: &Plan) -> (f64, &'static str) {
    let rows = plan.rows.iter().chain(&plan.default);
    match rows
        .flat_map(|r| r.peak.iter().chain(&r.processes))
        .any(|&p| p >= 1_000_000_000)
    {
        true => (1e9, "GB"),
        false => (1e6, "MB"),
    }
}

fn row_text(r: &PlanRow, (scale, _): (f64, &str)) -> String {
    let c = &r.candidate;
    let schedule = schedule_text(c);
    let peaks: Vec<String> = r
        .peak
        .iter()
        .map(|p| format!("{:.2}", *p as f64 / scale))
        .collect();
    let process = r.processes.iter().copied().max().unwrap_or(0);
    format!(
        "{:>2}  {:>2}  {:>2}  {:<17} {:>2} x {:<8}  {:<9}  {:>4}  {:>7.2}  {:>6.3}  {:>7.2}  {}",
        c.dp,
        c.tp,
        c.pp,
        schedule,
        c.micro_batches,
        c.micro_batch,
        recompute_name(c.recompute),
        c.zero,
        r.simulated.step * 1e3,
        r.simulated.bubble,
        process as f64 / scale,
        peaks.join(" ")
    )
}

/// Which shown rows recompute and are ranked after a slower twin without it (`rank`):
/// empty where none is.
pub(super) fn ties_text(shown: &[&PlanRow]) -> String {
    let after: Vec<String> = shown
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[1].simulated.step < w[0].simulated.step)
        .map(|(i, _)| format!("{}", i + 2))
        .collect();
    match after.is_empty() {
        true => String::new(),
        false => format!(
            "(rank {}: recomputes, predicted within {:.0}% of its twin without recompute, \
             ranked after it)\n",
            after.join(", "),
            super::rank::TIE * 100.0
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_share_is_a_signed_whole_percentage_and_never_minus_zero() {
        assert_eq!(super::percent(0.254), "+25%");
        assert_eq!(super::percent(-0.116), "-12%");
        assert_eq!(super::percent(-0.004), "+0%");
    }
}
