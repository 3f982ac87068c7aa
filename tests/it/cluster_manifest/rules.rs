//! Every manifest rule: a bad value is refused up front, the error naming the file, the
//! dotted field (`nodes[1].port`) and the rule.

use super::{edit, parse, refused, GOOD};

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
            edit(GOOD, &[("[layout]", "min_nodes = 2\n[layout]")]),
            "job.min_nodes",
            "elastic jobs only",
        ),
        (
            edit(
                GOOD,
                &[("[layout]", "elastic = true\nmin_nodes = 5\n[layout]")],
            ),
            "job.min_nodes",
            "from 1 to the 2 nodes listed, got 5",
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
                    "pipeline_parallel = 2\ntensor_parallel = 0",
                )],
            ),
            "layout.tensor_parallel",
            "at least 1",
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
