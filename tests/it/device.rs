//! `[runtime] device`: a bad name is refused naming the setting; asking for a GPU the
//! machine does not have fails with a clear error
//! naming the setting, not a panic and not a silent CPU run.

use std::process::Command;

use crate::common;

fn config(dir: &std::path::Path, device: &str) -> std::path::PathBuf {
    let text = format!(
        r#"
batch_size = 8
num_train_steps = 2
[model]
kind = "mlp"
hidden = [8]
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
synth = {{ kind = "teacher", samples = 64, seed = 1 }}
layout = {{ kind = "arrays", feeds = {{ x = "x", y = "y" }} }}
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 0.1
[runtime]
device = "{device}"
"#
    );
    let path = dir.join("train.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_device_that_is_not_one_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["tpu", "cuda:x", "cuda:-1"] {
        let err = pipetrain::config::TrainConfig::load(&config(dir.path(), bad))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.toml") && err.contains("runtime.device"),
            "{err}"
        );
    }
    let ok = pipetrain::config::TrainConfig::load(&config(dir.path(), "cuda:1")).unwrap();
    assert_eq!(ok.runtime.device, pipetrain::compute::Device::Cuda(1));
}

#[test]
fn asking_for_a_gpu_that_is_not_there_fails_clearly_and_trains_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // No machine of ours has ten GPUs: this device is missing with or without a driver.
    let cfg = config(dir.path(), "cuda:9");
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .arg("train")
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("runtime.device") && err.contains("train.toml"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    match pipetrain::compute::cuda_devices() {
        // The CI machines: no driver.
        Err(why) => assert!(err.contains(&why), "{err}"),
        // A GPU machine: the driver answers, without a tenth device.
        Ok(found) => assert!(
            err.contains(&format!("has {} device(s)", found.names.len())),
            "{err}"
        ),
    }
}

/// A session asked to compute on a GPU that this build or machine cannot give fails with
/// an error saying why (how to get the CUDA path; no driver), never a CPU session.
#[test]
fn a_session_on_a_gpu_says_what_is_missing() {
    use pipetrain::compute::{Device, GraphSession, SessionOptions};
    let rt = common::runtime();
    let model =
        pipetrain::models::build(&pipetrain::models::ModelSpec::Mlp(Default::default())).unwrap();
    let graph = pipetrain::graph::Graph::from_model(&model).unwrap();
    let opts = SessionOptions {
        device: Device::Cuda(0),
        ..SessionOptions::default()
    };
    let made = GraphSession::new(&rt, &graph, &opts, "on a GPU");
    match (cfg!(feature = "cuda"), pipetrain::compute::cuda_devices()) {
        (false, _) => {
            let err = made.unwrap_err().to_string();
            assert!(
                err.contains("cuda:0") && err.contains("--features cuda"),
                "{err}"
            );
        }
        (true, Err(why)) => {
            let err = made.unwrap_err().to_string();
            assert!(err.contains("cuda:0") && err.contains(&why), "{err}");
        }
        (true, Ok(_)) => eprintln!("a GPU is here: scripts/gpu-check.sh checks the session on it"),
    }
}
