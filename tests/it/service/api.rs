//! The embedding API's promises, in this test process: events, error kinds, the seeds'
//! steps, a cancel while starting.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{gpt2, pipeline, Served};
use crate::common;
use crate::common::mlp::Mlp;
use pipetrain::api::{
    CheckpointState, Module, Optimizer, RunEvent, Trainer, TrainingParameters, TrainingRunner,
};
use pipetrain::data::Batches;
use pipetrain::{Error, ErrorKind};

/// A run whose events are read only after it ended still delivers its end, after the
/// count of the step events it dropped.
#[tokio::test(flavor = "current_thread")]
async fn events_read_late_still_end_with_the_run_end() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let handle = Trainer::new(pipeline(tmp.path(), 40))
        .event_backlog(8)
        .start(&rt)
        .unwrap();
    let events = handle.events().clone();
    let summary = handle.wait().await.unwrap();
    let seen: Vec<RunEvent> = events.drain().collect();
    let steps = seen
        .iter()
        .filter(|e| matches!(e, RunEvent::Step(_)))
        .count();
    assert!(matches!(seen[0], RunEvent::Started { .. }), "{seen:?}");
    let n = seen.len();
    assert!(
        matches!(seen[n - 2], RunEvent::Dropped { events } if events as usize + steps == 40),
        "{:?}",
        &seen[n - 2..]
    );
    assert!(matches!(&seen[n - 1], RunEvent::Finished(s) if s.steps == summary.steps));
    assert!(events.is_finished() && events.recv().await.is_none());
}

/// Each bad input fails with its kind, the same every time; a panicking source's message
/// is the error's, and the source is asked for that step once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_fail_with_their_kind() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = pipeline(tmp.path(), 6);
    // The configuration: a rule broken by an edit, named in the file's terms.
    let path = tmp.path().join("mlp.toml");
    std::fs::write(&path, Mlp::default().toml()).unwrap();
    let e = Trainer::from_file(&path)
        .unwrap()
        .with(|c| c.gradient_accumulation_steps = 0)
        .start(&rt)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("mlp.toml"), "{e}");
    // The model: not ONNX.
    let junk = tmp.path().join("junk.onnx");
    std::fs::write(&junk, b"not a model").unwrap();
    let mut bad_model = cfg.clone();
    bad_model.model_path = junk;
    let e = run_error(&rt, Trainer::new(bad_model)).await;
    assert_eq!(e.kind(), ErrorKind::Model, "{e}");
    // A checkpoint to resume that is not one.
    let mut bad_ckpt = cfg.clone();
    bad_ckpt.checkpoint_to_load_path = Some(tmp.path().to_path_buf());
    let e = Trainer::new(bad_ckpt).start(&rt).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Checkpoint, "{e}");
    // The service's data: an error, and a panic.
    for panic in [false, true] {
        let source = Served::new(&cfg, 2, panic);
        let calls = source.calls_at_fail.clone();
        let e = run_error(&rt, Trainer::new(cfg.clone()).with_data(source)).await;
        assert_eq!(e.kind(), ErrorKind::Data, "{e}");
        let said = if panic {
            "panicked: the service's store lost step 2"
        } else {
            "has no step 2"
        };
        assert!(e.to_string().contains(said), "{e}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "calls for the failing step: {e}"
        );
    }
    // A data channel the service closes early.
    let (run, tx) = Trainer::new(cfg.clone()).with_data_channel(2);
    let handle = run.start(&rt).unwrap();
    drop(tx);
    let e = handle.wait().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Data, "{e}");
    assert!(e.to_string().contains("closed before step 0"), "{e}");
    // Cancelled.
    assert_eq!(Error::Cancelled.kind(), ErrorKind::Cancelled);
}

/// The run's error, from `wait` and from its `Failed` event alike.
async fn run_error(rt: &pipetrain::compute::Runtime, run: Trainer) -> Error {
    let handle = run.start(rt).unwrap();
    let events = handle.events().clone();
    let e = handle.wait().await.unwrap_err();
    let last = events.drain().last();
    match last {
        Some(RunEvent::Failed(f)) => assert_eq!(f.to_string(), e.to_string()),
        other => panic!("last event {other:?}"),
    }
    e
}

/// `TrainingRunner::run` works from inside a runtime; the seeds' async steps let other
/// tasks run meanwhile (on a current-thread runtime) and give the blocking steps' bits.
#[tokio::test(flavor = "current_thread")]
async fn the_seeds_work_inside_a_runtime_and_yield() {
    let tmp = tempfile::tempdir().unwrap();
    let mlp = Mlp {
        pp: 1,
        accum: 1,
        steps: 6,
        optimizer: "[optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.05\n",
        ..Mlp::default()
    };
    let (cfg, _) = mlp.config(tmp.path());
    let rt = common::runtime();
    let data = Batches::open(&cfg.data, 64, Path::new("service.toml")).unwrap();
    let module = || {
        Module::new(
            &rt,
            &cfg.model_path,
            cfg.loss.clone(),
            &data.batch(0).unwrap(),
            CheckpointState::from_init(cfg.init_path.as_deref()).unwrap(),
        )
        .unwrap()
    };
    let (mut a, mut b) = (module(), module());
    let mut opt_a = Optimizer::new(cfg.optimizer.clone(), 0.05, &mut a).unwrap();
    let mut opt_b = Optimizer::new(cfg.optimizer.clone(), 0.05, &mut b).unwrap();
    let ticks = Arc::new(AtomicUsize::new(0));
    let t = ticks.clone();
    let ticker = tokio::spawn(async move {
        loop {
            t.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    });
    for s in 0..6 {
        let batch = data.batch(s).unwrap();
        a.train_step(&batch).await.unwrap();
        opt_a.step(&mut a).await.unwrap();
        a.lazy_reset_grad();
        b.train_step_blocking(&batch).unwrap();
        opt_b.step_blocking(&mut b).unwrap();
        b.lazy_reset_grad();
    }
    ticker.abort();
    assert!(
        ticks.load(Ordering::Relaxed) >= 12,
        "the other task ran {ticks:?} times"
    );
    let bits = |m: &Module| {
        m.parameters()
            .into_iter()
            .map(|(n, t)| (n, t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect()))
            .collect::<Vec<(String, Vec<u32>)>>()
    };
    assert_eq!(bits(&a), bits(&b));
    // The seed's runner, called from async code.
    let mut params = TrainingParameters::new(&cfg.model_path, cfg.loss.clone(), 64, 2);
    params.learning_rate = 0.05;
    let mut runner = TrainingRunner::new(params).unwrap();
    let summary = runner
        .run(Served::new(&cfg, u64::MAX, false), None)
        .unwrap();
    assert_eq!(summary.steps, 2);
}

/// A cancel while the run is starting ends it between the phases of its start: training
/// never begins, and the end is `Cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_starting_ends_the_run_before_training() {
    let rt = common::runtime();
    let handle = gpt2().start(&rt).unwrap();
    let events = handle.events().clone();
    handle.cancel().await;
    let seen: Vec<RunEvent> = events.drain().collect();
    assert!(
        !seen.iter().any(|e| matches!(e, RunEvent::Started { .. })),
        "{seen:?}"
    );
    assert!(matches!(seen.last(), Some(RunEvent::Cancelled)), "{seen:?}");
}
