//! The Slurm batch script and the Kubernetes Job in `examples/`: the script, run with
//! stand-ins for `scontrol` and `srun`, writes a manifest that parses and in which each
//! task finds its node; the Job's manifest parses, and each completion index finds its
//! node; both name the variables the code reads.

use std::path::Path;

use pipetrain::cluster::{select_node, ClusterManifest, NodeSource};

use super::repo;

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap()
}

fn mentions(text: &str, what: &str, words: &[&str]) {
    for w in words {
        assert!(text.contains(w), "{what} does not mention `{w}`");
    }
}

#[cfg(unix)]
#[test]
fn the_sbatch_script_writes_a_manifest_each_task_finds_its_node_in() {
    use std::os::unix::fs::PermissionsExt;
    let script = read("examples/slurm.sbatch");
    mentions(
        &script,
        "slurm.sbatch",
        &[
            "#SBATCH --nodes=4",
            "#SBATCH --ntasks-per-node=1",
            "srun",
            "pipetrain launch --manifest",
            "SLURM_JOB_NODELIST",
            "SLURM_JOB_ID",
            "SLURM_SUBMIT_DIR",
            "SLURMD_NODENAME",
            "SLURM_NODEID",
            "SLURM_NTASKS",
            "secret_file",
            "#SBATCH --signal=TERM@120",
            "#SBATCH --requeue",
            "scontrol requeue",
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let (bin, job, out) = (
        tmp.path().join("bin"),
        tmp.path().join("job"),
        tmp.path().join("out"),
    );
    for d in [&bin, &job, &out] {
        std::fs::create_dir(d).unwrap();
    }
    // scontrol expands the node list as Slurm would; srun records its arguments and keeps
    // a copy of the job folder as the tasks would see it (the script deletes the secret
    // when it ends).
    let stubs = [
        ("scontrol", "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$@\" > \"$OUT/requeued\"; exit 0; fi\n[ \"$1 $2 $3\" = \"show hostnames n[01-03,07]\" ] || exit 9\nprintf 'n01\\nn02\\nn03\\nn07\\n'\n"),
        ("srun", "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$OUT/srun.args\"\ncp -p \"$SLURM_SUBMIT_DIR\"/* \"$OUT\"/\nexit ${SRUN_STATUS:-0}\n"),
    ];
    for (name, body) in stubs {
        let p = bin.join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let run = |srun_status: &str| {
        std::process::Command::new("bash")
            .arg(repo("examples/slurm.sbatch"))
            .arg("train.toml")
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin.display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .env("OUT", &out)
            .env("SRUN_STATUS", srun_status)
            .env("SLURM_JOB_ID", "77")
            .env("SLURM_JOB_NAME", "tiny gpt")
            .env("SLURM_JOB_NODELIST", "n[01-03,07]")
            .env("SLURM_SUBMIT_DIR", &job)
            .status()
            .unwrap()
    };
    // Stopped by a signal (143): the job goes back to the queue, and says so by its status.
    let stopped = run("143");
    assert_eq!(stopped.code(), Some(143));
    let requeued = std::fs::read_to_string(out.join("requeued")).unwrap();
    assert_eq!(requeued.trim(), "requeue 77");
    std::fs::remove_file(out.join("requeued")).unwrap();
    let status = run("0");
    assert!(status.success(), "{status}");
    assert!(
        !out.join("requeued").exists(),
        "a finished job was requeued"
    );
    let args = std::fs::read_to_string(out.join("srun.args")).unwrap();
    let manifest_path = job.join("cluster-77.toml");
    let expect = format!(
        "--ntasks-per-node=1\npipetrain\nlaunch\n--manifest\n{}\n--resume\ntrain.toml\n",
        manifest_path.display()
    );
    assert_eq!(args, expect);
    let text = std::fs::read_to_string(out.join("cluster-77.toml")).unwrap();
    let m = ClusterManifest::parse(&text, &manifest_path).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        m.nodes()
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>(),
        ["n01", "n02", "n03", "n07"]
    );
    assert_eq!((m.world_size(), m.job().name.as_str()), (4, "tiny-gpt"));
    assert_eq!(m.rendezvous().to_string(), "n01:29400");
    assert_eq!(
        m.job().secret_file.as_deref(),
        Some(job.join("cluster-77.secret").as_path())
    );
    let secret = out.join("cluster-77.secret");
    let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(
        std::fs::read(&secret).unwrap().len(),
        64,
        "32 random bytes in hex"
    );
    assert!(
        !job.join("cluster-77.secret").exists(),
        "the secret outlived the job"
    );
    for (i, name) in ["n01", "n02", "n03", "n07"].iter().enumerate() {
        let id = i.to_string();
        let task = |k: &str| match k {
            "SLURM_JOB_ID" => Some("77".into()),
            "SLURMD_NODENAME" => Some(name.to_string()),
            "SLURM_NODEID" => Some(id.clone()),
            "SLURM_NTASKS" => Some("4".into()),
            _ => None,
        };
        assert_eq!(select_node(&m, None, &task).unwrap().index, i);
    }
}

/// The block under `key: |` in a YAML file, unindented.
fn yaml_block(yaml: &str, key: &str) -> String {
    let mut lines = yaml.lines().skip_while(|l| l.trim() != format!("{key}: |"));
    let head = lines.next().expect("the block's key");
    let base = head.len() - head.trim_start().len();
    let body: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > base)
        .collect();
    let indent = body
        .iter()
        .find(|l| !l.trim().is_empty())
        .map_or(0, |l| l.len() - l.trim_start().len());
    body.iter()
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_kubernetes_job_runs_a_pod_per_node_found_by_completion_index() {
    let yaml = read("examples/k8s-job.yaml");
    mentions(
        &yaml,
        "k8s-job.yaml",
        &[
            "completionMode: Indexed",
            "clusterIP: None",
            "subdomain: tiny-gpt",
            "JOB_COMPLETION_INDEX",
            "secretKeyRef",
            "name: PIPETRAIN_SECRET",
            "- launch",
            "- --manifest",
            "/etc/pipetrain/cluster.toml",
            "- --resume",
            "terminationGracePeriodSeconds",
            "values: [130, 143]",
        ],
    );
    let text = yaml_block(&yaml, "cluster.toml");
    let m = ClusterManifest::parse(&text, Path::new("/etc/pipetrain/cluster.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(m.job().secret_env.as_deref(), Some("PIPETRAIN_SECRET"));
    let n = m.nodes().len();
    mentions(
        &yaml,
        "k8s-job.yaml",
        &[&format!("completions: {n}"), &format!("parallelism: {n}")],
    );
    for i in 0..n {
        let v = i.to_string();
        let env = |k: &str| (k == "JOB_COMPLETION_INDEX").then(|| v.clone());
        let c = select_node(&m, None, &env).unwrap();
        assert_eq!((c.index, c.source), (i, NodeSource::KubernetesIndex(i)));
        assert_eq!(m.nodes()[i].address, format!("tiny-gpt-{i}.tiny-gpt"));
        assert!(m.nodes()[i].bind_all);
    }
    // The training configuration the pods run asks for this layout.
    let config_path = repo("examples/gpt2_pipeline.toml");
    mentions(&yaml, "k8s-job.yaml", &["examples/gpt2_pipeline.toml"]);
    let config = pipetrain::config::TrainConfig::load(&config_path).unwrap();
    m.check_train_config(&config, &config_path).unwrap();
}
