//! Finding this process's node: `--node`, Slurm's variables, a Kubernetes indexed Job's;
//! and a manifest derived from a Slurm allocation. Environments are fake lookups.

use std::path::Path;

use pipetrain::cluster::{
    manifest_from_slurm, node_from_env, select_node, ClusterManifest, Layout, NodeChoice,
    NodeSource, SecretSource, SlurmDefaults,
};
use pipetrain::Error;

use super::{edit, parse};

/// A fake environment.
fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

/// Four nodes named as Slurm names them, with fully qualified addresses.
fn slurm_manifest() -> ClusterManifest {
    let mut text = String::from(
        "[job]\nname = \"t\"\nrendezvous = \"n01.cluster:29400\"\nsecret_env = \"S\"\n[layout]\ndata_parallel = 2\npipeline_parallel = 2\n",
    );
    for i in 1..=4 {
        text += &format!("[[nodes]]\nname = \"n0{i}\"\naddress = \"n0{i}.cluster\"\nport = 29500\ncpu_slots = 1\n");
    }
    parse(&text)
}

/// Four pods of the indexed Job `tiny-gpt`, addressed through the Service `tiny-gpt`.
fn k8s_manifest(addresses_are_names: bool) -> ClusterManifest {
    let addr = |i| {
        if addresses_are_names {
            format!("tiny-gpt-{i}.tiny-gpt")
        } else {
            format!("127.0.0.{}", i + 1)
        }
    };
    let mut text = format!(
        "[job]\nname = \"tiny-gpt\"\nrendezvous = \"{}:29400\"\nsecret_env = \"S\"\n[layout]\ndata_parallel = 2\npipeline_parallel = 2\n",
        addr(0)
    );
    for i in 0..4 {
        text += &format!(
            "[[nodes]]\nname = \"w{i}\"\naddress = \"{}\"\nport = 29500\ncpu_slots = 1\n",
            addr(i)
        );
    }
    parse(&text)
}

fn picked(m: &ClusterManifest, explicit: Option<&str>, vars: &[(&str, &str)]) -> NodeChoice {
    select_node(m, explicit, &env(vars)).unwrap_or_else(|e| panic!("{vars:?}: {e}"))
}

/// Selection fails with a `Config` error on `field` whose rule contains each of `parts`.
fn refused(
    m: &ClusterManifest,
    explicit: Option<&str>,
    vars: &[(&str, &str)],
    field: &str,
    parts: &[&str],
) {
    match select_node(m, explicit, &env(vars)) {
        Err(Error::Config { field: f, rule, .. }) => {
            assert_eq!(f, field, "{rule}");
            for p in parts {
                assert!(rule.contains(p), "`{rule}` lacks `{p}`");
            }
        }
        other => panic!("{vars:?}: expected an error on {field}, got {other:?}"),
    }
}

#[test]
fn slurm_picks_the_node_by_its_name_else_by_node_id() {
    let m = slurm_manifest();
    let job = [("SLURM_JOB_ID", "42"), ("SLURM_NTASKS", "4")];
    let with = |extra: &[(&'static str, &'static str)]| [&job[..], extra].concat();
    let c = picked(
        &m,
        None,
        &with(&[("SLURMD_NODENAME", "n03"), ("SLURM_NODEID", "2")]),
    );
    assert_eq!(
        (c.index, c.name.as_str(), c.source),
        (2, "n03", NodeSource::SlurmNodeName("n03".into()))
    );
    // The name wins over the index, and a fully qualified name matches the short one.
    let c = picked(
        &m,
        None,
        &with(&[("SLURMD_NODENAME", "N04.cluster"), ("SLURM_NODEID", "0")]),
    );
    assert_eq!(c.index, 3);
    let c = picked(&m, None, &with(&[("SLURMD_NODENAME", "n02.other-domain")]));
    assert_eq!(c.index, 1);
    // A name the manifest does not know: the allocation's index.
    let c = picked(
        &m,
        None,
        &with(&[("SLURMD_NODENAME", "gpu-17"), ("SLURM_NODEID", "1")]),
    );
    assert_eq!((c.index, c.source), (1, NodeSource::SlurmNodeId(1)));
    let c = picked(&m, None, &with(&[("SLURM_PROCID", "3")]));
    assert_eq!(c.index, 3);
    assert_eq!(
        node_from_env(&m, &env(&with(&[("SLURM_NODEID", "0")]))).unwrap(),
        "n01"
    );
    assert_eq!(NodeSource::SlurmNodeId(1).to_string(), "SLURM_NODEID=1");
}

