//! Embedding: a run started from a service with its own data, its events, a checkpoint
//! on request, a stop and a cancel; two runs at once in one process; the seeds' APIs
//! (`TrainingRunner`, the on-device `Module` + `Optimizer` loop) against `pipetrain
//! train`.

use crate::common;

use std::path::Path;

use crate::common::mlp::Mlp;
use pipetrain::api::{
    CheckpointState, Module, Optimizer, RunEvent, Trainer, TrainingParameters, TrainingRunner,
};
use pipetrain::config::TrainConfig;
use pipetrain::data::{BatchSource, Batches};
use pipetrain::tensor::{Tensor, TensorMap};

const SGD_STEPS: usize = 6;

/// The peers' MLP, one stage, batch 64, plain SGD (what the seeds' loop runs).
fn single_stage(steps: usize) -> Mlp {
    Mlp {
        pp: 1,
        accum: 1,
        steps,
        threads: 2,
        optimizer: "[optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.05\n",
        ..Mlp::default()
    }
}

/// The file's batches, as a service would hand them in.
struct FromFile(Batches);

impl BatchSource for FromFile {
    fn batch(&self, step: u64) -> Result<TensorMap, pipetrain_actors::BoxError> {
        Ok(self.0.batch(step as usize)?)
    }
}

fn batches(cfg: &TrainConfig) -> Batches {
    Batches::open(&cfg.data, cfg.global_batch(), Path::new("embed.toml")).unwrap()
}

fn bits(p: &[(String, Tensor)]) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = p
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect();
    v.sort();
    v
}

fn file_run(cfg: &TrainConfig, path: &Path) -> Vec<(String, Vec<u32>)> {
    let rt = common::runtime();
    bits(
        &pipetrain::train::train(&rt, cfg, path, false, |_| {})
            .unwrap()
            .parameters,
    )
}

/// Data that never touches a file: the service sends each step's batch through a
/// channel; the weights are those of the same run reading the file. Events come in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_feeds_batches_through_a_channel() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, path) = single_stage(SGD_STEPS).config(tmp.path());
    let want = tokio::task::block_in_place(|| file_run(&cfg, &path));
    let rt = common::runtime();
    let (trainer, tx) = Trainer::new(cfg.clone()).with_data_channel(2);
    let handle = trainer.start(&rt).unwrap();
    let source = batches(&cfg);
    let feeder = tokio::spawn(async move {
        for s in 0..SGD_STEPS {
            tx.send(source.batch(s).unwrap()).await.unwrap();
        }
    });
    let events = handle.events().clone();
    let summary = handle.wait().await.unwrap();
    feeder.await.unwrap();
    assert_eq!(bits(&summary.parameters), want);
    let seen: Vec<RunEvent> = events.drain().collect();
    assert!(matches!(
        seen[0],
        RunEvent::Started {
            first_step: 0,
            total_steps: 6,
            ..
        }
    ));
    let steps: Vec<u64> = seen
        .iter()
        .filter_map(|e| match e {
            RunEvent::Step(r) => Some(r.step),
            _ => None,
        })
        .collect();
    assert_eq!(steps, (0..6).collect::<Vec<_>>());
    assert!(matches!(seen.last(), Some(RunEvent::Finished(s)) if s.steps == 6));
}

/// Two runs in one process at once, each with its own events and result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_at_once_keep_to_themselves() {
    let rt = common::runtime();
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a_cfg, a_path) = single_stage(4).config(a_dir.path());
    let mut b_mlp = single_stage(3);
    b_mlp.optimizer =
        "[optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3\n";
    let (b_cfg, b_path) = b_mlp.config(b_dir.path());
    let (a_want, b_want) =
        tokio::task::block_in_place(|| (file_run(&a_cfg, &a_path), file_run(&b_cfg, &b_path)));
    let a = Trainer::from_file(&a_path).unwrap().start(&rt).unwrap();
    let b = Trainer::from_file(&b_path).unwrap().start(&rt).unwrap();
    let (a_events, b_events) = (a.events().clone(), b.events().clone());
    let (a_sum, b_sum) = tokio::join!(a.wait(), b.wait());
    assert_eq!(bits(&a_sum.unwrap().parameters), a_want);
    assert_eq!(bits(&b_sum.unwrap().parameters), b_want);
    let count = |rx: &pipetrain::api::Events| {
        rx.drain()
            .filter(|e| matches!(e, RunEvent::Step(_)))
            .count()
    };
    assert_eq!((count(&a_events), count(&b_events)), (4, 3));
}

/// A checkpoint on request, then a stop: the step under way finishes, a last checkpoint
/// is saved, the summary comes back; the checkpoints are complete and resumable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_now_then_stop() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let mlp = Mlp {
        extra: format!("checkpoints_dir = \"{}\"\n", ck.display()),
        ..single_stage(100_000)
    };
    let (cfg, _) = mlp.config(tmp.path());
    let handle = Trainer::new(cfg).start(&rt).unwrap();
    let events = handle.events().clone();
    // Wait for the first steps, then ask.
    while !matches!(events.recv().await.unwrap(), RunEvent::Step(r) if r.step >= 2) {}
    let saved = handle.checkpoint_now().await.unwrap();
    assert!(saved.steps_done >= 3, "{saved:?}");
    let summary = handle.stop().await.unwrap();
    assert!(summary.steps < 100_000);
    let (latest, m) = pipetrain::checkpoint::latest_complete(&ck)
        .unwrap()
        .unwrap();
    assert_eq!(
        m.steps_done, summary.steps as u64,
        "the stop's checkpoint is the last step"
    );
    pipetrain::checkpoint::LoadedCheckpoint::open(&latest).unwrap();
    let rest: Vec<RunEvent> = events.drain().collect();
    assert!(rest
        .iter()
        .any(|e| matches!(e, RunEvent::CheckpointSaved(c) if c.steps_done == m.steps_done)));
    assert!(matches!(rest.last(), Some(RunEvent::Finished(_))));
}

