//! The memory this process may use: its cgroup's limit (v2 `memory.max`, v1
//! `memory.limit_in_bytes`), its address-space limit (`RLIMIT_AS`), or what
//! `[runtime] memory_limit_gb` says, whichever is tightest.
//!
//! No crate reads these (they are two files and one system call), so this does.

use std::path::{Path, PathBuf};

/// A limit on the process's memory and where it comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryCap {
    /// The limit in bytes.
    pub bytes: u64,
    /// Where it was read (`"cgroup /sys/fs/cgroup/.../memory.max"`, `"RLIMIT_AS"`, ...).
    pub source: String,
    /// Whether it limits address space (`RLIMIT_AS`), which counts memory reserved and
    /// never touched, not only resident memory.
    pub address_space: bool,
}

/// Limits at or above this are no limit (cgroup v1 writes about 2^63 for none).
const UNLIMITED: u64 = 1 << 60;

/// The tightest cap on this process, if any: `configured` (GB), the cgroup's, RLIMIT_AS.
pub fn memory_cap(configured: Option<f64>) -> Option<MemoryCap> {
    let configured = configured.map(|gb| MemoryCap {
        bytes: (gb * 1e9) as u64,
        source: "[runtime] memory_limit_gb".into(),
        address_space: false,
    });
    [configured, cgroup_cap(), address_space_cap()]
        .into_iter()
        .flatten()
        .min_by_key(|c| c.bytes)
}

/// The cgroup's memory limit, v2 or v1.
fn cgroup_cap() -> Option<MemoryCap> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_files(&own)
        .into_iter()
        .find_map(|file| read_limit(&file).map(|bytes| (file, bytes)))
        .map(|(file, bytes)| MemoryCap {
            bytes,
            source: format!("cgroup {}", file.display()),
            address_space: false,
        })
}

/// The files that may hold this process's cgroup memory limit, given its
/// `/proc/self/cgroup`: its own cgroup's, then the mount's root (a container sees its
/// own cgroup as the root).
fn cgroup_files(own: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            let root = Path::new("/sys/fs/cgroup");
            files.push(root.join(path).join("memory.max"));
            files.push(root.join("memory.max"));
        } else if controllers.split(',').any(|c| c == "memory") {
            let root = Path::new("/sys/fs/cgroup/memory");
            files.push(root.join(path).join("memory.limit_in_bytes"));
            files.push(root.join("memory.limit_in_bytes"));
        }
    }
    files
}

/// A cgroup limit file's bytes, `None` for no limit or no file.
fn read_limit(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.trim().parse::<u64>().ok().filter(|&b| b < UNLIMITED)
}

/// `RLIMIT_AS`'s soft limit.
fn address_space_cap() -> Option<MemoryCap> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given.
    let status = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) };
    let bytes: u64 = limit.rlim_cur;
    (status == 0 && limit.rlim_cur != libc::RLIM_INFINITY && bytes < UNLIMITED).then(|| MemoryCap {
        bytes,
        source: "RLIMIT_AS (ulimit -v)".into(),
        address_space: true,
    })
}

/// This process's address space reserved but not resident now (thread stacks, malloc's
/// reserved arenas, libraries' unread pages): what `RLIMIT_AS` counts beyond resident
/// memory.
pub fn reserved_not_resident() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    let field = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    field("VmSize:").saturating_sub(field("VmRSS:"))
}

/// This process's resident memory now.
pub fn resident_now() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page_size())
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_cgroup_versions_name_their_limit_files() {
        let v2 = cgroup_files("0::/user.slice/run-1.scope\n");
        assert_eq!(
            v2[0],
            Path::new("/sys/fs/cgroup/user.slice/run-1.scope/memory.max")
        );
        let v1 = cgroup_files("5:cpu:/\n4:memory:/job/7\n0::/\n");
        assert_eq!(
            v1[0],
            Path::new("/sys/fs/cgroup/memory/job/7/memory.limit_in_bytes")
        );
        assert!(v1.contains(&PathBuf::from("/sys/fs/cgroup/memory.max")));
    }

    #[test]
    fn the_configured_limit_is_taken_where_it_is_tightest() {
        let cap = memory_cap(Some(0.001)).expect("a configured cap");
        assert_eq!(cap.bytes, 1_000_000);
        assert_eq!(cap.source, "[runtime] memory_limit_gb");
    }

    #[test]
    fn a_process_holds_some_resident_memory() {
        assert!(resident_now() > 0);
    }
}
