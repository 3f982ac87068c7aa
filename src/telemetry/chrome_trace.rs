//! A recorded run ([`RunTrace`], what `pipetrain train --trace` saves) in the Chrome trace
//! event format, the JSON that the Perfetto UI (ui.perfetto.dev) and `chrome://tracing`
//! open: the run's real timeline, zoomable, with every action's step, stage and
//! micro-batch a click away, where the SVG drawing (`svg`) shows one step at a fixed size.
//!
//! # Mapping
//! - One process per data-parallel replica (`pid` = replica + 1), named `replica r`.
//! - One thread, i.e. one track, per pipeline rank (`tid` = rank + 1), named
//!   `rank k (stages ...)` after the stages the rank holds.
//! - One complete event (`ph: "X"`) per traced action, named by the action's text form
//!   (`1F3`, `0SEND_B2`, `0ALLREDUCE`: the stage first, so that the two stages an
//!   interleaved rank holds stay apart on its track), with `ts`/`dur` in microseconds
//!   from the run's start (fractional: the trace has nanoseconds), `cat` the kind of work,
//!   `cname` a colour close to the SVG drawing's (for `chrome://tracing`; Perfetto colours
//!   by name), and `args` the step, stage, micro-batch and, for transfers, the peer stage.
//!
//! Ids start at 1 because the Perfetto maintainers advise against pid 0 in synthesised
//! traces (the kernel's idle task gets special handling in its UI and trace processor).
//!
//! Written by hand with `serde_json`: the format is a flat list of small objects, and the
//! crates that emit it (`tracing-chrome`, ...) record live `tracing` spans rather than
//! convert a finished record.

use pipetrain_actors::RunTrace;
use pipetrain_schedules::{ActionKind, Schedule, TraceEvent};
use serde_json::{json, Map, Value};

/// The Chrome trace event format of `trace`: a JSON object with `traceEvents` (process
/// and thread names, then one complete event per traced action, step by step, replica by
/// replica, rank by rank, in the order each rank ran them) and `otherData` (the run's
/// shape). Write it with `serde_json::to_writer` and open the file in the Perfetto UI.
///
/// An event recorded as ending before it starts (only a damaged trace has one) gets a
/// zero duration, so that the rest of the run still opens.
pub fn chrome_trace(trace: &RunTrace) -> Value {
    // A trace with more replicas or ranks than its header says is still shown whole.
    let replicas = trace
        .steps
        .iter()
        .map(Vec::len)
        .fold(trace.replicas, usize::max);
    let ranks = trace
        .steps
        .iter()
        .flatten()
        .map(|t| t.ranks.len())
        .fold(trace.schedule.num_ranks(), usize::max);
    let actions: usize = trace
        .steps
        .iter()
        .flatten()
        .flat_map(|t| &t.ranks)
        .map(Vec::len)
        .sum();
    let mut events = Vec::with_capacity(replicas * (2 + 2 * ranks) + actions);
    for replica in 0..replicas {
        let pid = id(replica);
        events.push(metadata(
            pid,
            0,
            "process_name",
            "name",
            json!(format!("replica {replica}")),
        ));
        events.push(metadata(
            pid,
            0,
            "process_sort_index",
            "sort_index",
            json!(replica),
        ));
        for rank in 0..ranks {
            let name = rank_name(&trace.schedule, rank);
            events.push(metadata(pid, id(rank), "thread_name", "name", json!(name)));
            events.push(metadata(
                pid,
                id(rank),
                "thread_sort_index",
                "sort_index",
                json!(rank),
            ));
        }
    }
    for (step, per_replica) in trace.steps.iter().enumerate() {
        for (replica, t) in per_replica.iter().enumerate() {
            for (rank, ranked) in t.ranks.iter().enumerate() {
                for e in ranked {
                    events.push(complete(step, id(replica), id(rank), e));
                }
            }
        }
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "pipetrain",
            "stages": trace.schedule.stages(),
            "ranks": ranks,
            "micro_batches": trace.schedule.micro_batches(),
            "replicas": replicas,
            "steps": trace.steps.len(),
        },
    })
}

/// The pid of a replica or the tid of a rank: see the module docs for the `+ 1`.
fn id(index: usize) -> usize {
    index + 1
}

/// `rank 0 (stage 0)`, `rank 1 (stages 1, 3)`; just `rank k` for a rank the schedule lacks.
fn rank_name(schedule: &Schedule, rank: usize) -> String {
    let stages: Vec<String> = schedule.stages_of(rank).map(|s| s.to_string()).collect();
    match stages.len() {
        0 => format!("rank {rank}"),
        1 => format!("rank {rank} (stage {})", stages[0]),
        _ => format!("rank {rank} (stages {})", stages.join(", ")),
    }
}

