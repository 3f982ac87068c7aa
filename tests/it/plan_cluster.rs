//! `pipetrain plan --manifest`: a plan over a cluster manifest trains on its nodes.

use std::process::Command;

use crate::common;
use pipetrain::config::TrainConfig;

use super::plan::config_in;

/// Over a cluster manifest of two nodes on this machine's loopback: the plan weighs the
/// link between them (measured, and calibrated against a launched job), measures its
/// best layout as a launched job, writes the configuration with the manifest beside it
/// holding the chosen layout, and the two nodes launched with those files train.
#[test]
fn a_plan_over_a_manifest_is_written_with_its_manifest_and_the_nodes_train_it() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, config) = config_in("plan-manifest");
    let secret = dir.join("job.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let rendezvous = common::launch::free_port();
    let port = std::iter::repeat_with(common::launch::free_port)
        .find(|&p| p.abs_diff(rendezvous) > 1)
        .unwrap();
    let manifest = dir.join("cluster.toml");
    std::fs::write(
        &manifest,
        format!(
            "[job]\nname = \"plan\"\nrendezvous = \"127.0.0.1:{rendezvous}\"\n\
             secret_file = \"job.secret\"\n[layout]\ndata_parallel = 2\npipeline_parallel = 1\n\
             [[nodes]]\nname = \"a\"\naddress = \"127.0.0.1\"\nport = {port}\ncpu_slots = 1\n\
             [[nodes]]\nname = \"b\"\naddress = \"127.0.0.2\"\nport = {port}\ncpu_slots = 1\n"
        ),
    )
    .unwrap();
    let best = dir.join("out").join("best.toml");
    std::fs::create_dir_all(best.parent().unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pipetrain"))
        .args(["plan", "--max-micro-batches", "2", "--profile-steps", "3"])
        .args(["--measure", "1", "--measure-steps", "4", "--manifest"])
        .arg(&manifest)
        .arg(&config)
        .arg("--out")
        .arg(&best)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("cluster: 2 nodes of 1 + 1 slots on this machine"),
        "{stdout}"
    );
    // Tensor shards split over the two nodes are not searched.
    assert!(
        stdout.contains("layouts whose tensor shards would span nodes"),
        "{stdout}"
    );
    let measured: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("measured"))
        .collect();
    assert!(
        measured[0].contains("`pipetrain launch` process"),
        "{stdout}"
    );
    assert!(measured.iter().any(|l| l.starts_with("1 ")), "{stdout}");
    assert!(!stdout.contains("failed"), "{stdout}");
    // The manifest beside the configuration holds its layout, and the sessions' threads
    // are set (each process would take every core).
    let cfg = TrainConfig::load(&best).unwrap();
    let written =
        pipetrain::cluster::ClusterManifest::load(&dir.join("out").join("best.cluster.toml"))
            .unwrap();
    let layout = written.layout();
    assert_eq!(
        (
            layout.data_parallel,
            layout.pipeline_parallel,
            layout.tensor_parallel
        ),
        (
            cfg.data_parallel_size,
            cfg.pipeline_parallel_size,
            cfg.horizontal_parallel_size
        )
    );
    assert!(cfg.runtime.intra_op_threads.is_some());
    // Its nodes launched with the written files train.
    let nodes: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| {
            Command::new(env!("CARGO_BIN_EXE_pipetrain"))
                .args(["launch", "--manifest"])
                .arg(written.path())
                .args(["--node", n])
                .arg(&best)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (n, node) in ["a", "b"].iter().zip(nodes) {
        let run = node.wait_with_output().unwrap();
        assert!(
            run.status.success(),
            "node {n}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
}
