//! The cluster manifest `pipetrain launch` reads: the example parses to the layout and
//! rank placement it describes, and ranks map to (dp, pp, tp) and back over whole grids.
//! Submodules: every rule's error (`rules`), Slurm host lists, node selection under Slurm
//! and Kubernetes, the shared secret, and the sbatch and Kubernetes examples.

mod examples;
mod hostlist;
mod rules;
mod schedulers;
mod secret;

use std::path::{Path, PathBuf};

use pipetrain::cluster::{ClusterManifest, Endpoint, Host, Layout, RankCoords};
use pipetrain::Error;

/// Two nodes, two ranks each: dp = 2 x pp = 2.
pub const GOOD: &str = r#"
[job]
name = "tiny-gpt"
rendezvous = "127.0.0.1:29400"
secret_file = "cluster.secret"

[layout]
data_parallel = 2
pipeline_parallel = 2

[[nodes]]
name = "a"
address = "127.0.0.1"
port = 29500
cpu_slots = 2

[[nodes]]
name = "b"
address = "127.0.0.2"
port = 29500
cpu_slots = 2
"#;

pub const PATH: &str = "/jobs/cluster.toml";

pub fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// `text` with each `(from, to)` replaced once; `from` must occur, so no case silently
/// tests the good manifest.
pub fn edit(text: &str, edits: &[(&str, &str)]) -> String {
    edits.iter().fold(text.to_string(), |t, (from, to)| {
        assert!(t.contains(from), "`{from}` is not in the manifest");
        t.replacen(from, to, 1)
    })
}

pub fn parse(text: &str) -> ClusterManifest {
    ClusterManifest::parse(text, Path::new(PATH)).unwrap_or_else(|e| panic!("{e}"))
}