/// A metadata event (`ph: "M"`) as Chrome writes them.
fn metadata(pid: usize, tid: usize, name: &str, key: &str, value: Value) -> Value {
    json!({
        "name": name,
        "ph": "M",
        "cat": "__metadata",
        "pid": pid,
        "tid": tid,
        "ts": 0,
        "args": { key: value },
    })
}

/// One traced action as a complete event (`ph: "X"`).
fn complete(step: usize, pid: usize, tid: usize, e: &TraceEvent) -> Value {
    let action = e.action;
    let mut args = Map::new();
    args.insert("step".into(), json!(step));
    args.insert("stage".into(), json!(action.stage()));
    if let Some(mb) = action.micro_batch() {
        args.insert("micro_batch".into(), json!(mb));
    }
    if let Some(peer) = action.peer_stage() {
        args.insert("peer_stage".into(), json!(peer));
    }
    let (cat, cname) = style(action.kind());
    json!({
        "name": action.to_string(),
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": micros(e.start_ns),
        "dur": micros(e.end_ns.saturating_sub(e.start_ns)),
        "cname": cname,
        "args": args,
    })
}

/// Nanoseconds as microseconds. Exact to the nanosecond for runs up to about 100 days
/// (f64 holds integers to 2^53 ns, and the division by 1000 is correctly rounded).
fn micros(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// The event category and colour of a kind. The colour names are the reserved ones of
/// the trace viewer's colour scheme (catapult `color_scheme.html`), picked close to the
/// SVG drawing's: forward blue, backward red, input-gradient orange, weight-gradient
/// green, transfers grey, all-reduce mauve, optimizer step yellow.
fn style(kind: ActionKind) -> (&'static str, &'static str) {
    match kind {
        ActionKind::Forward => ("compute", "rail_response"),
        ActionKind::Backward => ("compute", "rail_animation"),
        ActionKind::BackwardInput => ("compute", "rail_idle"),
        ActionKind::BackwardWeight => ("compute", "rail_load"),
        ActionKind::SendAct | ActionKind::RecvAct | ActionKind::SendGrad | ActionKind::RecvGrad => {
            ("transfer", "grey")
        }
        ActionKind::AllReduce => ("all_reduce", "thread_state_uninterruptible"),
        ActionKind::OptimizerStep => ("optimizer_step", "cq_build_running"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipetrain_schedules::{one_f_one_b, Action, Trace};

    /// Exact times in microseconds, args per kind, and a damaged event's zero duration.
    #[test]
    fn events_carry_times_and_args() {
        let schedule = one_f_one_b(2, 1).unwrap();
        let trace = RunTrace {
            schedule,
            replicas: 1,
            steps: vec![vec![Trace {
                ranks: vec![
                    vec![
                        TraceEvent::new(Action::forward(0, 0), 1_234_567, 2_000_000),
                        TraceEvent::new(Action::send_act(0, 0), 2_000_000, 2_000_001),
                        TraceEvent::new(Action::all_reduce(0), 9_000, 8_000),
                    ],
                    vec![],
                ],
            }]],
        };
        let v = chrome_trace(&trace);
        let x: Vec<&Value> = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert_eq!(x.len(), 3);
        assert_eq!(x[0]["name"], "0F0");
        assert_eq!(x[0]["ts"], 1234.567);
        assert_eq!(x[0]["dur"], 765.433);
        assert_eq!(
            x[0]["args"],
            json!({"step": 0, "stage": 0, "micro_batch": 0})
        );
        assert_eq!(
            (x[0]["pid"].as_u64(), x[0]["tid"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(x[1]["name"], "0SEND_F0");
        assert_eq!(x[1]["dur"], 0.001);
        assert_eq!(x[1]["cat"], "transfer");
        assert_eq!(
            x[1]["args"],
            json!({"step": 0, "stage": 0, "micro_batch": 0, "peer_stage": 1})
        );
        assert_eq!(x[2]["name"], "0ALLREDUCE");
        assert_eq!(x[2]["dur"], 0.0, "ends before it starts: zero duration");
        assert_eq!(x[2]["args"], json!({"step": 0, "stage": 0}));
    }

    #[test]
    fn ranks_are_named_after_their_stages() {
        let interleaved = pipetrain_schedules::interleaved_1f1b(2, 2, 4).unwrap();
        assert_eq!(rank_name(&interleaved, 1), "rank 1 (stages 1, 3)");
        let plain = one_f_one_b(3, 3).unwrap();
        assert_eq!(rank_name(&plain, 2), "rank 2 (stage 2)");
        assert_eq!(rank_name(&plain, 3), "rank 3");
    }
}
