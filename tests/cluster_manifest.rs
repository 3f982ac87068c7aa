//! The cluster manifest `pipetrain launch` reads: the example parses to the layout and
//! rank placement it describes, every rule refuses a bad value naming the file, the
//! field and the rule, and ranks map to (dp, pp, tp) and back over whole grids.
//! Submodules: Slurm host lists, node selection under Slurm and Kubernetes, the shared
//! secret, and the sbatch and Kubernetes examples.

#[path = "cluster/examples.rs"]
mod examples;
#[path = "cluster/hostlist.rs"]
mod hostlist;
#[path = "cluster/schedulers.rs"]
mod schedulers;
#[path = "cluster/secret.rs"]
mod secret;

use std::path::{Path, PathBuf};

use pipetrain::cluster::{ClusterManifest, Endpoint, Host, Layout, RankCoords};
use pipetrain::Error;

/// Two nodes, two ranks each: dp = 2 x pp = 2.
const GOOD: &str = r#"
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

const PATH: &str = "/jobs/cluster.toml";

fn repo(rel: &str) -> PathBuf {
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
fn every_rule_names_the_file_the_field_and_the_rule() {
    let b = |s: &str| format!("address = \"127.0.0.2\"\n{s}");
    let cases: Vec<(String, &str, &str)> = vec![
        // Parse errors: the field under its table, with the node's index.
        (
            edit(GOOD, &[("secret_file", "secret")]),
            "job.secret",
            "unknown field",
        ),
        (
            edit(
                GOOD,
                &[("address = \"127.0.0.2\"", "adress = \"127.0.0.2\"")],
            ),
            "nodes[1].adress",
            "unknown field",
        ),
        (
            edit(GOOD, &[("address = \"127.0.0.2\"\n", "")]),
            "nodes[1].address",
            "missing field `address`",
        ),
        (
            edit(GOOD, &[(&b("port = 29500"), &b("port = \"29500\""))]),
            "nodes[1].port",
            "invalid type",
        ),
        (
            edit(GOOD, &[("[layout]", "[cluster]\nx = 1\n[layout]")]),
            "cluster",
            "unknown field",
        ),
        (
            edit(
                GOOD,
                &[("[layout]\ndata_parallel = 2\npipeline_parallel = 2\n", "")],
            ),
            "layout",
            "missing field `layout`",
        ),
        // [job]
        (
            edit(GOOD, &[("\"tiny-gpt\"", "\"tiny gpt\"")]),
            "job.name",
            "only letters",
        ),
        (
            edit(GOOD, &[("secret_file = \"cluster.secret\"\n", "")]),
            "job.secret_file",
            "missing",
        ),
        (
            edit(
                GOOD,
                &[(
                    "secret_file = \"cluster.secret\"",
                    "secret_file = \"s\"\nsecret_env = \"S\"",
                )],
            ),
            "job.secret_env",
            "not both",
        ),
        (
            edit(
                GOOD,
                &[("secret_file = \"cluster.secret\"", "secret_env = \"1X\"")],
            ),
            "job.secret_env",
            "environment variable's name",
        ),
        (
            edit(GOOD, &[("[layout]", "heartbeat_ms = 0\n[layout]")]),
            "job.heartbeat_ms",
            "from 10 to 60000",
        ),
        (
            edit(GOOD, &[("[layout]", "peer_timeout_s = 0\n[layout]")]),
            "job.peer_timeout_s",
            "from 1 to 3600",
        ),
        (
            edit(
                GOOD,
                &[(
                    "[layout]",
                    "heartbeat_ms = 5000\npeer_timeout_s = 10\n[layout]",
                )],
            ),
            "job.peer_timeout_s",
            "at least 3 heartbeats (15000 ms)",
        ),
        (
            edit(GOOD, &[("[layout]", "connect_timeout_s = 0\n[layout]")]),
            "job.connect_timeout_s",
            "from 1 to 86400",
        ),
        (
            edit(GOOD, &[("\"127.0.0.1:29400\"", "\"127.0.0.2:29400\"")]),
            "job.rendezvous",
            "must be on the first node",
        ),
        (
            edit(GOOD, &[("\"127.0.0.1:29400\"", "\"127.0.0.1\"")]),
            "job.rendezvous",
            "must be ADDRESS:PORT",
        ),
        (
            edit(GOOD, &[("\"127.0.0.1:29400\"", "\"::1:29400\"")]),
            "job.rendezvous",
            "needs brackets",
        ),
        (
            edit(GOOD, &[("\"127.0.0.1:29400\"", "\"127.0.0.1:0\"")]),
            "job.rendezvous",
            "from 1 to 65535",
        ),
        (
            edit(GOOD, &[("\"127.0.0.1:29400\"", "\"127.0.0.1:29501\"")]),
            "job.rendezvous",
            "data port of nodes[0]",
        ),
        // [layout]
        (
            edit(
                GOOD,
                &[(
                    "pipeline_parallel = 2",
                    "pipeline_parallel = 2\ntensor_parallel = 2",
                )],
            ),
            "layout.tensor_parallel",
            "not supported",
        ),
        (
            edit(GOOD, &[("data_parallel = 2", "data_parallel = 0")]),
            "layout.data_parallel",
            "at least 1",
        ),
        (
            edit(GOOD, &[("cpu_slots = 2", "cpu_slots = 3")]),
            "nodes",
            "slots add up to 5 ranks, but the layout's world size",
        ),
        // [[nodes]]
        (
            edit(GOOD, &[("name = \"b\"", "name = \"a\"")]),
            "nodes[1].name",
            "unique: `a` is also nodes[0]",
        ),
        (
            edit(GOOD, &[("name = \"b\"", "name = \"\"")]),
            "nodes[1].name",
            "must not be empty",
        ),
        (
            edit(GOOD, &[("\"127.0.0.2\"", "\"127.0.0.256\"")]),
            "nodes[1].address",
            "not a valid one",
        ),
        (
            edit(GOOD, &[("\"127.0.0.2\"", "\"node_1\"")]),
            "nodes[1].address",
            "only letters, digits",
        ),
        (
            edit(GOOD, &[("\"127.0.0.2\"", "\"0.0.0.0\"")]),
            "nodes[1].address",
            "bind_all = true",
        ),
        (
            edit(
                GOOD,
                &[(&b(""), "address = \"0.0.0.0\"\nbind_all = true\n")],
            ),
            "nodes[1].address",
            "not an address peers can connect to",
        ),
        (
            edit(GOOD, &[("\"127.0.0.2\"", "\"224.0.0.1\"")]),
            "nodes[1].address",
            "multicast",
        ),
        (
            edit(GOOD, &[(&b("port = 29500"), &b("port = 0"))]),
            "nodes[1].port",
            "from 1 to 65535, got 0",
        ),
        (
            edit(GOOD, &[(&b("port = 29500"), &b("port = 70000"))]),
            "nodes[1].port",
            "from 1 to 65535, got 70000",
        ),
        (
            edit(GOOD, &[(&b("port = 29500"), &b("port = 65535"))]),
            "nodes[1].port",
            "ports 65535-65536, past 65535",
        ),
        (
            edit(GOOD, &[("\"127.0.0.2\"", "\"127.0.0.1\"")]),
            "nodes[1].port",
            "overlap nodes[0] (`a`)'s ports 29500-29501 on the same address",
        ),
        (
            edit(
                GOOD,
                &[(&b("port = 29500"), "address = \"127.0.0.1\"\nport = 29501")],
            ),
            "nodes[1].port",
            "ports 29501-29502 overlap",
        ),
        (
            edit(GOOD, &[(&b(""), &b("bind_all = true\n"))]),
            "nodes[1].port",
            "overlap",
        ),
        (
            edit(
                GOOD,
                &[(
                    &b("port = 29500\ncpu_slots = 2"),
                    &b("port = 29500\ncpu_slots = 2\ngpus = [0, 1]"),
                )],
            ),
            "nodes[1].gpus",
            "not both",
        ),
        (
            edit(
                GOOD,
                &[(&b("port = 29500\ncpu_slots = 2\n"), &b("port = 29500\n"))],
            ),
            "nodes[1].cpu_slots",
            "missing",
        ),
        (
            edit(
                GOOD,
                &[(
                    &b("port = 29500\ncpu_slots = 2"),
                    &b("port = 29500\ncpu_slots = 0"),
                )],
            ),
            "nodes[1].cpu_slots",
            "at least 1",
        ),
        (
            edit(
                GOOD,
                &[(
                    &b("port = 29500\ncpu_slots = 2"),
                    &b("port = 29500\ngpus = [1, 1]"),
                )],
            ),
            "nodes[1].gpus",
            "device 1 is listed twice",
        ),
        (
            edit(
                GOOD,
                &[(
                    &b("port = 29500\ncpu_slots = 2"),
                    &b("port = 29500\ngpus = []"),
                )],
            ),
            "nodes[1].gpus",
            "at least one device",
        ),
    ];
    for (text, field, rule) in &cases {
        refused(text, field, rule);
    }
    // Adjacent port ranges on one address are fine.
    parse(&edit(
        GOOD,
        &[(&b("port = 29500"), "address = \"127.0.0.1\"\nport = 29502")],
    ));
    let no_nodes = "nodes = []\n".to_string() + &GOOD[..GOOD.find("[[nodes]]").unwrap()];
    refused(&no_nodes, "nodes", "at least one");
}

#[test]
fn listed_ranks_must_cover_the_world_once_within_slots() {
    let ranks = |a: &str, b: &str| {
        let t = edit(
            GOOD,
            &[(
                "port = 29500\ncpu_slots = 2\n",
                &format!("port = 29500\ncpu_slots = 2\n{a}"),
            )],
        );
        edit(
            &t,
            &[(
                "\"127.0.0.2\"\nport = 29500\ncpu_slots = 2\n",
                &format!("\"127.0.0.2\"\nport = 29500\ncpu_slots = 2\n{b}"),
            )],
        )
    };
    refused(
        &ranks("ranks = [0, 1]\n", "ranks = [1, 2]\n"),
        "nodes[1].ranks",
        "rank 1 is also on nodes[0]",
    );
    refused(
        &ranks("ranks = [0, 0]\n", "ranks = [2, 3]\n"),
        "nodes[0].ranks",
        "rank 0 is also on this node",
    );
    refused(
        &ranks("ranks = [0, 1]\n", "ranks = [2]\n"),
        "nodes",
        "rank(s) 3 run on no node",
    );
    refused(
        &ranks("ranks = [0, 1]\n", "ranks = [2, 4]\n"),
        "nodes[1].ranks",
        "rank 4 is not below the world size 4",
    );
    refused(
        &ranks("ranks = [0, 1, 2]\n", "ranks = [3]\n"),
        "nodes[0].ranks",
        "3 ranks, but the node has 2 slots",
    );
    refused(
        &ranks("ranks = [0, 1]\n", ""),
        "nodes[1].ranks",
        "on every node or on none",
    );
    refused(
        &ranks("", "ranks = []\n"),
        "nodes[0].ranks",
        "on every node or on none",
    );
    refused(
        &ranks("ranks = [0, 1]\n", "ranks = []\n"),
        "nodes[1].ranks",
        "at least one rank",
    );
    refused(
        &ranks("ranks = [0, 1]\n", "ranks = [2, -3]\n"),
        "nodes[1].ranks",
        "invalid value",
    );
    // Fewer ranks than slots is allowed when ranks are listed: a slot may stay free.
    let t = edit(
        &ranks("ranks = [0]\n", "ranks = [1, 2, 3]\n"),
        &[("cpu_slots = 2\nranks = [1", "cpu_slots = 3\nranks = [1")],
    );
    let m = parse(&t);
    assert_eq!((m.ranks_of(0).len(), m.ranks_of(1).len()), (1, 3));
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
