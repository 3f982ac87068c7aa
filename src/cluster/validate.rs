//! The manifest's rules, checked once when it is parsed, and the rank assignment they
//! yield.

use std::collections::HashMap;
use std::path::Path;

use super::host::{Endpoint, Host};
use super::manifest::{JobSpec, ManifestFile, NodeSpec};
use crate::{Error, Result};

/// The largest world accepted: a bound that keeps a mistyped size from allocating
/// gigabytes before its rank count is found wrong.
const MAX_WORLD: usize = 1 << 20;

/// What validation works out: the rendezvous point and which node runs which rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Resolved {
    pub rendezvous: Endpoint,
    /// Per node, its ranks in ascending order.
    pub node_ranks: Vec<Vec<usize>>,
    /// Per rank, its node.
    pub rank_node: Vec<usize>,
}

pub(super) fn validate(m: &ManifestFile, path: &Path) -> Result<Resolved> {
    let bad = |field: &str, rule: String| Error::Config {
        path: path.to_path_buf(),
        field: field.into(),
        rule,
    };
    validate_job(&m.job, &bad)?;
    let world = validate_layout(m, &bad)?;
    if m.nodes.is_empty() {
        return Err(bad("nodes", "give at least one `[[nodes]]` entry".into()));
    }
    let hosts = validate_nodes(&m.nodes, &bad)?;
    validate_elastic(&m.job, m.nodes.len(), &bad)?;
    let node_ranks = assign_ranks(&m.nodes, world, &bad)?;
    validate_ports(&m.nodes, &hosts, &node_ranks, &bad)?;
    let rendezvous = Endpoint::parse(&m.job.rendezvous).map_err(|r| bad("job.rendezvous", r))?;
    let first = &m.nodes[0];
    if rendezvous.host != hosts[0] {
        return Err(bad(
            "job.rendezvous",
            format!(
                "must be on the first node, which listens there: nodes[0] (`{}`) has address {}, the rendezvous {}",
                first.name, first.address, rendezvous.host
            ),
        ));
    }
    for (i, n) in m.nodes.iter().enumerate() {
        let used = ports(n, node_ranks[i].len());
        let wildcard = n.bind_all || first.bind_all;
        if same_listener_host(&hosts[i], &rendezvous.host, wildcard)
            && used.contains(&u32::from(rendezvous.port))
        {
            return Err(bad(
                "job.rendezvous",
                format!(
                    "port {} is also a data port of nodes[{i}] (`{}`: {})",
                    rendezvous.port,
                    n.name,
                    show(&used)
                ),
            ));
        }
    }
    let mut rank_node = vec![0; world];
    for (i, ranks) in node_ranks.iter().enumerate() {
        for &r in ranks {
            rank_node[r] = i;
        }
    }
    Ok(Resolved {
        rendezvous,
        node_ranks,
        rank_node,
    })
}

type Bad<'a> = dyn Fn(&str, String) -> Error + 'a;

fn validate_job(job: &JobSpec, bad: &Bad) -> Result<()> {
    check_name(&job.name).map_err(|r| bad("job.name", r))?;
    match (&job.secret_file, &job.secret_env) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "job.secret_env",
                "give `secret_file` or `secret_env`, not both".into(),
            ))
        }
        (None, None) => {
            return Err(bad(
                "job.secret_file",
                "missing: give `secret_file` (a file only its owner can read) or `secret_env` (the name of an environment variable); never the secret itself".into(),
            ))
        }
        (Some(f), None) if f.as_os_str().is_empty() => {
            return Err(bad("job.secret_file", "must not be empty".into()))
        }
        (None, Some(v)) if !is_env_name(v) => {
            return Err(bad(
                "job.secret_env",
                format!("must be an environment variable's name (letters, digits, `_`, not starting with a digit), got `{v}`"),
            ))
        }
        _ => {}
    }
    let range = |field: &str, v: u64, lo: u64, hi: u64, unit: &str| {
        if (lo..=hi).contains(&v) {
            Ok(())
        } else {
            Err(bad(
                field,
                format!("must be from {lo} to {hi} {unit}, got {v}"),
            ))
        }
    };
    range("job.heartbeat_ms", job.heartbeat_ms, 10, 60_000, "ms")?;
    range("job.peer_timeout_s", job.peer_timeout_s, 1, 3600, "s")?;
    range(
        "job.connect_timeout_s",
        job.connect_timeout_s,
        1,
        86_400,
        "s",
    )?;
    if job.peer_timeout_s * 1000 < 3 * job.heartbeat_ms {
        return Err(bad(
            "job.peer_timeout_s",
            format!(
                "must cover at least 3 heartbeats ({} ms), so one late heartbeat does not kill a peer; got {} s",
                3 * job.heartbeat_ms,
                job.peer_timeout_s
            ),
        ));
    }
    Ok(())
}