/// Parsing fails with a `Config` error on this file, exactly this field, and a rule
/// containing `rule`; the message shows all three.
pub fn refused(text: &str, field: &str, rule: &str) {
    match ClusterManifest::parse(text, Path::new(PATH)) {
        Err(e @ Error::Config { .. }) => {
            let msg = e.to_string();
            let Error::Config {
                path,
                field: f,
                rule: r,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(path, Path::new(PATH), "{msg}");
            assert_eq!(f, field, "{msg}");
            assert!(r.contains(rule), "expected `{rule}` in: {msg}");
            assert!(
                msg.starts_with(&format!("{PATH}: field `{field}`: ")),
                "{msg}"
            );
        }
        other => panic!("expected a Config error on `{field}` ({rule}), got {other:?}"),
    }
}

fn rc(rank: usize, dp: usize, pp: usize) -> RankCoords {
    RankCoords {
        rank,
        dp,
        pp,
        tp: 0,
    }
}

#[test]
fn the_example_manifest_places_one_rank_per_node_in_dp_pp_order() {
    let path = repo("examples/cluster.toml");
    let m = ClusterManifest::load(&path).unwrap();
    assert_eq!(m.path(), path);
    assert_eq!(m.world_size(), 4);
    assert_eq!(
        m.layout(),
        Layout {
            data_parallel: 2,
            pipeline_parallel: 2,
            tensor_parallel: 1
        }
    );
    let names: Vec<&str> = m.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    // rank = dp * pipeline_parallel + pp: a, b are replica 0's stages; c, d replica 1's.
    let expect = [rc(0, 0, 0), rc(1, 0, 1), rc(2, 1, 0), rc(3, 1, 1)];
    for (i, name) in names.iter().enumerate() {
        assert_eq!(m.node_index(name), Some(i));
        assert_eq!(m.node(name).unwrap().address, format!("127.0.0.{}", i + 1));
        assert_eq!(m.ranks_of(i), [expect[i]]);
        assert_eq!(m.node_of_rank(i), Some(i));
        assert_eq!(m.coords(i), Some(expect[i]));
        let ep = m.data_endpoint(i).unwrap();
        assert_eq!(ep.to_string(), format!("127.0.0.{}:29500", i + 1));
    }
    assert_eq!(
        (m.node("e"), m.node_of_rank(4), m.coords(4), m.ranks_of(4)),
        (None, None, None, vec![])
    );
    assert_eq!(m.rendezvous().to_string(), "127.0.0.1:29400");
    assert_eq!(
        m.rendezvous().socket_addr(),
        Some("127.0.0.1:29400".parse().unwrap())
    );
    let job = m.job();
    assert_eq!(job.name, "tiny-gpt");
    assert_eq!(
        job.secret_file.as_deref(),
        Some(repo("examples/cluster.secret").as_path())
    );
    assert_eq!(
        (
            job.heartbeat_ms,
            job.peer_timeout_s,
            job.connect_timeout_s,
            job.max_restarts
        ),
        (1000, 10, 60, 3)
    );
}

#[test]
fn unset_fields_take_their_defaults() {
    let m = parse(GOOD);
    let job = m.job();
    assert_eq!(job.heartbeat(), std::time::Duration::from_millis(1000));
    assert_eq!(job.peer_timeout(), std::time::Duration::from_secs(10));
    assert_eq!(job.connect_timeout(), std::time::Duration::from_secs(60));
    assert_eq!(job.max_restarts, 3);
    assert_eq!(m.layout().tensor_parallel, 1);
    assert!(!m.nodes()[0].bind_all);
    assert_eq!(m.nodes()[0].bind_ip(), Some("127.0.0.1".parse().unwrap()));
    // A relative secret file is beside the manifest.
    assert_eq!(
        job.secret_file.as_deref(),
        Some(Path::new("/jobs/cluster.secret"))
    );
}

#[test]
fn ranks_fill_nodes_in_order_by_slots_and_listen_on_consecutive_ports() {
    let text = edit(
        GOOD,
        &[
            ("cpu_slots = 2\n", "cpu_slots = 3\n"),
            ("cpu_slots = 2\n", "gpus = [5]\n"),
        ],
    );
    let m = parse(&text);
    assert_eq!(m.ranks_of(0), [rc(0, 0, 0), rc(1, 0, 1), rc(2, 1, 0)]);
    assert_eq!(m.ranks_of(1), [rc(3, 1, 1)]);
    assert_eq!(m.nodes()[1].slots(), 1);
    let ports: Vec<u16> = (0..4).map(|r| m.data_endpoint(r).unwrap().port).collect();
    assert_eq!(ports, [29500, 29501, 29502, 29500]);
    assert_eq!(
        (0..4)
            .map(|r| m.node_of_rank(r).unwrap())
            .collect::<Vec<_>>(),
        [0, 0, 0, 1]
    );
}

#[test]
fn listed_ranks_run_where_listed_in_rank_order() {
    // Each node runs one stage of both replicas: the pipeline crosses nodes, the
    // all-reduce stays inside one.
    let text = edit(
        GOOD,
        &[
            ("cpu_slots = 2\n", "cpu_slots = 2\nranks = [2, 0]\n"),
            (
                "\"127.0.0.2\"\nport = 29500\ncpu_slots = 2\n",
                "\"127.0.0.2\"\nport = 29500\ncpu_slots = 2\nranks = [1, 3]\n",
            ),
        ],
    );
    let m = parse(&text);
    assert_eq!(m.ranks_of(0), [rc(0, 0, 0), rc(2, 1, 0)]);
    assert_eq!(m.ranks_of(1), [rc(1, 0, 1), rc(3, 1, 1)]);
    assert_eq!(
        (0..4)
            .map(|r| m.node_of_rank(r).unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 0, 1]
    );
    assert_eq!(m.data_endpoint(2).unwrap().to_string(), "127.0.0.1:29501");
    assert_eq!(m.data_endpoint(3).unwrap().to_string(), "127.0.0.2:29501");
}

#[test]
fn ranks_and_coordinates_round_trip_over_grids() {
    for dp in 1..=5 {
        for pp in 1..=5 {
            for tp in 1..=3 {
                let l = Layout {
                    data_parallel: dp,
                    pipeline_parallel: pp,
                    tensor_parallel: tp,
                };
                let world = dp * pp * tp;
                assert_eq!(l.world_size(), world);
                let all: Vec<RankCoords> = l.all().collect();
                assert_eq!(all.len(), world);
                let mut seen = std::collections::HashSet::new();
                for (rank, c) in all.iter().enumerate() {
                    assert_eq!(c.rank, rank);
                    assert!(c.dp < dp && c.pp < pp && c.tp < tp, "{c:?} in {l:?}");
                    assert!(seen.insert((c.dp, c.pp, c.tp)), "{c:?} twice in {l:?}");
                    assert_eq!(l.rank(c.dp, c.pp, c.tp), Some(rank));
                    assert_eq!(l.coords(rank), Some(*c));
                    assert_eq!(rank, (c.dp * pp + c.pp) * tp + c.tp);
                }
                assert_eq!(l.coords(world), None);
                assert_eq!(
                    (l.rank(dp, 0, 0), l.rank(0, pp, 0), l.rank(0, 0, tp)),
                    (None, None, None)
                );
            }
        }
    }
    // tp = 1, the supported case: rank = dp * pipeline_parallel + pp.
    let l = Layout {
        data_parallel: 3,
        pipeline_parallel: 4,
        tensor_parallel: 1,
    };
    assert_eq!(l.coords(9), Some(rc(9, 2, 1)));
    assert_eq!(l.rank(2, 1, 0), Some(9));
}

#[test]
fn addresses_may_be_ipv6_or_host_names_and_bind_all_binds_the_wildcard() {
    let text = edit(
        GOOD,
        &[
            ("\"127.0.0.1:29400\"", "\"[::1]:29400\""),
            ("\"127.0.0.1\"", "\"::1\""),
            (
                "\"127.0.0.2\"",
                "\"Node-02.cluster.example\"\nbind_all = true",
            ),
        ],
    );
    let m = parse(&text);
    assert_eq!(m.rendezvous().to_string(), "[::1]:29400");
    assert_eq!(m.rendezvous().host, Host::Ip("::1".parse().unwrap()));
    assert_eq!(m.data_endpoint(1).unwrap().to_string(), "[::1]:29501");
    let b = &m.nodes()[1];
    assert_eq!(b.host(), Host::Name("node-02.cluster.example".into()));
    assert_eq!(b.bind_ip(), Some("0.0.0.0".parse().unwrap()));
    assert_eq!(
        m.data_endpoint(2).unwrap().to_string(),
        "node-02.cluster.example:29500"
    );
    assert_eq!(m.data_endpoint(2).unwrap().socket_addr(), None);
    assert_eq!(m.nodes()[0].bind_ip(), Some("::1".parse().unwrap()));
    let e = Endpoint::parse("head.cluster:29400").unwrap();
    assert_eq!((e.host, e.port), (Host::Name("head.cluster".into()), 29400));
    // A host name without bind_all binds nothing the manifest can say: the launcher
    // resolves it.
    let m = parse(&edit(GOOD, &[("\"127.0.0.2\"", "\"n2\"")]));
    assert_eq!(m.nodes()[1].bind_ip(), None);
    // The rendezvous must be the first node's address as written: a name is not an IP.
    refused(
        &edit(GOOD, &[("\"127.0.0.1:29400\"", "\"localhost:29400\"")]),
        "job.rendezvous",
        "first node",
    );
}

#[test]
fn to_toml_reads_back_to_an_equal_manifest() {
    for text in [
        GOOD.to_string(),
        std::fs::read_to_string(repo("examples/cluster.toml")).unwrap(),
    ] {
        let m = parse(&text);
        let again = parse(&m.to_toml().unwrap());
        assert_eq!(again, m, "{}", m.to_toml().unwrap());
    }
}

#[test]
fn load_names_the_file_it_could_not_read() {
    let missing = Path::new("/nonexistent/cluster.toml");
    match ClusterManifest::load(missing) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_training_config_must_ask_for_the_manifest_layout() {
    let config_path = repo("examples/gpt2_pipeline.toml");
    let config = pipetrain::config::TrainConfig::load(&config_path).unwrap();
    let m = ClusterManifest::load(&repo("examples/cluster.toml")).unwrap();
    m.check_train_config(&config, &config_path).unwrap();
    let wide = parse(&edit(
        GOOD,
        &[
            ("data_parallel = 2", "data_parallel = 4"),
            ("pipeline_parallel = 2", "pipeline_parallel = 1"),
        ],
    ));
    let err = wide
        .check_train_config(&config, &config_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!("{PATH}: field `layout.data_parallel`: is 4")),
        "{err}"
    );
    assert!(err.contains("data_parallel_size = 2"), "{err}");
}

/// A node listing `gpus` needs a training configuration on a GPU, and a launched job's
/// ranks are placed by its nodes, not by `runtime.devices`: each refusal names its file
/// and field.
#[test]
fn a_node_on_gpus_needs_a_configuration_on_a_gpu() {
    let config_path = repo("examples/gpt2_pipeline.toml");
    let text = std::fs::read_to_string(&config_path).unwrap();
    let load = |text: &str| pipetrain::config::TrainConfig::parse(text, &config_path).unwrap();
    let on_cpu = load(&text);
    let on_gpus = parse(&edit(GOOD, &[("cpu_slots = 2\n", "gpus = [0, 1]\n")]));
    let err = on_gpus
        .check_train_config(&on_cpu, &config_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!("{PATH}: field `nodes[0].gpus`")) && err.contains("\"cpu\""),
        "{err}"
    );
    assert!(
        !text.contains("[runtime]"),
        "the example sets no runtime table"
    );
    let cuda = format!("{text}\n[runtime]\ndevice = \"cuda\"\n");
    on_gpus
        .check_train_config(&load(&cuda), &config_path)
        .unwrap();
    let spread = format!("{cuda}devices = [\"cuda:0\"]\n");
    let err = parse(GOOD)
        .check_train_config(&load(&spread), &config_path)
        .unwrap_err()
        .to_string();
    let want = format!("{}: field `runtime.devices`", config_path.display());
    assert!(err.starts_with(&want), "{err}");
}
