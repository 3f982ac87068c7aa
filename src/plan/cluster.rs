//! `pipetrain plan --manifest`: layouts over a cluster manifest's nodes, one `pipetrain
//! launch` process a node. The workers are the nodes' slots; ranks fill the nodes in
//! order. The plan is written as the configuration and, beside it, the manifest with the
//! layout set (`plan.toml` and `plan.cluster.toml`); where every node is on this machine,
//! `--measure` launches the nodes of each measured layout here.

use std::net::{IpAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::{ClusterManifest, Host, Layout};
use crate::cost::{Link, Nodes};
use crate::telemetry::StepMetrics;
use crate::{Error, Result};

use super::{link, plan_error, Candidate, Measured, PlanRow};

/// A manifest's nodes as the planner weighs them, and the link between two of them:
/// `given` (latency in microseconds, gigabits per second), else measured on loopback.
///
/// # Errors
/// A bad manifest (naming the file, field and rule); a link that cannot be measured.
pub fn load(path: &Path, given: Option<(f64, f64)>) -> Result<(ClusterManifest, Nodes, Link)> {
    let manifest = ClusterManifest::load(path)?;
    let slots = manifest.nodes().iter().map(|n| n.slots()).collect();
    let mut machines: Vec<Option<Host>> = manifest
        .nodes()
        .iter()
        .map(|n| Some(n.host()).filter(|h| !on_this_machine(h)))
        .collect();
    machines.sort_by_key(|h| format!("{h:?}"));
    machines.dedup();
    let nodes = Nodes {
        slots,
        hosts: machines.len(),
    };
    let here = link::measure_loopback()?;
    let link = match given {
        Some((latency_us, gbps)) => link::given(latency_us, gbps, here),
        None => here,
    };
    Ok((manifest, nodes, link))
}

/// Whether `host` is this machine (a loopback address or `localhost`).
fn on_this_machine(host: &Host) -> bool {
    match host {
        Host::Ip(ip) => ip.is_loopback(),
        Host::Name(n) => n.eq_ignore_ascii_case("localhost"),
    }
}

/// Whether every node of `manifest` runs on this machine.
pub fn all_here(manifest: &ClusterManifest) -> bool {
    manifest.nodes().iter().all(|n| on_this_machine(&n.host()))
}

/// The manifest written beside the plan's configuration `out`: `NAME.cluster.toml`.
pub fn manifest_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map_or("plan".into(), |s| s.to_string_lossy());
    out.with_file_name(format!("{stem}.cluster.toml"))
}

fn layout_of(c: &Candidate) -> Layout {
    Layout {
        data_parallel: c.dp,
        pipeline_parallel: c.pp,
        tensor_parallel: c.tp,
    }
}

/// Writes `manifest` with `c`'s layout to `path`.
///
/// # Errors
/// `Config` when the nodes' slots do not hold the layout; `Io` when it cannot be written.
pub fn write_manifest(manifest: &ClusterManifest, c: &Candidate, path: &Path) -> Result<()> {
    let text = manifest.with_layout(layout_of(c), path)?.to_toml()?;
    let header = "# Written by `pipetrain plan`: the cluster manifest with the layout it chose.\n";
    crate::onnx::save_bytes(path, format!("{header}{text}").as_bytes())
}