#[test]
fn slurm_refuses_task_counts_and_indices_that_do_not_fit_the_nodes() {
    let m = slurm_manifest();
    refused(
        &m,
        None,
        &[
            ("SLURM_JOB_ID", "42"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NODEID", "0"),
        ],
        "SLURM_NTASKS",
        &["is 8", "4 nodes", "one process per node"],
    );
    refused(
        &m,
        None,
        &[("SLURM_JOB_ID", "42"), ("SLURM_NODEID", "4")],
        "SLURM_NODEID",
        &["is 4", "4 nodes", "n01 (n01.cluster)"],
    );
    refused(
        &m,
        None,
        &[("SLURM_JOB_ID", "42"), ("SLURMD_NODENAME", "x")],
        "SLURM_NODEID",
        &["not set", "SLURMD_NODENAME (x)"],
    );
    match select_node(
        &m,
        None,
        &env(&[("SLURM_JOB_ID", "42"), ("SLURM_NODEID", "two")]),
    ) {
        Err(Error::Config { path, field, rule }) => {
            assert_eq!(
                (path.to_str(), field.as_str()),
                (Some("<environment>"), "SLURM_NODEID")
            );
            assert!(rule.contains("must be a number, got `two`"), "{rule}");
        }
        other => panic!("{other:?}"),
    }
    // Two nodes matching one short name are ambiguous rather than a guess.
    let text = edit(
        &slurm_manifest().to_toml().unwrap(),
        &[("address = \"n02.cluster\"", "address = \"n01.b\"")],
    );
    let m2 = parse(&text);
    refused(
        &m2,
        None,
        &[("SLURM_JOB_ID", "1"), ("SLURMD_NODENAME", "n01.c")],
        "SLURMD_NODENAME",
        &["several nodes (n01, n02)"],
    );
}

#[test]
fn a_kubernetes_indexed_job_picks_nodes_by_completion_index() {
    let m = k8s_manifest(true);
    for i in 0..4 {
        let v = i.to_string();
        let c = picked(
            &m,
            None,
            &[("JOB_COMPLETION_INDEX", &v), ("HOSTNAME", "tiny-gpt-3")],
        );
        assert_eq!((c.index, c.source), (i, NodeSource::KubernetesIndex(i)));
    }
    refused(
        &m,
        None,
        &[("JOB_COMPLETION_INDEX", "4")],
        "JOB_COMPLETION_INDEX",
        &["is 4", "4 nodes", "completions"],
    );
    refused(
        &m,
        None,
        &[("JOB_COMPLETION_INDEX", "-1")],
        "JOB_COMPLETION_INDEX",
        &["must be a number"],
    );
}

#[test]
fn a_pod_hostname_picks_the_node_by_address_or_job_index() {
    let pod = |h: &'static str| [("KUBERNETES_SERVICE_HOST", "10.96.0.1"), ("HOSTNAME", h)];
    // The pod's name is the first label of its address under the headless Service.
    let c = picked(&k8s_manifest(true), None, &pod("tiny-gpt-2"));
    assert_eq!((c.index, c.name.as_str()), (2, "w2"));
    // With IP addresses, the `<job>-<index>` pattern of indexed Jobs' pods.
    let c = picked(&k8s_manifest(false), None, &pod("tiny-gpt-1"));
    assert_eq!(
        (c.index, c.source),
        (1, NodeSource::KubernetesHostname("tiny-gpt-1".into()))
    );
    refused(
        &k8s_manifest(false),
        None,
        &pod("tiny-gpt-7"),
        "HOSTNAME",
        &["is 7"],
    );
    refused(
        &k8s_manifest(false),
        None,
        &pod("other-1"),
        "--node",
        &["not given"],
    );
    // Outside a pod, HOSTNAME alone says nothing.
    refused(
        &k8s_manifest(true),
        None,
        &[("HOSTNAME", "tiny-gpt-2")],
        "--node",
        &["not given"],
    );
}

#[test]
fn an_explicit_node_wins_and_unknown_names_list_the_nodes() {
    let m = slurm_manifest();
    let slurm = [
        ("SLURM_JOB_ID", "42"),
        ("SLURM_NODEID", "0"),
        ("JOB_COMPLETION_INDEX", "1"),
    ];
    let c = picked(&m, Some("n04"), &slurm);
    assert_eq!((c.index, c.source), (3, NodeSource::Explicit));
    // Even a task count that would be refused does not matter with --node.
    assert_eq!(
        picked(
            &m,
            Some("n02"),
            &[("SLURM_JOB_ID", "1"), ("SLURM_NTASKS", "9")]
        )
        .index,
        1
    );
    refused(
        &m,
        Some("n05"),
        &slurm,
        "--node",
        &[
            "no node is named `n05`",
            "n01 (n01.cluster), n02 (n02.cluster), n03 (n03.cluster), n04 (n04.cluster)",
        ],
    );
    refused(
        &m,
        None,
        &[],
        "--node",
        &[
            "not given",
            "SLURM_JOB_ID",
            "JOB_COMPLETION_INDEX",
            "n01 (n01.cluster)",
        ],
    );
    // Slurm comes before Kubernetes.
    assert_eq!(picked(&m, None, &slurm).source, NodeSource::SlurmNodeId(0));
}

#[test]
fn a_slurm_allocation_becomes_a_manifest_with_ranks_spread_evenly() {
    let vars = [
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_NAME", "tiny gpt"),
        ("SLURM_JOB_NODELIST", "node[01-03,07]"),
        ("SLURM_SUBMIT_DIR", "/home/me/run"),
    ];
    let base = SlurmDefaults {
        layout: Layout {
            data_parallel: 2,
            pipeline_parallel: 4,
            tensor_parallel: 1,
        },
        ..SlurmDefaults::default()
    };
    let m = manifest_from_slurm(&env(&vars), &base).unwrap();
    assert_eq!(m.path(), Path::new("<slurm job 42>"));
    let names: Vec<&str> = m.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["node01", "node02", "node03", "node07"]);
    assert!(m
        .nodes()
        .iter()
        .all(|n| n.address == n.name && n.port == 29500 && n.cpu_slots == Some(2)));
    assert_eq!(m.rendezvous().to_string(), "node01:29400");
    assert_eq!(m.job().name, "tiny-gpt");
    assert_eq!(
        m.job().secret_source(),
        SecretSource::File("/home/me/run/cluster.secret".into())
    );
    assert_eq!(m.world_size(), 8);
    let r: Vec<(usize, usize)> = m.ranks_of(1).iter().map(|c| (c.dp, c.pp)).collect();
    assert_eq!(r, [(0, 2), (0, 3)]);
    assert_eq!(m.node_of_rank(7), Some(3));
    // Each task of the step then finds itself in it.
    let task = [
        &vars[..],
        &[
            ("SLURMD_NODENAME", "node07"),
            ("SLURM_NODEID", "3"),
            ("SLURM_NTASKS", "4"),
        ],
    ]
    .concat();
    assert_eq!(node_from_env(&m, &env(&task)).unwrap(), "node07");
    // Written out, it reads back the same.
    assert_eq!(
        ClusterManifest::parse(&m.to_toml().unwrap(), m.path()).unwrap(),
        m
    );

    let gpus = SlurmDefaults {
        gpus: Some(vec![0, 1]),
        secret: SecretSource::Env("S".into()),
        name: Some("x".into()),
        ..base.clone()
    };
    let m = manifest_from_slurm(&env(&vars), &gpus).unwrap();
    assert!(m
        .nodes()
        .iter()
        .all(|n| n.gpus.as_deref() == Some(&[0, 1][..]) && n.cpu_slots.is_none()));
    assert_eq!(
        (m.job().name.as_str(), m.job().secret_env.as_deref()),
        ("x", Some("S"))
    );
}

