//! A run recorded by the real actor runtime (simulated stages on a virtual clock) in the
//! Chrome trace event format: one complete event per recorded action with its times,
//! processes and tracks named, and a file that Python's `json` loads.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pipetrain::telemetry::chrome_trace;
use pipetrain_actors::sim::{CostFn, SimData, SimStage};
use pipetrain_actors::{run, ActorThreads, EngineSettings, RunTrace};
use pipetrain_schedules::{interleaved_1f1b, ActionKind, Schedule};
use serde_json::Value;

/// F = 1 ms, B = 2 ms, optimizer step 1 ms, transfers and all-reduce free; replica 1
/// takes 1 ms more for each, so the replicas' tracks differ. Whole milliseconds: tokio's
/// timer rounds sleeps up to them.
fn costs() -> CostFn {
    Arc::new(|_, replica, a| {
        let ms = match a.kind() {
            ActionKind::Forward | ActionKind::OptimizerStep => 1,
            ActionKind::Backward => 2,
            _ => return Duration::ZERO,
        };
        Duration::from_millis(ms + replica as u64)
    })
}

/// Two optimizer steps of `schedule` on two replicas, traced.
async fn record(schedule: Schedule) -> RunTrace {
    let stages = schedule.stages();
    let replicas = 2;
    let computes = (0..replicas)
        .map(|r| {
            (0..stages)
                .map(|s| SimStage::new(s, stages, r, costs()))
                .collect()
        })
        .collect();
    let settings = EngineSettings {
        watchdog: Duration::from_secs(5),
        record_trace: true,
        threads: ActorThreads::Tasks,
        ..EngineSettings::new(schedule, replicas)
    };
    let out = run(
        &settings,
        computes,
        Arc::new(SimData { stages }),
        Box::new(|_| 0.1),
        0..2,
        |_| {},
    )
    .await
    .unwrap();
    out.trace.unwrap()
}

/// Interleaved 1F1B (2 ranks x 2 virtual stages, 4 micro-batches), 2 replicas, 2 steps:
/// every recorded action is one `X` event with the right name, pid, tid, ts, dur and
/// args, in order; processes and tracks are named; tracks never overlap; the JSON loads.
#[tokio::test(start_paused = true)]
async fn a_simulated_run_converts_event_for_event() {
    let trace = record(interleaved_1f1b(2, 2, 4).unwrap()).await;
    assert_eq!(trace.steps.len(), 2);
    let v = chrome_trace(&trace);
    let events = v["traceEvents"].as_array().unwrap();

    // Metadata: a name and sort index for each of 2 processes and 2 x 2 tracks.
    let meta: Vec<&Value> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert_eq!(meta.len(), 2 * 2 + 2 * 2 * 2);
    let mut names = BTreeMap::new();
    for m in &meta {
        if m["name"] == "process_name" {
            names.insert((m["pid"].as_u64().unwrap(), 0), m["args"]["name"].clone());
        } else if m["name"] == "thread_name" {
            let key = (m["pid"].as_u64().unwrap(), m["tid"].as_u64().unwrap());
            names.insert(key, m["args"]["name"].clone());
        }
    }
    for pid in [1, 2] {
        assert_eq!(names[&(pid, 0)], format!("replica {}", pid - 1));
        assert_eq!(names[&(pid, 1)], "rank 0 (stages 0, 2)");
        assert_eq!(names[&(pid, 2)], "rank 1 (stages 1, 3)");
    }

    // One X event per recorded action, in recording order.
    let x: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let mut recorded = Vec::new();
    for (step, per_replica) in trace.steps.iter().enumerate() {
        for (replica, t) in per_replica.iter().enumerate() {
            for (rank, ranked) in t.ranks.iter().enumerate() {
                for e in ranked {
                    recorded.push((step, replica, rank, *e));
                }
            }
        }
    }
    // 8 F and 8 B, 2 all-reduces, 2 steps, and transfers, per replica and step.
    assert!(recorded.len() > 2 * 2 * 20, "{}", recorded.len());
    assert_eq!(x.len(), recorded.len());
    for (got, &(step, replica, rank, e)) in x.iter().zip(&recorded) {
        let a = e.action;
        assert_eq!(got["name"], a.to_string());
        assert_eq!(got["pid"], replica + 1);
        assert_eq!(got["tid"], rank + 1);
        assert_eq!(got["ts"], e.start_ns as f64 / 1e3, "{a}");
        assert_eq!(got["dur"], (e.end_ns - e.start_ns) as f64 / 1e3, "{a}");
        assert_eq!(got["args"]["step"], step);
        assert_eq!(got["args"]["stage"], a.stage());
        assert_eq!(
            got["args"]["micro_batch"].as_u64(),
            a.micro_batch().map(|m| m as u64)
        );
        assert!(names.contains_key(&(replica as u64 + 1, rank as u64 + 1)));
    }
    // The virtual clock makes the costs exact: replica 1's forwards take 2 ms.
    let forward = x
        .iter()
        .find(|e| e["pid"] == 2 && e["cat"] == "compute" && e["name"] == "0F0")
        .unwrap();
    assert_eq!(forward["dur"], 2000.0);

    // Events on one track follow each other without overlap (Perfetto nests overlapping
    // complete events; an actor runs one action at a time), across steps too.
    let mut tracks: BTreeMap<(u64, u64), Vec<(f64, f64)>> = BTreeMap::new();
    for e in &x {
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        tracks.entry(key).or_default().push((ts, ts + dur));
    }
    assert_eq!(tracks.len(), 4);
    for (key, spans) in &tracks {
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{key:?}: {:?} overlaps {:?}", w[0], w[1]);
        }
    }
    assert_eq!(v["otherData"]["steps"], 2);

    // Valid JSON to another reader: Python's json module loads it with the same events.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let script = r#"
import json, sys
d = json.load(open(sys.argv[1]))
x = [e for e in d["traceEvents"] if e["ph"] == "X"]
print(json.dumps([len(d["traceEvents"]), len(x), sorted({e["name"] for e in x})]))
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .output()
        .expect("python3 is needed to check the JSON");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (total, complete, kinds): (usize, usize, BTreeSet<String>) =
        serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((total, complete), (events.len(), recorded.len()));
    let want: BTreeSet<String> = recorded.iter().map(|r| r.3.action.to_string()).collect();
    assert_eq!(kinds, want);
}