/// Cancel stops at once: once it returns nothing more is written, the checkpoint it was
/// writing is gone, and what is on disk is only complete checkpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_at_once() {
    let rt = common::runtime();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let mlp = Mlp {
        extra: format!(
            "checkpoints_dir = \"{}\"\ncheckpoint_period = 1\n",
            ck.display()
        ),
        ..single_stage(100_000)
    };
    let (cfg, _) = mlp.config(tmp.path());
    let handle = Trainer::new(cfg).start(&rt).unwrap();
    let events = handle.events().clone();
    while !matches!(events.recv().await.unwrap(), RunEvent::Step(r) if r.step >= 3) {}
    handle.cancel().await;
    // Nothing is written once cancel has returned.
    let files = || {
        let mut all: Vec<(std::path::PathBuf, u64)> = walk(&ck);
        all.sort();
        all
    };
    let at_return = files();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(files(), at_return, "files changed after cancel returned");
    // Everything left on the event stream ends with the cancellation.
    let mut last = None;
    while let Some(e) = events.try_recv() {
        last = Some(e);
    }
    assert!(matches!(last, Some(RunEvent::Cancelled)), "{last:?}");
    assert!(events.is_finished());
    let unfinished = std::fs::read_dir(&ck)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp-")
        })
        .count();
    assert_eq!(
        unfinished, 0,
        "cancel removes the checkpoint it was writing"
    );
    for l in pipetrain::checkpoint::list(&ck).unwrap() {
        if let Ok(m) = l.manifest {
            pipetrain::checkpoint::LoadedCheckpoint::open(&l.path).unwrap();
            assert!(m.steps_done < 100_000);
        }
    }
}

/// Every file under `dir` with its size.
fn walk(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let meta = e.metadata().unwrap();
        if meta.is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push((e.path(), meta.len()));
        }
    }
    out
}

/// Seed 002's loop (`train_step`, `Optimizer::step`, `lazy_reset_grad`) gives bitwise the
/// weights of `pipetrain train` on the same model, data and optimizer; `eval_step`
/// computes the loss without changing anything; the state saves and loads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_and_optimizer_loop_equals_pipetrain_train() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, path) = single_stage(SGD_STEPS).config(tmp.path());
    let want = tokio::task::block_in_place(|| file_run(&cfg, &path));
    let rt = common::runtime();
    let data = batches(&cfg);
    let mut module = Module::new(
        &rt,
        &cfg.model_path,
        cfg.loss.clone(),
        &data.batch(0).unwrap(),
        CheckpointState::from_init(cfg.init_path.as_deref()).unwrap(),
    )
    .unwrap();
    let mut optimizer = Optimizer::new(cfg.optimizer.clone(), 0.05, &mut module).unwrap();
    module.train();
    for s in 0..SGD_STEPS {
        module.train_step(&data.batch(s).unwrap()).await.unwrap();
        optimizer.step(&mut module).await.unwrap();
        module.lazy_reset_grad();
    }
    assert_eq!(bits(&module.parameters()), want);
    module.eval();
    let before = bits(&module.parameters());
    let loss = module.eval_step(&data.batch(0).unwrap()).await.unwrap();
    assert!(loss.is_finite());
    assert_eq!(bits(&module.parameters()), before, "eval changes nothing");
    let saved = tmp.path().join("state");
    CheckpointState::save(&module, &optimizer, &saved).unwrap();
    let mut again = Module::new(
        &rt,
        &cfg.model_path,
        cfg.loss.clone(),
        &data.batch(0).unwrap(),
        CheckpointState::load(&saved).unwrap(),
    )
    .unwrap();
    Optimizer::new(cfg.optimizer.clone(), 0.05, &mut again).unwrap();
    assert_eq!(bits(&again.parameters()), before);
    let exported = tmp.path().join("inference.onnx");
    module.export_model_for_inferencing(&exported).unwrap();
    pipetrain::onnx::load_model(&exported).unwrap();
}

/// Seed 000's runner: loaders in, the run of the same configuration out.
#[test]
fn training_runner_runs_on_loaders() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, path) = single_stage(SGD_STEPS).config(tmp.path());
    let mut want_cfg = cfg.clone();
    want_cfg.init_path = None;
    let want = file_run(&want_cfg, &path);
    let mut params = TrainingParameters::new(&cfg.model_path, cfg.loss.clone(), 64, SGD_STEPS);
    params.learning_rate = 0.05;
    let mut runner = TrainingRunner::new(params).unwrap();
    let summary = runner.run(FromFile(batches(&cfg)), None).unwrap();
    assert_eq!(summary.steps, SGD_STEPS);
    assert_eq!(bits(&summary.parameters), want);
}
