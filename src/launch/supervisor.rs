//! The supervisor: `pipetrain launch` as the user (or Slurm, or Kubernetes) starts it on
//! a node. It runs the node's worker as a child process and starts it again, resuming
//! from the newest complete checkpoint, when it dies: every worker of the job fails
//! when one does (its peers see the connection drop or fall silent), so every node's
//! supervisor restarts its worker and the job meets again, up to `job.max_restarts`
//! times, as torchrun's elastic agent restarts a worker group.

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use super::{LaunchArgs, Placement};
use crate::{Error, Result};

/// Pause before a restart, so a worker that failed at once does not spin.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// Runs this node's worker until the job ends: `Ok` when it finishes, the last failure
/// when it failed `max_restarts + 1` times or was stopped by a signal the user sent
/// (SIGINT, SIGTERM), which is not restarted.
///
/// # Errors
/// A bad manifest or configuration (before anything starts), or the worker's failure.
pub fn supervise(args: &LaunchArgs) -> Result<()> {
    let placement = Placement::load(args)?;
    let node = &placement.node;
    let job = placement.manifest.job();
    let exe = std::env::current_exe().map_err(Error::io(Path::new("pipetrain")))?;
    let mut attempt = 0u32;
    loop {
        let mut cmd = Command::new(&exe);
        cmd.arg("launch")
            .arg("--manifest")
            .arg(&args.manifest)
            .arg("--node")
            .arg(&node.name)
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
        eprintln!(
            "pipetrain launch: node {} ({}) of job {}: starting its worker (attempt {} of {})",
            node.name,
            node.source,
            job.name,
            attempt + 1,
            job.max_restarts + 1
        );
        let status = cmd.status().map_err(Error::io(exe.as_path()))?;
        if status.success() {
            return Ok(());
        }
        let why = describe(status);
        let stopped = stopped_by_user(status);
        if stopped || attempt >= job.max_restarts {
            let rule = match stopped {
                true => format!("the worker {why}; not restarted"),
                false => format!(
                    "the worker {why}, and has been restarted {attempt} time(s) (job.max_restarts = {})",
                    job.max_restarts
                ),
            };
            return Err(Error::Launch {
                node: node.name.clone(),
                reason: rule,
            });
        }
        eprintln!(
            "pipetrain launch: node {}: the worker {why}; restarting it from the newest complete checkpoint",
            node.name
        );
        attempt += 1;
        std::thread::sleep(RESTART_PAUSE);
    }
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

/// Whether the worker ended on a signal a user or scheduler sends to stop (SIGINT,
/// SIGTERM), rather than crashing or being killed (SIGKILL, e.g. out of memory).
fn stopped_by_user(status: ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        matches!(status.signal(), Some(libc::SIGINT) | Some(libc::SIGTERM))
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        false
    }
}
