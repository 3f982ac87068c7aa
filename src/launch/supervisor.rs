//! The supervisor: `pipetrain launch` as the user (or Slurm, or Kubernetes) starts it on
//! a node. It runs the node's worker as a child process and starts it again, resuming
//! from the newest complete checkpoint, when it dies: every worker of the job fails
//! when one does (its peers see the connection drop or fall silent), so every node's
//! supervisor restarts its worker and the job meets again, up to `job.max_restarts`
//! times, as torchrun's elastic agent restarts a worker group.
//!
//! The worker runs in a process group of its own, so that a terminal's Ctrl-C reaches
//! the supervisor alone, which hands every SIGINT and SIGTERM it gets on to the worker
//! (Kubernetes signals only a container's first process): the first stops the job after
//! a checkpoint, a second stops it at once. A worker stopped so is not restarted.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::{Ended, LaunchArgs, Placement};
use crate::{Error, Result};

/// Pause before a restart, so a worker that failed at once does not spin.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// Runs this node's worker until the job ends: [`Ended::Finished`] when it finishes
/// (or leaves an elastic job), [`Ended::Stopped`] when a SIGINT or SIGTERM stopped it
/// (not restarted), the last failure when it failed `max_restarts + 1` times. An
/// elastic job's worker that lost a peer is restarted without counting.
///
/// # Errors
/// A bad manifest or configuration (before anything starts), or the worker's failure.
pub fn supervise(args: &LaunchArgs) -> Result<Ended> {
    let placement = Placement::load(args)?;
    let node = &placement.node;
    let job = placement.manifest.job();
    let exe = std::env::current_exe().map_err(Error::io(Path::new("pipetrain")))?;
    if !args.resume {
        let again = format!(
            "pipetrain launch --manifest {} --resume {}",
            args.manifest.display(),
            args.config.display()
        );
        let cfg = &placement.cfg;
        if let Some(aside) =
            crate::train::claim_checkpoints_dir(cfg, &args.config, args.fresh, &again)?
        {
            eprintln!(
                "pipetrain launch: node {}: --fresh: the earlier run's checkpoints moved to {}",
                node.name,
                aside.display()
            );
        }
    }
    let signals = Forwarder::start()?;
    let (mut attempt, mut failures) = (0u32, 0u32);
    loop {
        eprintln!(
            "pipetrain launch: node {} ({}) of job {}: starting its worker (attempt {}; {} of {} restarts used)",
            node.name,
            node.source,
            job.name,
            attempt + 1,
            failures,
            job.max_restarts
        );
        let mut child = worker_command(&exe, args, &node.name, attempt)
            .process_group(0)
            .spawn()
            .map_err(Error::io(exe.as_path()))?;
        signals.child.store(child.id(), Ordering::SeqCst);
        let status = child.wait().map_err(Error::io(exe.as_path()));
        signals.child.store(0, Ordering::SeqCst);
        let status = status?;
        if status.success() {
            return Ok(Ended::Finished);
        }
        let why = describe(status);
        if let Some(sig) = stopped_by(status).or(signals.received()) {
            eprintln!(
                "pipetrain launch: node {}: the worker {why} (stopped by {}); not restarted",
                node.name,
                crate::train::signal_name(sig)
            );
            return Ok(Ended::Stopped(sig));
        }
        attempt += 1;
        if job.elastic && status.code() == Some(Ended::LostPeer.status().into()) {
            eprintln!(
                "pipetrain launch: node {}: the worker lost a peer; restarting it to go on with the nodes left",
                node.name
            );
            std::thread::sleep(RESTART_PAUSE);
            continue;
        }
        if failures >= job.max_restarts {
            return Err(Error::Launch {
                node: node.name.clone(),
                reason: format!(
                    "the worker {why}, and has been restarted {failures} time(s) (job.max_restarts = {})",
                    job.max_restarts
                ),
            });
        }
        failures += 1;
        eprintln!(
            "pipetrain launch: node {}: the worker {why}; restarting it from the newest complete checkpoint",
            node.name
        );
        std::thread::sleep(RESTART_PAUSE);
    }
}

/// The worker's command line: `attempt` counts its starts (0 first); every start after
/// the first resumes.
fn worker_command(exe: &Path, args: &LaunchArgs, node: &str, attempt: u32) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("launch")
        .arg("--manifest")
        .arg(&args.manifest)
        .arg("--node")
        .arg(node)
        .arg("--worker")
        .arg("--attempt")
        .arg(attempt.to_string());
    if args.resume || attempt > 0 {
        cmd.arg("--resume");
    }
    if let Some(m) = &args.metrics {
        cmd.arg("--metrics").arg(m);
    }
    cmd.arg(&args.config);
    cmd
}

/// How a worker ended, in words.
fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "ended".into(),
    }
}

/// The stop signal (SIGINT, SIGTERM) the worker ended by: killed by it, or exited with
/// `128 + signal` after stopping on it. Not a crash, nor a kill (SIGKILL, e.g. out of
/// memory).
fn stopped_by(status: ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    let sig = status.signal().or_else(|| status.code().map(|c| c - 128))?;
    [SIGINT, SIGTERM].contains(&sig).then_some(sig)
}

/// Hands the supervisor's SIGINT and SIGTERM on to the worker running now.
struct Forwarder {
    /// The worker's pid (0 between workers).
    child: Arc<AtomicU32>,
    /// The first signal received (0: none).
    first: Arc<AtomicI32>,
    handle: signal_hook::iterator::Handle,
}

impl Forwarder {
    fn start() -> Result<Forwarder> {
        let io = Error::io(Path::new("signals"));
        let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(io)?;
        let (child, first) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicI32::new(0)));
        let (to, seen) = (child.clone(), first.clone());
        let handle = signals.handle();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    let _ = seen.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                    let pid = to.load(Ordering::SeqCst);
                    if pid != 0 {
                        // SAFETY: kill(2) with a plain signal number on our own child.
                        unsafe { libc::kill(pid as libc::pid_t, sig) };
                    }
                }
            })
            .map_err(Error::io(Path::new("signals")))?;
        Ok(Forwarder {
            child,
            first,
            handle,
        })
    }

    /// The first signal received, if any.
    fn received(&self) -> Option<i32> {
        Some(self.first.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.handle.close();
    }
}
