//! The CPU's large float32 products on OpenBLAS (`compute/blas`): a run with them
//! trains as ONNX Runtime's own products train (`PIPETRAIN_BLAS=off`), and a library
//! that does not load is refused by name.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pipetrain(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pipetrain"));
    cmd.args(args).env("RUST_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

fn dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("blas");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An MLP whose products reach OpenBLAS's sizes (1024 rows, 1024 wide: 2^30
/// multiply-adds in the forward's middle product), SGD, 4 steps.
fn config(dir: &Path) -> PathBuf {
    let path = dir.join("mlp.toml");
    let text = "batch_size = 1024\nnum_train_steps = 4\n\
        [model]\nkind = \"mlp\"\nhidden = [1024, 1024]\n\
        [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
        [data]\nsynth = { kind = \"teacher\", samples = 4096, seed = 3 }\n\
        layout = { kind = \"arrays\", feeds = { x = \"x\", y = \"y\" } }\n\
        [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.05\n";
    std::fs::write(&path, text).unwrap();
    path
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

/// The BLAS beside this checkout's ONNX Runtime (`scripts/setup.sh`), as `PIPETRAIN_BLAS`
/// names one: what `doctor` says it uses, or the OpenBLAS it declined where its kernels
/// leave the CPU's AVX-512 unused (`compute/blas/core.rs`).
fn venv_blas() -> Option<String> {
    let said = text(&pipetrain(&["doctor"], &[]));
    let line = said.lines().find(|l| l.starts_with("blas:"))?;
    let path = line.split_whitespace().find(|w| w.starts_with('/'))?;
    Some(path.to_string())
}

/// Whether this CPU has AVX-512 (Linux's flags).
fn cpu_has_avx512() -> bool {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "avx512f"))
}

#[test]
fn products_on_openblas_train_as_onnx_runtimes_do() {
    let Some(lib) = venv_blas() else {
        eprintln!("skipped: no scipy-openblas32 beside ONNX Runtime (scripts/setup.sh)");
        return;
    };
    let dir = dir();
    let cfg = config(&dir);
    let run = |name: &str, env: &[(&str, &str)]| {
        let metrics = dir.join(format!("{name}.jsonl"));
        let _ = std::fs::remove_file(&metrics);
        let args = [
            "train",
            cfg.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ];
        let out = pipetrain(&args, env);
        assert!(out.status.success(), "{}", text(&out));
        (text(&out), losses(&metrics))
    };
    let (log, blas) = run("blas", &[("PIPETRAIN_BLAS", &lib)]);
    let (plain_log, plain) = run("mlas", &[("PIPETRAIN_BLAS", "off")]);
    // The middle layer's product, its input gradient and the two large weight
    // gradients are OpenBLAS's (4 products; the rest are under its sizes); MKL, which
    // beats ONNX Runtime's products from half that size, also takes the first layer's.
    let mkl = lib.contains("libmkl_rt");
    let expected = match mkl {
        true => "5 float32 products by MKL",
        false => "4 float32 products by OpenBLAS",
    };
    assert!(log.contains(expected), "{log}");
    assert!(!plain_log.contains("float32 products by"), "{plain_log}");
    assert_eq!(blas.len(), 4);
    assert_eq!(plain.len(), 4);
    // Two summation orders of the same float32 sums: apart by rounding only, and
    // training (the loss falls) either way.
    for (a, b) in blas.iter().zip(&plain) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{blas:?} against {plain:?}"
        );
    }
    assert!(blas[3] < blas[0], "{blas:?}");
}

#[test]
fn a_library_that_does_not_load_is_refused_by_name() {
    let cfg = config(&dir());
    let missing = dir().join("no_such_libopenblas.so");
    let out = pipetrain(
        &["train", cfg.to_str().unwrap()],
        &[("PIPETRAIN_BLAS", missing.to_str().unwrap())],
    );
    assert!(!out.status.success());
    let log = text(&out);
    assert!(
        log.contains("PIPETRAIN_BLAS") && log.contains("no_such_libopenblas.so"),
        "{log}"
    );
}

/// An OpenBLAS running kernels that leave the CPU's AVX-512 unused (Haswell's, as
/// `OPENBLAS_CORETYPE=Haswell` asks) is declined with why, ONNX Runtime's products being
/// faster; its AVX-512 kernels (Skylake-X's) are used. On a CPU without AVX-512, Haswell's
/// kernels are used.
#[test]
fn openblas_kernels_that_idle_avx512_are_declined_saying_why() {
    let Some(lib) = venv_blas().filter(|l| l.contains("openblas")) else {
        eprintln!("skipped: no scipy-openblas32 beside ONNX Runtime (scripts/setup.sh)");
        return;
    };
    let doctor = |core: &str| {
        let said = text(&pipetrain(&["doctor"], &[("OPENBLAS_CORETYPE", core)]));
        said.lines()
            .find(|l| l.starts_with("blas:"))
            .unwrap_or_default()
            .to_string()
    };
    let haswell = doctor("Haswell");
    match cpu_has_avx512() {
        true => {
            assert!(haswell.starts_with("blas:      none: "), "{haswell}");
            assert!(
                haswell.contains("Haswell kernels") && haswell.contains("AVX-512"),
                "{haswell}"
            );
            let skylake = doctor("SkylakeX");
            assert!(
                skylake.contains(&format!("{lib} (OpenBLAS, SkylakeX kernels")),
                "{skylake}"
            );
        }
        false => assert!(
            haswell.contains(&format!("{lib} (OpenBLAS, Haswell kernels")),
            "{haswell}"
        ),
    }
}