/// `min_nodes` applies to elastic jobs, and counts from 1 to the nodes listed.
fn validate_elastic(job: &JobSpec, nodes: usize, bad: &Bad) -> Result<()> {
    match job.min_nodes {
        Some(_) if !job.elastic => Err(bad(
            "job.min_nodes",
            "applies to elastic jobs only: set `elastic = true` too, or remove it".into(),
        )),
        Some(m) if m == 0 || m > nodes => Err(bad(
            "job.min_nodes",
            format!("must be from 1 to the {nodes} nodes listed, got {m}"),
        )),
        _ => Ok(()),
    }
}

fn validate_layout(m: &ManifestFile, bad: &Bad) -> Result<usize> {
    let l = m.layout;
    for (field, v) in [
        ("layout.data_parallel", l.data_parallel),
        ("layout.pipeline_parallel", l.pipeline_parallel),
        ("layout.tensor_parallel", l.tensor_parallel),
    ] {
        if v == 0 {
            return Err(bad(field, "must be at least 1".into()));
        }
    }
    match l.checked_world_size() {
        Some(w) if w <= MAX_WORLD => Ok(w),
        _ => Err(bad(
            "layout",
            format!("data_parallel x pipeline_parallel x tensor_parallel must be at most {MAX_WORLD} ranks"),
        )),
    }
}

/// Checks each node on its own and the names' uniqueness; returns the parsed addresses.
fn validate_nodes(nodes: &[NodeSpec], bad: &Bad) -> Result<Vec<Host>> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut hosts = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        let f = |key: &str| format!("nodes[{i}].{key}");
        check_name(&n.name).map_err(|r| bad(&f("name"), r))?;
        if let Some(j) = names.insert(&n.name, i) {
            return Err(bad(
                &f("name"),
                format!("node names must be unique: `{}` is also nodes[{j}]", n.name),
            ));
        }
        let host = Host::parse(&n.address).map_err(|r| bad(&f("address"), r))?;
        if let Host::Ip(ip) = host {
            if ip.is_unspecified() {
                return Err(bad(
                    &f("address"),
                    format!("{ip} is not an address peers can connect to: give the node's own address, and `bind_all = true` to listen on every interface"),
                ));
            }
            if ip.is_multicast() {
                return Err(bad(&f("address"), format!("{ip} is a multicast address")));
            }
        }
        hosts.push(host);
        match (n.cpu_slots, &n.gpus) {
            (Some(_), Some(_)) => {
                return Err(bad(&f("gpus"), "give `cpu_slots` or `gpus`, not both".into()))
            }
            (None, None) => {
                return Err(bad(
                    &f("cpu_slots"),
                    "missing: give `cpu_slots = N` (ranks on CPUs) or `gpus = [0, 1, ...]` (a rank per device)".into(),
                ))
            }
            (Some(0), None) => return Err(bad(&f("cpu_slots"), "must be at least 1".into())),
            (None, Some(g)) if g.is_empty() => {
                return Err(bad(&f("gpus"), "must list at least one device".into()))
            }
            (None, Some(g)) => {
                if let Some(d) = first_duplicate(g) {
                    return Err(bad(&f("gpus"), format!("device {d} is listed twice")));
                }
            }
            _ => {}
        }
    }
    Ok(hosts)
}