/// Runs `row`'s configuration (the user's at `config`, `threads` intra-op threads a
/// session) for `steps` steps as a launched job: one `pipetrain launch` process per node
/// of `manifest` (every node on this machine), on free ports and a fresh secret, and
/// measures its step (and node 0's process peak) from node 0's metrics.
///
/// # Errors
/// `Plan` when a node fails or the metrics show too few steps.
pub fn measure_launched(
    worker: &Path,
    (config, manifest): (&Path, &ClusterManifest),
    row: &PlanRow,
    (threads, steps, warmup): (usize, usize, usize),
) -> Result<Measured> {
    let failed = |reason: String| plan_error("measuring a launched candidate", reason);
    let dir = std::env::temp_dir().join(format!("pipetrain-plan-{}-launch", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    let outcome = (|| {
        let text = std::fs::read_to_string(config).map_err(Error::io(config))?;
        let name = format!(".pipetrain-plan-{}-launch.toml", std::process::id());
        let path = config.parent().unwrap_or(Path::new(".")).join(name);
        let body =
            super::candidate_text(&text, (config, &path), row, (Some(steps), Some(threads)))?;
        std::fs::write(&path, body).map_err(Error::io(&path))?;
        let ran = launch_here(worker, &path, manifest, &row.candidate, &dir);
        let _ = std::fs::remove_file(&path);
        ran.map_err(failed)?;
        let metrics = dir.join("metrics.jsonl");
        let step = period(&metrics, warmup).map_err(failed)?;
        Ok(Measured {
            step,
            peak: super::verify::last_peak(&metrics),
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// The job of `config` on `manifest`'s nodes with `c`'s layout, each node a process
/// here, in `dir`: node 0 writes `metrics.jsonl`.
pub(super) fn launch_here(
    worker: &Path,
    config: &Path,
    manifest: &ClusterManifest,
    c: &Candidate,
    dir: &Path,
) -> std::result::Result<(), String> {
    let config = std::path::absolute(config).map_err(|e| e.to_string())?;
    let secret = dir.join("job.secret");
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| format!("no randomness for the job's secret: {e}"))?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&secret, hex).map_err(|e| e.to_string())?;
    let _ = std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600));
    let path = dir.join("cluster.toml");
    let text = here_manifest(manifest, c, &secret, &path)?;
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    let mut children: Vec<(String, Child)> = Vec::new();
    for (i, node) in manifest.nodes().iter().enumerate() {
        let mut cmd = Command::new(worker);
        cmd.arg("launch")
            .arg("--manifest")
            .arg(&path)
            .arg("--node")
            .arg(&node.name);
        if i == 0 {
            cmd.arg("--metrics").arg(dir.join("metrics.jsonl"));
        }
        let child = cmd
            .arg(&config)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", worker.display()))?;
        children.push((node.name.clone(), child));
    }
    wait_all(children)
}

/// Waits for every node; the first that fails stops the others, and its error is the
/// job's.
fn wait_all(mut children: Vec<(String, Child)>) -> std::result::Result<(), String> {
    let mut failure = None;
    while !children.is_empty() && failure.is_none() {
        let mut k = 0;
        while k < children.len() {
            match children[k].1.try_wait() {
                Ok(Some(status)) if status.success() => {
                    children.remove(k);
                }
                Ok(Some(status)) => {
                    let (name, child) = children.remove(k);
                    let out = child.wait_with_output().map_err(|e| e.to_string())?;
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    let error = stderr
                        .lines()
                        .rev()
                        .find(|l| l.contains("error"))
                        .unwrap_or("");
                    failure = Some(format!("node {name} failed ({status}): {error}"));
                    break;
                }
                Ok(None) => k += 1,
                Err(e) => return Err(e.to_string()),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (_, mut child) in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    failure.map_or(Ok(()), Err)
}

/// `manifest` with `c`'s layout, its nodes on free ports of their addresses, the
/// rendezvous on a free port of the first node's, and `secret` as its secret file.
fn here_manifest(
    manifest: &ClusterManifest,
    c: &Candidate,
    secret: &Path,
    path: &Path,
) -> std::result::Result<String, String> {
    let laid = manifest
        .with_layout(layout_of(c), path)
        .map_err(|e| e.to_string())?;
    let mut t: toml::Table =
        toml::from_str(&laid.to_toml().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let ips: Vec<IpAddr> = manifest
        .nodes()
        .iter()
        .map(|n| match n.host() {
            Host::Ip(ip) => ip,
            Host::Name(_) => IpAddr::from([127, 0, 0, 1]),
        })
        .collect();
    let mut taken = Vec::new();
    let rendezvous = free_ports(ips[0], 1, &mut taken)?;
    let job = t
        .get_mut("job")
        .and_then(|j| j.as_table_mut())
        .ok_or("no [job]")?;
    job.insert(
        "rendezvous".into(),
        format!("{}:{rendezvous}", ips[0]).into(),
    );
    job.insert("secret_file".into(), secret.display().to_string().into());
    job.remove("secret_env");
    job.insert("connect_timeout_s".into(), 60.into());
    let nodes = t
        .get_mut("nodes")
        .and_then(|n| n.as_array_mut())
        .ok_or("no [[nodes]]")?;
    for ((node, spec), ip) in nodes.iter_mut().zip(manifest.nodes()).zip(&ips) {
        let port = free_ports(*ip, spec.slots(), &mut taken)?;
        if let Some(n) = node.as_table_mut() {
            n.insert("address".into(), ip.to_string().into());
            n.insert("port".into(), i64::from(port).into());
        }
    }
    toml::to_string(&t).map_err(|e| e.to_string())
}

/// The first of `n` consecutive ports free on `ip` that no earlier ask in `taken` holds
/// (asked of the kernel, then freed).
fn free_ports(ip: IpAddr, n: usize, taken: &mut Vec<u16>) -> std::result::Result<u16, String> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        let first = TcpListener::bind((ip, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port on {ip}: {e}"))?
            .port();
        let ports: Vec<u16> = (0..n as u16).filter_map(|k| first.checked_add(k)).collect();
        let free = ports.len() == n
            && ports
                .iter()
                .all(|p| !taken.contains(p) && TcpListener::bind((ip, *p)).is_ok());
        if free {
            taken.extend(&ports);
            return Ok(first);
        }
    }
    Err(format!("no {n} consecutive free ports on {ip}"))
}

/// Mean seconds per step after `warmup` steps, from a metrics file's `elapsed_s`.
pub(super) fn period(metrics: &Path, warmup: usize) -> std::result::Result<f64, String> {
    let text =
        std::fs::read_to_string(metrics).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let ends: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<StepMetrics>(l).map(|s| s.elapsed_s))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("{}: {e}", metrics.display()))?;
    match ends.len() {
        n if n >= warmup + 2 => Ok((ends[n - 1] - ends[warmup]) / (n - 1 - warmup) as f64),
        n => Err(format!(
            "{}: {n} steps, {warmup} not counted: 2 or more must be counted",
            metrics.display()
        )),
    }
}
