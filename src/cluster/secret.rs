//! The job's shared secret: where it comes from, and refusing it when it is exposed.
//!
//! The secret admits a process into the job, so the manifest (copied to every node,
//! often committed) only says where the secret is: a file or an environment variable.
//! Like OpenSSH with private keys, a secret file that its group or others may read or
//! write is refused on Unix rather than used: such a file lets any local user join the
//! job, or replace the secret.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The shortest secret accepted: 16 bytes, the size of a 128-bit key.
pub const MIN_SECRET_BYTES: usize = 16;

/// Where the shared secret is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// A file, readable by its owner only.
    File(PathBuf),
    /// An environment variable, by name.
    Env(String),
}

pub(super) fn read_secret(
    source: &SecretSource,
    manifest: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<u8>> {
    let (field, place, bytes) = match source {
        SecretSource::File(path) => ("job.secret_file", path.display().to_string(), {
            let bad = |rule: String| Error::Config {
                path: manifest.to_path_buf(),
                field: "job.secret_file".into(),
                rule,
            };
            let meta = std::fs::metadata(path).map_err(|e| {
                bad(format!(
                    "cannot read the secret file {}: {e}",
                    path.display()
                ))
            })?;
            check_private(path, &meta).map_err(bad)?;
            std::fs::read(path).map_err(|e| {
                bad(format!(
                    "cannot read the secret file {}: {e}",
                    path.display()
                ))
            })?
        }),
        SecretSource::Env(name) => match env(name) {
            Some(v) => (
                "job.secret_env",
                format!("environment variable {name}"),
                v.into_bytes(),
            ),
            None => {
                return Err(Error::Config {
                    path: manifest.to_path_buf(),
                    field: "job.secret_env".into(),
                    rule: format!(
                    "the environment variable {name} is not set (it should hold the job's secret)"
                ),
                })
            }
        },
    };
    let mut secret = bytes;
    if secret.ends_with(b"\n") {
        secret.pop();
        if secret.ends_with(b"\r") {
            secret.pop();
        }
    }
    if secret.len() < MIN_SECRET_BYTES {
        let what = if secret.is_empty() {
            "is empty".to_string()
        } else {
            format!("has {} bytes", secret.len())
        };
        return Err(Error::Config {
            path: manifest.to_path_buf(),
            field: field.into(),
            rule: format!(
                "the secret in {place} {what}; it needs at least {MIN_SECRET_BYTES} (make one with `openssl rand -hex 32`)"
            ),
        });
    }
    Ok(secret)
}

#[cfg(unix)]
fn check_private(path: &Path, meta: &std::fs::Metadata) -> std::result::Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the secret file {p} has mode {mode:04o}: its group or others may read or write it, so any local user could join the job; run `chmod 600 {p}`",
            p = path.display()
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_: &Path, _: &std::fs::Metadata) -> std::result::Result<(), String> {
    Ok(())
}