#[test]
fn slurm_manifests_refuse_uneven_worlds_and_bad_node_lists() {
    let base = SlurmDefaults {
        layout: Layout {
            data_parallel: 3,
            pipeline_parallel: 1,
            tensor_parallel: 1,
        },
        ..SlurmDefaults::default()
    };
    let err = |vars: &[(&str, &str)], base: &SlurmDefaults| {
        manifest_from_slurm(&env(vars), base)
            .unwrap_err()
            .to_string()
    };
    let e = err(
        &[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n[1-2]")],
        &base,
    );
    assert_eq!(e, "<slurm job 5>: field `layout`: the world size 3 does not divide evenly over the job's 2 nodes (n[1-2])");
    let e = err(
        &[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n[1-2")],
        &base,
    );
    assert!(
        e.starts_with("<environment>: field `SLURM_JOB_NODELIST`: ") && e.contains("never closed"),
        "{e}"
    );
    let e = err(&[("SLURM_JOB_ID", "5")], &base);
    assert!(e.contains("SLURM_JOB_NODELIST`: not set"), "{e}");
    let e = err(&[], &base);
    assert!(e.contains("SLURM_JOB_ID`: not set"), "{e}");
    // The older variable name is read too; duplicate hosts fail as duplicate nodes.
    let two = SlurmDefaults {
        layout: Layout {
            data_parallel: 2,
            ..Layout::default()
        },
        ..SlurmDefaults::default()
    };
    let e = err(&[("SLURM_JOB_ID", "5"), ("SLURM_NODELIST", "n1,n1")], &two);
    assert!(
        e.contains("field `nodes[1].name`: node names must be unique"),
        "{e}"
    );
}
