//! Telemetry from the outside: timeline drawings of simulated and traced schedules, the
//! metrics file as another program reads it, and the progress display on a terminal and in
//! a log.

use std::path::PathBuf;

use pipetrain::telemetry::{render, timeline_svg, MetricsWriter, Progress, StepMetrics};
use pipetrain::Error;
use pipetrain_schedules::{
    lower, one_f_one_b, simulate, Action, CostModel, LowerOptions, StageCost, Timeline, Trace,
    TraceEvent,
};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("telemetry");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// 1F1B over 4 stages and 8 micro-batches with F = B = 1, all-reduce and step included.
fn one_f_one_b_timeline(all_reduce: bool) -> Timeline {
    let schedule = one_f_one_b(4, 8).unwrap();
    let lowered = lower(
        &schedule,
        LowerOptions {
            all_reduce,
            optimizer_step: all_reduce,
        },
    )
    .unwrap();
    let mut costs = CostModel::uniform(4, StageCost::split(1.0, 0.5, 0.5));
    costs.all_reduce = 0.5;
    costs.optimizer_step = 0.25;
    simulate(&lowered, &costs).unwrap()
}

/// Checks that tags nest and close, the way an XML parser would (attribute values hold no
/// `<` or `>`, since the drawing escapes them), and returns how many elements there are.
fn check_nesting(svg: &str) -> usize {
    let mut open: Vec<&str> = Vec::new();
    let mut elements = 0;
    let mut rest = svg;
    while let Some(at) = rest.find('<') {
        let end = rest[at..].find('>').expect("unclosed tag") + at;
        let tag = &rest[at + 1..end];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(open.pop(), Some(name), "misnested </{name}>");
        } else {
            let name = tag.split_whitespace().next().unwrap();
            elements += 1;
            if !tag.ends_with('/') {
                open.push(name);
            }
        }
        rest = &rest[end + 1..];
    }
    assert!(open.is_empty(), "left open: {open:?}");
    elements
}