/// Which ranks run on which node: as listed, or in node order by slots.
fn assign_ranks(nodes: &[NodeSpec], world: usize, bad: &Bad) -> Result<Vec<Vec<usize>>> {
    let listed = nodes.iter().filter(|n| n.ranks.is_some()).count();
    if listed == 0 {
        let slots: usize = nodes.iter().map(NodeSpec::slots).sum();
        if slots != world {
            return Err(bad(
                "nodes",
                format!("the nodes' slots add up to {slots} ranks, but the layout's world size (data_parallel x pipeline_parallel x tensor_parallel) is {world}; change the slots, or list `ranks` on every node"),
            ));
        }
        let mut next = 0;
        return Ok(nodes
            .iter()
            .map(|n| {
                next += n.slots();
                (next - n.slots()..next).collect()
            })
            .collect());
    }
    let mut owner: Vec<Option<usize>> = vec![None; world];
    let mut out = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        let field = format!("nodes[{i}].ranks");
        let Some(ranks) = &n.ranks else {
            return Err(bad(
                &field,
                "missing: give `ranks` on every node or on none (then ranks go in node order)"
                    .into(),
            ));
        };
        if ranks.is_empty() {
            return Err(bad(
                &field,
                "a node runs at least one rank; remove the node instead".into(),
            ));
        }
        if ranks.len() > n.slots() {
            return Err(bad(
                &field,
                format!(
                    "{} ranks, but the node has {} slots",
                    ranks.len(),
                    n.slots()
                ),
            ));
        }
        for &r in ranks {
            if r >= world {
                return Err(bad(
                    &field,
                    format!("rank {r} is not below the world size {world}"),
                ));
            }
            if let Some(j) = owner[r].replace(i) {
                let where_ = if j == i {
                    "this node".into()
                } else {
                    format!("nodes[{j}]")
                };
                return Err(bad(
                    &field,
                    format!("rank {r} is also on {where_}: every rank runs exactly once"),
                ));
            }
        }
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        out.push(sorted);
    }
    let missing: Vec<String> = (0..world)
        .filter(|&r| owner[r].is_none())
        .map(|r| r.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(bad(
            "nodes",
            format!(
                "rank(s) {} run on no node; every rank of the world size {world} runs exactly once",
                missing.join(", ")
            ),
        ));
    }
    Ok(out)
}

/// The data ports a node uses for `n` ranks (as u32, so the end may pass 65535).
fn ports(node: &NodeSpec, n: usize) -> std::ops::RangeInclusive<u32> {
    let start = u32::from(node.port);
    start..=start + u32::try_from(n.max(1) - 1).unwrap_or(u32::MAX - start)
}

/// `port 29500` or `ports 29500-29501`.
fn show(ports: &std::ops::RangeInclusive<u32>) -> String {
    if ports.start() == ports.end() {
        format!("port {}", ports.start())
    } else {
        format!("ports {}-{}", ports.start(), ports.end())
    }
}

/// Data port ranges stay below 65536 and do not overlap on one address.
fn validate_ports(
    nodes: &[NodeSpec],
    hosts: &[Host],
    ranks: &[Vec<usize>],
    bad: &Bad,
) -> Result<()> {
    for (i, n) in nodes.iter().enumerate() {
        let a = ports(n, ranks[i].len());
        if *a.end() > 65535 {
            return Err(bad(
                &format!("nodes[{i}].port"),
                format!(
                    "its {} ranks listen on {}, past 65535",
                    ranks[i].len(),
                    show(&a)
                ),
            ));
        }
        for j in 0..i {
            let b = ports(&nodes[j], ranks[j].len());
            if same_listener_host(&hosts[i], &hosts[j], nodes[i].bind_all || nodes[j].bind_all)
                && a.start() <= b.end()
                && b.start() <= a.end()
            {
                return Err(bad(
                    &format!("nodes[{i}].port"),
                    format!(
                        "{} overlap nodes[{j}] (`{}`)'s {} on the same address {}: each (address, port) is one listener",
                        show(&a), nodes[j].name, show(&b), n.address
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether two nodes' listeners share a port space: the same address, or (with a
/// wildcard bind) two loopback addresses, which are the same machine. Other distinct
/// addresses are taken for distinct machines, as nothing is resolved.
fn same_listener_host(a: &Host, b: &Host, wildcard: bool) -> bool {
    let loopback = |h: &Host| matches!(h, Host::Ip(ip) if ip.is_loopback());
    a == b || (wildcard && loopback(a) && loopback(b))
}

fn check_name(name: &str) -> std::result::Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if !name.chars().all(ok) {
        return Err(format!(
            "only letters, digits, `.`, `_` and `-`; got `{name}`"
        ));
    }
    Ok(())
}

fn is_env_name(v: &str) -> bool {
    let mut chars = v.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn first_duplicate(devices: &[u32]) -> Option<u32> {
    let mut seen = std::collections::HashSet::new();
    devices.iter().copied().find(|d| !seen.insert(*d))
}
