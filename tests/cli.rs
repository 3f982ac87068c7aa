//! The `pipetrain` binary, run as a user runs it.

mod common;

use std::process::Command;

fn pipetrain(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn doctor_reports_the_library_and_cpu_provider() {
    let out = pipetrain(&["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("libonnxruntime.so") && text.contains("version:   1.31.1"),
        "{text}"
    );
    assert!(text.contains("CPUExecutionProvider"), "{text}");
}

#[test]
fn train_runs_the_mlp_example_in_two_stages_and_exports() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/mlp_sgd.toml"
    ))
    .unwrap();
    let peers = common::peers_dir().join("data");
    let out_model = dir.join("mlp.onnx");
    let _ = std::fs::remove_file(&out_model);
    let cfg = example
        .replace("../../shared/peers/data", peers.to_str().unwrap())
        .replace("../runs/mlp_sgd/model.onnx", out_model.to_str().unwrap())
        .replace("num_train_steps = 200", "num_train_steps = 30")
        + "\n[pipeline]\npartition = { balanced = { stages = 2, by = \"params\" } }\n";
    let path = dir.join("mlp.toml");
    std::fs::write(&path, cfg).unwrap();
    let out = pipetrain(&["train", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Step 0 is the loss of the initial weights, as in the peers' curves.
    assert!(text.contains("step      0/30  loss 2.298364"), "{text}");
    assert!(text.contains("done: 30 steps on 2 stage(s)"), "{text}");
    assert!(pipetrain::onnx::load_model(&out_model).is_ok());
}

#[test]
fn a_bad_config_names_file_and_field() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/mlp_sgd.toml"
    ))
    .unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(
        &path,
        example.replace(
            "batch_order = \"batch_idx\"",
            "batch_order = \"batch_idx\"\nshuffle = true",
        ),
    )
    .unwrap();
    let out = pipetrain(&["train", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("bad.toml") && err.contains("shuffle"), "{err}");
}