#[test]
fn svg_of_1f1b_has_one_rect_per_span_and_is_well_formed() {
    let t = one_f_one_b_timeline(true);
    let spans: Vec<_> = t.ranks.iter().flatten().collect();
    let compute = spans
        .iter()
        .filter(|s| s.action.kind().is_compute())
        .count();
    assert_eq!(compute, 2 * 4 * 8);
    let other = spans.len() - compute;
    assert_eq!(other, 2 * 4, "one ALLREDUCE and one STEP per stage");

    let svg = timeline_svg(&t, "1F1B p=4 m=8");
    check_nesting(&svg);
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("</svg>").count(), 1);
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert_eq!(
        svg.matches(r#"<rect class="span compute""#).count(),
        compute
    );
    assert_eq!(svg.matches(r#"<rect class="span other""#).count(), other);
    let legend = svg.matches(r#"<rect class="legend""#).count();
    assert_eq!(legend, 4, "F, B, ALLREDUCE, STEP");
    assert_eq!(svg.matches("<rect").count(), compute + other + legend + 1);
    assert_eq!(svg.matches("<title>").count(), 1 + spans.len());
    for rank in 0..4 {
        assert!(svg.contains(&format!(">rank {rank} (stage {rank})</text>")));
    }
    assert!(svg.contains(&format!("bubble fraction {:.3}", t.bubble_fraction())));
    assert!(svg.contains(&format!("makespan {:.2}", t.makespan())));
    for (rank, idle) in t.idle().iter().enumerate() {
        assert!(
            svg.contains(&format!("rank {rank} {idle:.2}")),
            "idle of rank {rank}"
        );
    }
    // Spans 1 unit wide on an 840 px axis of about 12 units are wide enough for a label.
    assert_eq!(svg.matches(r#"<text class="mb""#).count(), compute);
}

#[test]
fn svg_prints_the_closed_form_bubble() {
    let t = one_f_one_b_timeline(false);
    // (p - 1) / (m + p - 1) = 3 / 11.
    assert!((t.bubble_fraction() - 3.0 / 11.0).abs() < 1e-12);
    let svg = timeline_svg(&t, "1F1B");
    assert!(svg.contains("bubble fraction 0.273"));
    assert!(!svg.contains(r#"class="span other""#));
}

#[test]
fn svg_is_deterministic() {
    let t = one_f_one_b_timeline(true);
    let again: Timeline = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
    let a = timeline_svg(&t, "run");
    assert_eq!(a.as_bytes(), timeline_svg(&again, "run").as_bytes());
    assert_eq!(a.as_bytes(), timeline_svg(&t, "run").as_bytes());
    assert_ne!(a, timeline_svg(&t, "other run"));
    // Kept for looking at: target/tmp/telemetry/1f1b.svg.
    std::fs::write(tmp("1f1b.svg"), &a).unwrap();
}

#[test]
fn svg_draws_a_traced_run_with_its_transfers() {
    let ms: u64 = 1_000_000;
    let ev = |action, start: u64, end: u64| TraceEvent {
        action,
        start_ns: start * ms,
        end_ns: end * ms,
    };
    let trace = Trace {
        ranks: vec![
            vec![
                ev(Action::forward(0, 0), 10, 12),
                ev(Action::send_act(0, 0), 12, 13),
                ev(Action::recv_grad(0, 0), 13, 17),
                ev(Action::backward(0, 0), 17, 21),
            ],
            vec![
                ev(Action::recv_act(1, 0), 12, 13),
                ev(Action::forward(1, 0), 13, 15),
                ev(Action::backward(1, 0), 15, 16),
                ev(Action::send_grad(1, 0), 16, 17),
            ],
        ],
    };
    let t = trace.to_timeline(2).unwrap();
    let svg = timeline_svg(&t, "traced");
    check_nesting(&svg);
    assert_eq!(svg.matches(r#"<rect class="span compute""#).count(), 4);
    assert_eq!(svg.matches(r#"<rect class="span other""#).count(), 4);
    assert!(svg.contains(">send/recv</text>"));
    // An 11 ms step is shown in seconds to about four significant digits.
    assert!(svg.contains("makespan 0.01100"), "{svg}");
    assert!(svg.contains(&format!("bubble fraction {:.3}", t.bubble_fraction())));
}

#[test]
fn metrics_lines_round_trip_and_are_flushed_as_written() {
    let path = tmp("metrics.jsonl");
    let rows = [
        StepMetrics {
            step: 1,
            loss: 6.25,
            lr: 1e-3,
            samples_per_s: 512.0,
            elapsed_s: 0.5,
            ..StepMetrics::default()
        },
        StepMetrics {
            step: 2,
            loss: 5.9123,
            lr: 9.5e-4,
            samples_per_s: 530.25,
            tokens_per_s: Some(67_872.0),
            elapsed_s: 0.98,
            step_s: Some(0.48),
            grad_norm: Some(1.75),
            bubble_fraction: Some(3.0 / 11.0),
            eval_loss: Some(5.875),
            eval_accuracy: Some(0.25),
            clip_coef: Some(0.5),
            loss_scale: Some(65536.0),
            skipped: true,
            samples: Some(128),
            event: Some("elastic: 3 of 4 nodes are left".into()),
            peak_memory_gb: Some(0.25),
        },
    ];
    let mut w = MetricsWriter::create(&path).unwrap();
    assert_eq!(w.path(), path);
    for (n, row) in rows.iter().enumerate() {
        w.write(row).unwrap();
        // Read while the writer is still open, as `tail -f` would.
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), n + 1);
        assert!(text.ends_with('\n'));
        let back: StepMetrics = serde_json::from_str(lines[n]).unwrap();
        assert_eq!(&back, row);
        let value: serde_json::Value = serde_json::from_str(lines[n]).unwrap();
        assert!(value.is_object());
    }
    drop(w);

    // A resumed run appends; a diverged loss survives as NaN.
    let mut w = MetricsWriter::append(&path).unwrap();
    w.write(&StepMetrics {
        step: 3,
        loss: f64::NAN,
        ..StepMetrics::default()
    })
    .unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let back: Vec<StepMetrics> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(back.len(), 3);
    assert_eq!(back[..2], rows[..]);
    assert_eq!(back[2].step, 3);
    assert!(back[2].loss.is_nan());

    // Creating again starts over.
    MetricsWriter::create(&path).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
}

#[test]
fn metrics_file_that_cannot_be_created_names_its_path() {
    let blocker = tmp("not_a_dir");
    std::fs::write(&blocker, b"").unwrap();
    let path = blocker.join("metrics.jsonl");
    match MetricsWriter::create(&path) {
        Err(Error::Io { path: p, .. }) => assert!(p.starts_with(&blocker), "{}", p.display()),
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

#[test]
fn progress_in_a_log_writes_plain_lines_every_few_steps() {
    let mut p = Progress::new(200, Vec::new(), false);
    for step in 1..=200 {
        p.update(step, 6.0 - step as f64 / 100.0, 64.1).unwrap();
    }
    let out = String::from_utf8(p.finish("trained 200 steps in 3.1s").unwrap()).unwrap();
    assert!(!out.contains('\r'));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 21, "every 10th step, then the summary");
    assert_eq!(lines[0], render(10, 200, 5.9, 64.1));
    assert_eq!(
        lines[11],
        "[############........] 120/200  loss 4.8000  64.1 steps/s  ETA 1.2s"
    );
    assert_eq!(lines[19], render(200, 200, 4.0, 64.1));
    assert_eq!(lines[20], "trained 200 steps in 3.1s");

    // A custom interval, and the last step always shows.
    let mut p = Progress::new(7, Vec::new(), false).every(3);
    for step in 1..=7 {
        p.update(step, 1.0, 2.0).unwrap();
    }
    let out = String::from_utf8(p.finish("done").unwrap()).unwrap();
    let shown: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap_or(l))
        .collect();
    assert_eq!(shown, ["3/7", "6/7", "7/7", "done"]);
}
